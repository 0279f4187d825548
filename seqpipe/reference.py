"""The un-pipelined model's loss and gradients: the oracle every pipeline schedule must match."""

import dataclasses

import jax

from seqpipe import model
from seqpipe.model import GPTConfig, Params


def loss_and_grads(
    params: Params, tokens_BxL1: jax.Array, cfg: GPTConfig, checkpoint: str | None = None
) -> tuple[jax.Array, Params]:
    """Mean next-token loss of whole sequences, and its gradient w.r.t. every parameter.

    `checkpoint`: a `model.CHECKPOINT_POLICIES` key applied to every layer, or None
    (`remat.POLICIES[name].reference` for a `pipeline.remat` setting). The model runs
    whole (XLA partitions it over whatever mesh the arguments are on): a pipeline's
    `cfg.tensor` does not apply here."""
    cfg = dataclasses.replace(cfg, tensor=1)
    return jax.value_and_grad(model.loss)(params, tokens_BxL1, cfg, None, checkpoint)
