"""The analytic memory model: bytes per device of a candidate's step, without compiling it.

    total = state + carry + cast + max(unit, head) + update

- state: parameters (param dtype) and the two AdamW moments (float32) this device holds,
  from each leaf's sharding (`sharding.leaf_spec`'s rules: layers over `stage`, the
  tensor dimension over `tensor`, moments over `data` when the optimizer is sharded, a
  mixture's experts and their moments over `data`);
- carry: the executor's scan carry, exactly (`carry.breakdown`: stash or
  residuals, head, messages, K/V, dK/dV, B-to-W buffers, the stage's float32 gradients);
- cast: the stage's weights in the compute dtype, cast once a step (`remat.Policy.casts_once`);
- unit: one backward unit's working set: under `full` the recomputed chunk's residuals
  of its longest segment, every layer's; else one layer's (`units.ResidualLayout`);
- head: the last stage's logits for one segment, float32 (one copy);
- gather: with mesh.context = C > 1, one layer's K/V of the whole prefix and segment,
  all-gathered from the context devices, and in the backward their cotangents;
- update: the optimizer's new parameters and moments before they replace the old.

Under context parallelism everything but the state and the update is one context device's:
the spec's lengths, the carry (`carry.breakdown`) and the residuals (traced on C devices)
hold 1/C of the positions; parameters and moments are whole on each.

How far the estimate is trusted against a budget: `plan.bounds`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import numpy as np

from seqpipe import schedule
from seqpipe.models import model
from seqpipe.parallel import sharding
from seqpipe.pipeline import carry, units
from seqpipe.pipeline import remat as remat_lib
from seqpipe.pipeline.spec import PipelineSpec


def _leaf_bytes(path, x, data: int, tensor: int, moments: bool, experts: bool = False) -> int:
    n = math.prod(x.shape)
    tdim = sharding.tensor_split_dim(path, x.shape, tensor) if tensor > 1 else None
    n //= tensor if tdim is not None else 1
    if experts and sharding.is_expert(path):  # split over the replicas, moments and all
        return n // data
    if moments and sharding.data_split_dim(path, x.shape, data, tensor) is not None:
        n //= data
    return n


@functools.cache
def _global_shapes(cfg):
    whole = dataclasses.replace(cfg, tensor=1)
    return jax.eval_shape(lambda: model.init_params(whole, jax.random.key(0)))


def state_bytes(cfg, stage_layers: int, data: int, shard_optimizer: bool) -> dict:
    """Bytes of the parameters and the AdamW moments on one device, and of the stage's
    parameters alone (`stage`, one copy in the param dtype; `count` of them).
    `stage_layers`: the layers a stage holds (the deepest; an uneven split pads to it)."""
    shapes = _global_shapes(cfg)
    itemsize = np.dtype(cfg.param_dtype).itemsize
    params = moments = stage = 0
    experts = bool(cfg.num_experts)
    for path, x in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        shape = ((stage_layers,) + x.shape[1:]) if sharding.in_layers(path) else x.shape
        leaf = jax.ShapeDtypeStruct(shape, x.dtype)
        local = _leaf_bytes(path, leaf, data, cfg.tensor, False, experts)
        params += local * itemsize
        stage += local * itemsize
        moments += 2 * 4 * _leaf_bytes(path, leaf, data, cfg.tensor, shard_optimizer, experts)
    return {"params": params, "moments": moments, "stage": stage, "count": stage // itemsize}


PROBE = 128  # tokens of a traced segment; residuals are fitted in the segment and K/V length


# Per model: 5 policies x 2 prefix lengths x split or not x 4 tensor and 4 context sizes.
@functools.lru_cache(maxsize=1024)
def _layer_residuals(cfg, remat: str, cached: int, split: bool = False, context: int = 1) -> int:
    """Bytes one layer's forward keeps under `remat` (`none`: every vjp residual; what
    `dots` or `layer` keep) on one device, for a segment of PROBE tokens after `cached`
    ones (a context device's: the sequence's are `context` times as many), traced at
    `cfg.tensor` (a layer's input and norms stay whole on each tensor device, its matmul
    outputs are split) and on `context` devices (the attention checkpointed as
    `context.attend` does it); `split`: under a table that splits B from W, whose
    layers keep what W reads too."""
    table = schedule.build("seq_zb_h1" if split else "seq1f1b", 2, 2, 2)
    lower = schedule.lower(table)
    spec = PipelineSpec(cfg, table, lower, (cached, PROBE), remat, (1, 1), context=context)
    stored = units.SegmentUnit(spec, 1, layers=1).layer_layout(1).stored
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in stored)


def residual_bytes(
    cfg,
    remat: str,
    tokens: int,
    kv_len: int,
    split: bool = False,
    context: int = 1,
    rows: int = 1,
) -> float:
    """Bytes one layer keeps for `tokens` of segments (on this device; `rows` rows of
    them) attending over `kv_len` keys (of the sequence), on one device: a + b x kv_len
    per token, fitted to two traces. b is zero where attention keeps no scores (the fused
    kernels, `blockwise`); `xla` attention under `none` keeps its probabilities, which
    grow with the K/V length. Under context parallelism no attention keeps its scores
    (`context.attend` saves only the output and log-sum-exp) but `none` keeps the
    layer's local K/V prefix, read out of the cache: the growth is per row and key
    instead. `split`, `context`: as `_layer_residuals`."""
    short = _layer_residuals(cfg, remat, PROBE, split, context)
    long = _layer_residuals(cfg, remat, 3 * PROBE, split, context)
    keys = 2 * PROBE * context  # the sequence's K/V length: 2 PROBE -> 4 PROBE a device
    growth = (long - short) / keys  # a key's, for PROBE tokens of one row
    if context > 1:
        return tokens * (short - growth * keys) / PROBE + rows * growth * kv_len
    per_key = growth / PROBE
    per_token = short / PROBE - per_key * keys
    return tokens * (per_token + per_key * kv_len)


def carry_bytes(spec_full, rows: int, remat: str) -> int:
    """The carry's bytes under `remat`, from the carry of the same table under `full`
    (exact, `carry.breakdown`): a policy that keeps residuals keeps each stash
    slot's n layers' residuals instead of its input."""
    full = _full_carry(spec_full, rows)
    if not remat_lib.POLICIES[remat].keeps_residuals:
        return full["carry"]
    cfg = spec_full.cfg
    act = 2 if cfg.dtype == "bfloat16" else 4
    slots = full["stash"] / (rows * spec_full.msg_len * cfg.d_model * act)
    # Each slot's segment priced at the whole sequence's K/V: exact for the last segment,
    # an upper bound for the others.
    tokens, kv_len = rows * spec_full.seg_max, sum(spec_full.sequence_lengths)
    split, context = spec_full.schedule.split, spec_full.context
    layer = residual_bytes(cfg, remat, tokens, kv_len, split, context, rows)
    res = slots * spec_full.chunk_layers * layer
    if context > 1 and _grows(cfg, remat, split, context):
        # Each segment keeps its own prefix: their residuals differ, so the executor keeps
        # a pool of slots per segment (`Program.num_res`), each at its own K/V.
        segments = zip(
            spec_full.program.num_res,
            spec_full.lengths,
            itertools.accumulate(spec_full.sequence_lengths),
            strict=True,
        )
        res = spec_full.chunk_layers * sum(
            n * residual_bytes(cfg, remat, rows * length, end, split, context, rows)
            for n, length, end in segments
        )
    return int(full["carry"] - full["stash"] + res)


def _grows(cfg, remat: str, split: bool, context: int) -> bool:
    """Whether a layer's residuals grow with the K/V before its segment."""
    return _layer_residuals(cfg, remat, PROBE, split, context) != _layer_residuals(
        cfg, remat, 3 * PROBE, split, context
    )


