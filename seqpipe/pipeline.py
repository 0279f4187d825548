"""The pipeline executor: any valid schedule table, run inside shard_map over (data, stage).

One SPMD program: a `lax.scan` over ticks; in each tick every stage runs at most one
forward unit and one backward unit (a unit is one segment of one micro-batch through one
model chunk), then two `ppermute`s move activations to the next stage and cotangents to
the previous one. Idle halves are skipped with `lax.cond`, so bubbles compute nothing.
Gradients accumulate in the scan carry and are averaged over `data` once, after the loop.

Per device (stage r) the carry holds, all with static shapes:
  stash   [slots, b, Lseg, D]   inputs of forwards whose backward has not run (full remat)
  kv, dkv [slots, n, b, Lkv, H, E] K/V of each micro-batch in flight, and their cotangents
          accumulated from later segments (dK/dV of a prefix is complete only after every
          later segment's backward, hence backwards in descending segment order)
  recv    [slots, b, Lseg, D]   messages received but not consumed yet
Letters: b micro-batch rows, n layers per chunk, Lseg the longest segment.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from seqpipe import model, partition, schedule
from seqpipe.model import GPTConfig, Params
from seqpipe.sharding import DATA, STAGE


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    """Everything static about a pipelined step."""

    cfg: GPTConfig
    schedule: schedule.Schedule
    program: schedule.Program
    lengths: tuple[int, ...]  # segment lengths, summing to the sequence length
    remat_layers: bool = False  # checkpoint each layer inside a unit's recomputation

    @property
    def stages(self) -> int:
        return self.schedule.stages

    @property
    def virtual(self) -> int:
        return self.schedule.virtual

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.cumsum((0,) + self.lengths[:-1]))

    @property
    def kv_len(self) -> int:
        """Positions the KV cache keeps: only segments before the last are read back as a
        prefix, and each is written as a window of the longest segment's length."""
        seg_max = max(self.lengths)
        return max((o + seg_max for o in self.offsets[:-1]), default=0)


def make_spec(config, seq_len: int | None = None) -> PipelineSpec:
    """Build the schedule table and segment partition from a config."""
    cfg = GPTConfig.from_config(config.model)
    p = config.pipeline
    seq_len = seq_len or config.train.seq_len
    lengths = partition.segment_lengths(
        seq_len,
        p.segments,
        p.partition,
        d_model=cfg.d_model,
        num_heads=cfg.num_heads,
        d_ff=cfg.d_ff,
        vocab_size=cfg.vocab_size,
        num_layers=cfg.num_layers,
        multiple=p.partition_multiple,
    )
    costs = partition.segment_flops(
        lengths,
        d_model=cfg.d_model,
        num_heads=cfg.num_heads,
        d_ff=cfg.d_ff,
        vocab_size=cfg.vocab_size,
        num_layers=cfg.num_layers,
    )
    table = schedule.build(
        p.schedule,
        config.mesh.stage,
        p.microbatches,
        p.segments,
        p.virtual_stages,
        p.inflight,
        costs,
    )
    return PipelineSpec(cfg, table, schedule.lower(table), tuple(lengths), bool(p.remat))


# Parameter layout. Canonical layers are [N, ...]; global chunk g = c * S + r holds layers
# [g * n, (g + 1) * n). The stage layout is [S, V, n, ...], sharded over `stage` on axis 0.
# With V = 1 both layouts put stage r's layers in the same place, so conversion is free.


def to_stage_layout(layers: Params, stages: int, virtual: int) -> Params:
    def f(w):
        n = w.shape[0] // (stages * virtual)
        w = w.reshape(virtual, stages, n, *w.shape[1:])
        return jnp.swapaxes(w, 0, 1)

    return jax.tree.map(f, layers)


def from_stage_layout(layers: Params) -> Params:
    def f(w):
        s, v, n = w.shape[:3]
        return jnp.swapaxes(w, 0, 1).reshape(v * s * n, *w.shape[3:])

    return jax.tree.map(f, layers)


