"""The executor's scan carry: every buffer a stage keeps across ticks, with static shapes.

Per device (stage r), each buffer has a leading slot axis; the schedule's `Program` says
which slot each tick reads and writes (`schedule.lower` allocates them):

  recv_fwd, recv_bwd  [slots, b, Lseg, D]   messages received, not consumed yet
  saved     per stash group: [slots, ...]   what forwards keep for their backwards: the
                                            input ([b, Lseg, D], one group) under remat
                                            `full`, else each segment's body residuals
  head_dy   per segment k: [slots, b, L_k, D]  the head's dy, from the last chunk's forward
  kv_k, kv_v     [slots, n, b, Lkv, H, E]   K/V of each (micro-batch, chunk) in flight
  dkv_k, dkv_v   [slots, n, b, Lkv, H, E]   their cotangents from later segments (these
                                            four and `saved` as `kv_cache` storage words:
                                            uint16 for bf16 activations)
  weight    per segment k (split tables only): what B leaves its W, (matmul inputs, their
            output cotangents), each [slots, n, b, L_k, ...] (`SegmentUnit.weight_avals`)
  grads     {"layers": [V, n, ...], "shared": ...}  accumulated in the parameter dtype
  loss      []                              summed, scaled token losses

Letters: b micro-batch rows, n layers per chunk, Lseg the longest segment, L_k segment k's
length, Lkv the cached prefix (`PipelineSpec.kv_len`), H heads of width E, V chunks per
stage. With tensor parallelism over t devices a device holds Lseg/t and L_k/t of the
positions in messages, stashed inputs and head_dy, and H/t heads in the K/V buffers.
A slot count of 0 still allocates one slot (an idle phase reads it), except in an
evaluation's carry, which has no backward buffers at all.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from seqpipe.kernels import kv_cache
from seqpipe.models import model
from seqpipe.pipeline import units


@struct.dataclass
class Carry:
    recv_fwd: jax.Array
    recv_bwd: jax.Array
    saved: tuple  # per group, a tuple of [slots, ...] arrays
    head_dy: tuple  # per segment, [slots, b, L_k, D]
    kv_k: jax.Array
    kv_v: jax.Array
    dkv_k: jax.Array
    dkv_v: jax.Array
    grads: dict
    loss: jax.Array
    weight: tuple = ()  # per segment, B-to-W buffers; empty unless the table splits

    def nbytes(self) -> dict[str, int]:
        """Bytes of each field (the carry may hold arrays or ShapeDtypeStructs)."""
        return {
            name: sum(_nbytes(x) for x in jax.tree.leaves(getattr(self, name)))
            for name in self.__dataclass_fields__
        }


def _nbytes(x) -> int:
    return math.prod(x.shape) * np.dtype(x.dtype).itemsize


def abstract(spec, rows: int, layers_VxN, shared) -> Carry:
    """The carry's shapes and dtypes for micro-batches of `rows` sequences; the gradients
    take the shapes and dtypes of the stage's parameters (`layers_VxN`, `shared`)."""
    cfg, prog, sds = spec.cfg, spec.program, jax.ShapeDtypeStruct
    act = jnp.dtype(cfg.dtype)
    segs = [units.SegmentUnit(spec, k) for k in range(spec.segments)]

    def slots(count, aval):
        return sds((max(count, 1),) + aval.shape, aval.dtype)

    msg = sds((rows, spec.msg_len, cfg.d_model), act)
    # Stored as words (`kv_cache.storage_dtype`): updated in place on every backend.
    kv_shape = (spec.chunk_layers, rows, spec.kv_len, cfg.local_kv_heads, cfg.head_dim)
    kv = sds(kv_shape, kv_cache.storage_dtype(act))
    like = lambda tree: jax.tree.map(lambda x: sds(x.shape, x.dtype), tree)  # noqa: E731
    if spec.forward_only:  # an evaluation keeps nothing for a backward
        none = lambda aval: sds((0,) + aval.shape, aval.dtype)  # noqa: E731
        return Carry(
            recv_fwd=slots(prog.num_recv_fwd, msg),
            recv_bwd=none(msg),
            saved=(),
            head_dy=(),
            kv_k=slots(prog.num_kv, kv),
            kv_v=slots(prog.num_kv, kv),
            dkv_k=none(kv),
            dkv_v=none(kv),
            grads={},
            loss=sds((), jnp.float32),
        )
    groups = {}  # group -> the first segment in it (every member has its shapes)
    for u in segs:
        groups.setdefault(u.group, u)
    # Stored as words too: on CPU a bf16 slot write converts its window to float32.
    words = lambda aval: sds(aval.shape, kv_cache.storage_dtype(aval.dtype))  # noqa: E731
    saved = tuple(
        tuple(slots(count, words(a)) for a in groups[g].saved_avals(rows, depth=spec.uneven))
        for g, count in enumerate(units.strategy(spec).slot_counts(prog))
    )
    return Carry(
        recv_fwd=slots(prog.num_recv_fwd, msg),
        recv_bwd=slots(prog.num_recv_bwd, msg),
        saved=saved,
        head_dy=tuple(
            slots(n, u.head_dy_aval(rows)) for n, u in zip(prog.num_head, segs, strict=True)
        ),
        kv_k=slots(prog.num_kv, kv),
        kv_v=slots(prog.num_kv, kv),
        dkv_k=slots(prog.num_dkv, kv),
        dkv_v=slots(prog.num_dkv, kv),
        grads={"layers": like(layers_VxN), "shared": like(shared)},
        loss=sds((), jnp.float32),
        weight=tuple(
            jax.tree.map(lambda a, n=n: slots(n, a), u.weight_avals(rows))
            for n, u in zip(prog.num_wgt, segs, strict=True)
        )
        if spec.schedule.split
        else (),
    )