_CARRIES: dict = {}


def _full_carry(spec_full, rows: int) -> dict:
    key = (id(spec_full), rows)
    if key not in _CARRIES:
        _CARRIES[key] = (spec_full, carry.breakdown(spec_full, rows))
    return _CARRIES[key][1]


def estimate(spec_full, remat: str, rows: int, data: int, shard_optimizer: bool) -> dict:
    """The model's bytes per device of the step under `remat`, by term, and `total`;
    `spec_full` is the candidate's spec with remat `full` (its table and segments)."""
    cfg = spec_full.cfg
    policy = remat_lib.POLICIES[remat]
    st = state_bytes(cfg, spec_full.chunk_layers * spec_full.virtual, data, shard_optimizer)
    act = 2 if cfg.dtype == "bfloat16" else 4
    tokens, kv_len = rows * spec_full.seg_max, sum(spec_full.sequence_lengths)
    layer = residual_bytes(cfg, "none", tokens, kv_len, context=spec_full.context, rows=rows)
    loss_len = cfg.loss_chunk if cfg.loss_chunk > 0 else spec_full.seg_max
    out = {
        "state": st["params"] + st["moments"],
        "carry": carry_bytes(spec_full, rows, remat),
        "cast": int(st["stage"] * act / 4) if policy.casts_once else 0,
        # One backward unit's working set: the recomputed chunk's residuals under `full`,
        # one layer's otherwise.
        "unit": int(layer * (spec_full.chunk_layers if remat == "full" else 1)),
        # The last stage's logits of one segment, float32 (XLA fuses their softmax and
        # cotangent into the buffer: one copy, on the compiled gpt_1b steps).
        "head": rows * min(loss_len, spec_full.seg_max) * (cfg.vocab_size // cfg.tensor) * 4,
        # The last segment's layer gathers the K/V of the whole sequence, and its backward
        # holds their cotangents before the reduce-scatter.
        "gather": 0
        if spec_full.context == 1
        else 2 * rows * kv_len * 2 * cfg.local_kv_heads * cfg.head_dim * act,
        "update": st["params"] + st["moments"],
    }
    # The head runs in the last chunk's forward, the unit's working set in a backward:
    # never live together.
    out["total"] = sum(out.values()) - min(out["unit"], out["head"])
    return out