def _unit(spec: PipelineSpec, seg: int, scale: float):
    """The function of one unit of segment `seg`, for vjp: embedding on global chunk 0,
    head and scaled summed loss on the last one (chosen with lax.cond at run time)."""
    cfg, offset, length = spec.cfg, spec.offsets[seg], spec.lengths[seg]
    seg_max = max(spec.lengths)

    def f(p_chunk, shared, x_in, k_prefix, v_prefix, tokens, targets, first, last):
        x = jax.lax.cond(
            first,
            lambda: model.embed(shared, tokens, cfg),
            lambda: x_in[:, :length],
        )
        y, k_seg, v_seg = model.layers(
            p_chunk, x, k_prefix, v_prefix, offset, cfg, spec.remat_layers
        )
        loss = jax.lax.cond(
            last,
            lambda: model.token_loss_sum(model.logits(shared, y, cfg), targets) * scale,
            lambda: jnp.zeros((), jnp.float32),
        )
        y = jnp.pad(y, ((0, 0), (0, seg_max - length), (0, 0)))
        return y, loss, k_seg, v_seg

    return f


def _zeros_like_tree(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def _masked_write(buf: jax.Array, start: tuple, new: jax.Array, active: jax.Array) -> jax.Array:
    """buf[start : start + new.shape] = new where active; touches only that window."""
    old = jax.lax.dynamic_slice(buf, start, new.shape)
    return jax.lax.dynamic_update_slice(buf, jnp.where(active, new, old), start)


def _stage_body(spec: PipelineSpec, layers_VxN: Params, shared: Params, tokens_BxL1: jax.Array):
    """Runs on one (data, stage) device; returns local loss and gradients.

    The conditionals around a unit return only that unit's results; the big buffers
    (stash, KV, dK/dV, gradients) are updated once per tick outside them, masked by
    the tick's op. Updating them inside the branches made XLA copy whole buffers in
    every branch, every tick.
    """
    cfg, prog, S, V = spec.cfg, spec.program, spec.stages, spec.virtual
    K, M = len(spec.lengths), spec.schedule.microbatches
    stage = jax.lax.axis_index(STAGE)
    last_chunk = V * S - 1
    rows = tokens_BxL1.shape[0] // M
    seq_len = tokens_BxL1.shape[1] - 1
    tokens_MxbxL1 = tokens_BxL1.reshape(M, rows, seq_len + 1)
    scale = 1.0 / (tokens_BxL1.shape[0] * seq_len)
    seg_max, kv_len = max(spec.lengths), spec.kv_len
    n_layers = jax.tree.leaves(layers_VxN)[0].shape[1]
    act_dtype = jnp.dtype(cfg.dtype)
    act = jnp.zeros((rows, seg_max, cfg.d_model), act_dtype)
    heads = (cfg.num_heads, cfg.head_dim)
    kv_seg_zero = jnp.zeros((n_layers, rows, seg_max, *heads), act_dtype)
    kv_all_zero = jnp.zeros((n_layers, rows, kv_len, *heads), act_dtype)
    offsets = jnp.asarray(spec.offsets, jnp.int32)
    units = [_unit(spec, k, scale) for k in range(K)]

    def segment_tokens(mb, seg):
        off, length = spec.offsets[seg], spec.lengths[seg]
        window = jax.lax.dynamic_index_in_dim(tokens_MxbxL1, mb, keepdims=False)
        return window[:, off : off + length], window[:, off + 1 : off + length + 1]

    def chunk_params(chunk):
        return jax.tree.map(
            lambda w: jax.lax.dynamic_index_in_dim(w, chunk, keepdims=False), layers_VxN
        )

    def pad_to(x, length):
        return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, 0), (0, 0)))

    def forward(op, x_in, k_cache, v_cache):
        """One forward unit: (y, loss, K/V of the segment padded to the longest segment)."""
        g = op["fwd_chunk"] * S + stage

        def run(seg):
            off = spec.offsets[seg]
            tokens, targets = segment_tokens(op["fwd_mb"], seg)
            y, loss, k_seg, v_seg = units[seg](
                chunk_params(op["fwd_chunk"]),
                shared,
                x_in,
                k_cache[:, :, :off],
                v_cache[:, :, :off],
                tokens,
                targets,
                g == 0,
                g == last_chunk,
            )
            return y, loss, pad_to(k_seg, seg_max), pad_to(v_seg, seg_max)

        return jax.lax.switch(op["fwd_seg"], [functools.partial(run, k) for k in range(K)])

    def backward(op, x_in, dy, k_cache, v_cache, dk_cache, dv_cache):
        """One backward unit: (dx, parameter cotangents, prefix K/V cotangents padded)."""
        g = op["bwd_chunk"] * S + stage

        def run(seg):
            off, length = spec.offsets[seg], spec.lengths[seg]
            tokens, targets = segment_tokens(op["bwd_mb"], seg)
            unit = functools.partial(
                units[seg], tokens=tokens, targets=targets, first=g == 0, last=g == last_chunk
            )
            _, vjp = jax.vjp(
                unit,
                chunk_params(op["bwd_chunk"]),
                shared,
                x_in,
                k_cache[:, :, :off],
                v_cache[:, :, :off],
            )
            if seg < K - 1:  # K/V cotangents that later segments left for this one
                dk_own, dv_own = (
                    dk_cache[:, :, off : off + length],
                    dv_cache[:, :, off : off + length],
                )
            else:  # no segment attends to the last one
                dk_own = dv_own = jnp.zeros((n_layers, rows, length, *heads), act_dtype)
            d_chunk, d_shared, dx, dk_prefix, dv_prefix = vjp(
                (dy, jnp.ones((), jnp.float32), dk_own, dv_own)
            )
            return (
                dx.astype(act_dtype),
                d_chunk,
                d_shared,
                pad_to(dk_prefix.astype(act_dtype), kv_len),
                pad_to(dv_prefix.astype(act_dtype), kv_len),
            )

        return jax.lax.switch(op["bwd_seg"], [functools.partial(run, k) for k in range(K)])

    def tick(carry, ops):
        op = {name: jnp.maximum(row[stage], 0) for name, row in ops.items()}
        raw = {name: row[stage] for name, row in ops.items()}
        carry = dict(carry)

        # Forward: input from the receive buffer (chunk 0 embeds its tokens instead).
        f_on = raw["fwd_mb"] >= 0
        x_in = carry["recv_fwd"][op["fwd_in"]]
        k_cache, v_cache = carry["kv_k"][op["fwd_kv"]], carry["kv_v"][op["fwd_kv"]]
        y, loss, k_seg, v_seg = jax.lax.cond(
            f_on,
            lambda: forward(op, x_in, k_cache, v_cache),
            lambda: (act, jnp.zeros((), jnp.float32), kv_seg_zero, kv_seg_zero),
        )
        carry["loss"] = carry["loss"] + loss
        carry["stash"] = _masked_write(carry["stash"], (op["fwd_stash"], 0, 0, 0), x_in[None], f_on)
        if K > 1:  # only segments before the last are ever read back as a prefix
            at = (op["fwd_kv"], 0, 0, offsets[op["fwd_seg"]], 0, 0)
            keep = f_on & (raw["fwd_seg"] < K - 1)
            carry["kv_k"] = _masked_write(carry["kv_k"], at, k_seg[None], keep)
            carry["kv_v"] = _masked_write(carry["kv_v"], at, v_seg[None], keep)

        # Backward: recompute the unit from its stashed input and pull cotangents through.
        b_on = raw["bwd_mb"] >= 0
        x_in = carry["stash"][op["bwd_stash"]]
        dy = jnp.where(raw["bwd_in"] >= 0, carry["recv_bwd"][op["bwd_in"]], 0)
        k_cache, v_cache = carry["kv_k"][op["bwd_kv"]], carry["kv_v"][op["bwd_kv"]]
        dk_cache, dv_cache = carry["dkv_k"][op["bwd_dkv"]], carry["dkv_v"][op["bwd_dkv"]]
        dx, d_chunk, d_shared, dk_prefix, dv_prefix = jax.lax.cond(
            b_on,
            lambda: backward(op, x_in, dy, k_cache, v_cache, dk_cache, dv_cache),
            lambda: (
                act,
                _zeros_like_tree(chunk_params(0)),
                _zeros_like_tree(shared),
                kv_all_zero,
                kv_all_zero,
            ),
        )
        carry["grads_layers"] = jax.tree.map(
            lambda acc, d: acc.at[op["bwd_chunk"]].add(d.astype(acc.dtype)),
            carry["grads_layers"],
            d_chunk,
        )
        carry["grads_shared"] = jax.tree.map(jnp.add, carry["grads_shared"], d_shared)
        if K > 1:
            # Prefix cotangents wait for the earlier segments; this segment's own (and any
            # later ones) are spent, so they are cleared for the slot's next micro-batch.
            before = (jnp.arange(kv_len) < offsets[op["bwd_seg"]])[None, None, :, None, None]
            for name, d_prefix in (("dkv_k", dk_prefix), ("dkv_v", dv_prefix)):
                old = carry[name][op["bwd_dkv"]]
                new = jnp.where(before, old + d_prefix, 0)
                carry[name] = _masked_write(
                    carry[name], (op["bwd_dkv"], 0, 0, 0, 0, 0), new[None], b_on
                )

        # Ring transfers; the schedule says which slot (if any) keeps what arrives.
        y_in = jax.lax.ppermute(y, STAGE, [(i, (i + 1) % S) for i in range(S)])
        dx_in = jax.lax.ppermute(dx, STAGE, [(i, (i - 1) % S) for i in range(S)])
        for name, msg in (("recv_fwd", y_in), ("recv_bwd", dx_in)):
            at = (op[name], 0, 0, 0)
            carry[name] = _masked_write(carry[name], at, msg[None], raw[name] >= 0)
        return carry, None

    kv_shape = (max(prog.num_kv, 1), n_layers, rows, kv_len, *heads)
    dkv_shape = (max(prog.num_dkv, 1), n_layers, rows, kv_len, *heads)
    init = {
        "stash": jnp.zeros((max(prog.num_stash, 1),) + act.shape, act_dtype),
        "recv_fwd": jnp.zeros((max(prog.num_recv_fwd, 1),) + act.shape, act_dtype),
        "recv_bwd": jnp.zeros((max(prog.num_recv_bwd, 1),) + act.shape, act_dtype),
        "kv_k": jnp.zeros(kv_shape, act_dtype),
        "kv_v": jnp.zeros(kv_shape, act_dtype),
        "dkv_k": jnp.zeros(dkv_shape, act_dtype),
        "dkv_v": jnp.zeros(dkv_shape, act_dtype),
        "grads_layers": _zeros_like_tree(layers_VxN),
        "grads_shared": _zeros_like_tree(shared),
        "loss": jnp.zeros((), jnp.float32),
    }
    ops = {
        f.name: jnp.asarray(getattr(prog, f.name))
        for f in dataclasses.fields(prog)
        if isinstance(getattr(prog, f.name), np.ndarray)
    }
    final, _ = jax.lax.scan(tick, init, ops)
    # The only collectives over `data` and over `stage` of the step, after the loop.
    loss = jax.lax.pmean(jax.lax.psum(final["loss"], STAGE), DATA)
    grads_shared = jax.lax.pmean(jax.lax.psum(final["grads_shared"], STAGE), DATA)
    grads_layers = jax.lax.pmean(final["grads_layers"], DATA)
    return loss, jax.tree.map(lambda g: g[None], grads_layers), grads_shared


def loss_and_grads(
    params: Params, tokens_BxL1: jax.Array, spec: PipelineSpec, mesh: jax.sharding.Mesh
) -> tuple[jax.Array, Params]:
    """Pipelined loss and gradients, equal to `reference.loss_and_grads` up to float rounding."""
    layers = to_stage_layout(params["layers"], spec.stages, spec.virtual)
    shared = {k: v for k, v in params.items() if k != "layers"}
    body = jax.shard_map(
        lambda lay, sh, tok: _stage_body(spec, jax.tree.map(lambda w: w[0], lay), sh, tok),
        mesh=mesh,
        in_specs=(P(STAGE), P(), P(DATA)),
        out_specs=(P(), P(STAGE), P()),
        # Every value here is per-device and every vjp is local: with no implicit
        # invariant-to-varying casts, no psum can sneak into the tick loop (a test reads
        # the HLO to make sure); the reductions are the explicit ones after it.
        check_vma=False,
    )
    loss, grads_layers, grads_shared = body(layers, shared, tokens_BxL1)
    return loss, {**grads_shared, "layers": from_stage_layout(grads_layers)}