def of_spec(spec, rows: int) -> Carry:
    """The carry of any stage of `spec` (all have the same shapes), from the spec alone."""
    sds = jax.ShapeDtypeStruct
    shapes = model.param_shapes(spec.cfg)
    chunks = (spec.virtual, spec.chunk_layers)
    layers = jax.tree.map(lambda x: sds(chunks + x.shape[1:], x.dtype), shapes["layers"])
    shared = {k: x for k, x in shapes.items() if k != "layers"}
    return abstract(spec, rows, layers, shared)


def breakdown(spec, rows: int) -> dict:
    """Bytes of the executor's scan carry on one device, by buffer, and their sum `carry`.

    `rows` is the number of sequences in one micro-batch on one data replica.
    """
    b = of_spec(spec, rows).nbytes()
    keeps = spec.policy.keeps_residuals
    out = {
        "stash": 0 if keeps else b["saved"],
        "res": b["saved"] if keeps else 0,
        "head": b["head_dy"],
        "messages": b["recv_fwd"] + b["recv_bwd"],
        "kv": b["kv_k"] + b["kv_v"],
        "dkv": b["dkv_k"] + b["dkv_v"],
        "grads": b["grads"],
        "loss": b["loss"],
        # B-to-W buffers of a split table: the weight matmuls' inputs and output cotangents
        # that B leaves its W, per segment, [slots, n, b, L_k] x `model.matmul_shapes` values.
        "weight": b["weight"],
    }
    out["carry"] = sum(out.values())
    # What the algorithm needs: K/V of prefix positions only (no segment attends to the
    # last segment's K/V, so 1F1B needs none), and a dK/dV accumulator only for the
    # micro-batches whose backward has started but not finished.
    cfg, prog = spec.cfg, spec.program
    shape = (spec.chunk_layers, rows, spec.offsets[-1], cfg.local_kv_heads, cfg.head_dim)
    per_slot = math.prod(shape) * jnp.dtype(cfg.dtype).itemsize
    out["kv_needed"] = 2 * prog.num_kv * per_slot
    out["dkv_needed"] = 2 * prog.num_dkv * per_slot
    return out


def zeros(avals: Carry) -> Carry:
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), avals)


def masked_write(buf: jax.Array, start: tuple, new: jax.Array, active) -> jax.Array:
    """buf[start : start + new.shape] = new where active; touches only that window."""
    old = jax.lax.dynamic_slice(buf, start, new.shape)
    return jax.lax.dynamic_update_slice(buf, jnp.where(active, new, old), start)


def write_slot(buf: jax.Array, slot, value: jax.Array, active) -> jax.Array:
    """buf[slot] = value where active."""
    return masked_write(buf, (slot,) + (0,) * value.ndim, value[None], active)


def put_slot(buf: jax.Array, slot, value: jax.Array) -> jax.Array:
    """buf[slot] = value, in place."""
    return jax.lax.dynamic_update_slice(buf, value[None], (slot,) + (0,) * value.ndim)
