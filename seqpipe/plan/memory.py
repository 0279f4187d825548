"""The analytic memory model: bytes per device of a candidate's step, without compiling it.

    total = state + carry + cast + unit + head + update

- state: parameters (param dtype) and the two AdamW moments (float32) this device holds,
  from each leaf's sharding (`sharding.leaf_spec`'s rules: layers over `stage`, the
  tensor dimension over `tensor`, moments over `data` when the optimizer is sharded);
- carry: the executor's scan carry, exactly (`tools.memory.carry_bytes`: stash or
  residuals, head, messages, K/V, dK/dV, B-to-W buffers, the stage's float32 gradients);
- cast: the stage's weights in the compute dtype, cast once a step (`remat.Policy.casts_once`);
- unit: one backward unit's working set: under `full` the recomputed chunk's residuals
  of its longest segment, every layer's; else one layer's (`units.ResidualLayout`);
- head: the last stage's logits for one segment, float32, and their cotangent;
- update: the optimizer's new parameters and moments before they replace the old.

`LOW` and `HIGH` bound the compiled total over the estimate (measured,
`docs/planner.md`); pruning rejects a candidate only when even LOW times its estimate
exceeds the budget (`verdict`).
"""

from __future__ import annotations

import functools
import math

# The compiled peak over the estimate stayed within [LOW, HIGH] on the checked
# candidates (docs/planner.md), with room to spare: pruning trusts no more than that.
LOW = 0.75
HIGH = 1.25


def _leaf_bytes(path, x, data: int, tensor: int, moments: bool) -> int:
    from seqpipe import sharding

    n = math.prod(x.shape)
    tdim = sharding.tensor_split_dim(path, x.shape, tensor) if tensor > 1 else None
    n //= tensor if tdim is not None else 1
    if moments and sharding.data_split_dim(path, x.shape, data, tensor) is not None:
        n //= data
    return n


@functools.cache
def _global_shapes(cfg):
    import dataclasses

    import jax

    from seqpipe import model

    whole = dataclasses.replace(cfg, tensor=1)
    return jax.eval_shape(lambda: model.init_params(whole, jax.random.key(0)))


def state_bytes(cfg, stage_layers: int, data: int, shard_optimizer: bool) -> dict:
    """Bytes of the parameters and the AdamW moments on one device, and of the stage's
    parameters alone (`stage`, one copy in the param dtype; `count` of them).
    `stage_layers`: the layers a stage holds (the deepest; an uneven split pads to it)."""
    import jax
    import numpy as np

    shapes = _global_shapes(cfg)
    itemsize = np.dtype(cfg.param_dtype).itemsize
    params = moments = stage = 0
    for path, x in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        from seqpipe import sharding

        shape = ((stage_layers,) + x.shape[1:]) if sharding.in_layers(path) else x.shape
        leaf = jax.ShapeDtypeStruct(shape, x.dtype)
        local = _leaf_bytes(path, leaf, data, cfg.tensor, False)
        params += local * itemsize
        stage += local * itemsize
        moments += 2 * 4 * _leaf_bytes(path, leaf, data, cfg.tensor, shard_optimizer)
    return {"params": params, "moments": moments, "stage": stage, "count": stage // itemsize}


@functools.lru_cache(maxsize=4096)
def layer_residual_bytes(cfg, length: int, rows: int, prefix: int) -> int:
    """Bytes of one layer's vjp residuals for `rows` x `length` tokens after `prefix`
    cached ones (what `remat=none` keeps), traced on one device with tensor = 1 and
    divided by the tensor devices (their activations and matmul outputs are split)."""
    import dataclasses

    from seqpipe import schedule, units
    from seqpipe.spec import PipelineSpec

    whole = dataclasses.replace(cfg, tensor=1)
    lengths = (prefix, length) if prefix else (length,)
    table = schedule.build("seq1f1b" if prefix else "1f1b", 2, 2, len(lengths))
    spec = PipelineSpec(whole, table, schedule.lower(table), lengths, "none", (1,) * 2)
    unit = units.SegmentUnit(spec, len(lengths) - 1, layers=1)
    stored = unit.layer_layout(rows).stored
    total = sum(math.prod(a.shape) * a.dtype.itemsize for a in stored)
    return total // cfg.tensor


def working_bytes(spec, rows: int) -> dict:
    """The terms beyond the state and the carry (see the module docstring)."""
    cfg = spec.cfg
    longest = max(range(spec.segments), key=lambda k: (spec.lengths[k], k))
    one = max(
        layer_residual_bytes(cfg, spec.lengths[k], rows, spec.offsets[k])
        for k in {longest, spec.segments - 1}
    )
    unit = one * (spec.chunk_layers if spec.remat == "full" else 1)
    act = 2 if cfg.dtype == "bfloat16" else 4
    loss_len = cfg.loss_chunk if cfg.loss_chunk > 0 else spec.seg_max
    head = 2 * rows * min(loss_len, spec.seg_max) * (cfg.vocab_size // cfg.tensor) * 4
    return {"unit": unit, "head": head, "act": act}


def estimate(spec, rows: int, data: int, shard_optimizer: bool) -> dict:
    """The model's bytes per device of the step, by term, and `total`."""
    from seqpipe.tools import memory as tool_memory

    st = state_bytes(spec.cfg, spec.chunk_layers * spec.virtual, data, shard_optimizer)
    carry = tool_memory.carry_bytes(spec, rows)["carry"]
    work = working_bytes(spec, rows)
    per_param = work.pop("act") / 4  # compute dtype over float32
    cast = int(st["stage"] * per_param) if spec.policy.casts_once else 0
    out = {
        "state": st["params"] + st["moments"],
        "carry": int(carry),
        "cast": cast,
        "unit": work["unit"],
        "head": work["head"],
        "update": st["params"] + st["moments"],
    }
    out["total"] = sum(out.values())
    return out


def verdict(estimate_bytes: int, budget: int) -> str:
    """`fits` (even at HIGH times the estimate), `over` (even at LOW times it: the
    analytic model rejects it alone) or `boundary` (only a compile decides)."""
    if estimate_bytes * HIGH <= budget:
        return "fits"
    if estimate_bytes * LOW > budget:
        return "over"
    return "boundary"
