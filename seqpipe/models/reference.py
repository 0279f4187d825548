"""The un-pipelined model's loss and gradients: the oracle every pipeline schedule must match."""

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from seqpipe.kernels.attention import KERNEL_PLATFORMS
from seqpipe.models import document_mask, model
from seqpipe.models.model import GPTConfig, Params
from seqpipe.parallel.sharding import DATA


def loss_and_grads(
    params: Params, tokens_BxL1, cfg: GPTConfig, checkpoint: str | None = None
) -> tuple[jax.Array, Params]:
    """Mean next-token loss of whole sequences, and its gradient w.r.t. every parameter.

    `tokens_BxL1`: the tokens, or a batch dict of them and, packed rows, "documents" and
    "positions" (`seqpipe.models.document_mask`: the mean over the counted targets, each token
    attending within its document where `cfg.document_mask` says so).
    `checkpoint`: a `model.CHECKPOINT_POLICIES` key applied to every layer, or None
    (`remat.POLICIES[name].reference` for a `pipeline.remat` setting). The model runs
    whole (XLA partitions it over whatever mesh the arguments are on): a pipeline's
    `cfg.tensor` does not apply here."""
    cfg = dataclasses.replace(cfg, tensor=1, expert_parallel=1)
    return jax.value_and_grad(batch_loss)(params, tokens_BxL1, cfg, checkpoint)


def batch_loss(params: Params, batch, cfg: GPTConfig, checkpoint: str | None = None):
    """`model.loss` of a batch: tokens [B, L+1], or a dict of them and, packed rows,
    "documents" and "positions" (`seqpipe.models.document_mask`)."""
    if not isinstance(batch, dict):
        return model.loss(params, batch, cfg, None, checkpoint)
    packed = {k: batch[k] for k in ("documents", "positions") if k in batch}
    return model.loss(params, batch["tokens"], cfg, None, checkpoint, **packed)


def per_shard(fn, mesh: jax.sharding.Mesh):
    """`fn(params, batch)` (a mean over the rows, and what else is averaged with it) run in
    a shard_map: each `data` shard's rows on its devices, the parameters whole on every
    device, the results averaged over `data` into the mean of the whole batch. For an
    attention kernel that XLA cannot partition (a Pallas call): inside the shard_map it runs
    on local arrays, as in the pipeline's stages.

    Unpacked shards are equal, so their plain mean is the batch's. A packed shard's mean is
    over its own counted targets, which differ between shards: each is weighted by its
    count (a shard with none adds nothing)."""

    def local(params, batch):
        out = fn(params, batch)
        if not (isinstance(batch, dict) and "documents" in batch):
            return jax.lax.pmean(out, DATA)
        count = jnp.sum(document_mask.counted_targets(batch["documents"])).astype(jnp.float32)
        weight = count / jax.lax.psum(count, DATA)
        weighted = jax.tree.map(lambda x: jnp.where(count > 0, x * weight, 0), out)
        return jax.lax.psum(weighted, DATA)

    # The gradients are taken inside, per device: no implicit cast may add a psum to them.
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(DATA)), out_specs=P(), check_vma=False)


def unpipelined(fn, cfg: GPTConfig, mesh: jax.sharding.Mesh):
    """`fn(params, tokens)` of the model without a pipeline: XLA partitions it over the
    mesh, unless its attention is a Pallas kernel, which XLA cannot partition; then each
    data shard runs whole on its devices (`per_shard`)."""
    return per_shard(fn, mesh) if cfg.attention in KERNEL_PLATFORMS else fn
