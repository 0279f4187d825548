"""The pipeline executor: any valid schedule table, run inside shard_map over (data, stage).

One SPMD program: a `lax.scan` over ticks; in each tick every stage runs at most one
forward unit and one backward unit (a unit is one segment of one micro-batch through one
model chunk), then two `ppermute`s move activations to the next stage and cotangents to
the previous one. Idle halves are skipped with `lax.cond`, so bubbles compute nothing.
Gradients accumulate in the scan carry and are averaged over `data` once, after the loop.

Per device (stage r) the carry holds, all with static shapes:
  stash   [slots, b, Lseg, D]   inputs of forwards whose backward has not run (full remat)
  kv, dkv [slots, n, b, L, H, E] K/V of each micro-batch in flight, and their cotangents
          accumulated from later segments (dK/dV of a prefix is complete only after every
          later segment's backward, hence backwards in descending segment order)
  recv    [slots, b, Lseg, D]   messages received but not consumed yet
Letters: b micro-batch rows, n layers per chunk, Lseg the longest segment.
"""

import dataclasses
import functools
from typing import Any

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

    @property
    def stages(self) -> int:
        return self.schedule.stages

    @property
    def virtual(self) -> int:
        return self.schedule.virtual

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.cumsum((0,) + self.lengths[:-1]))


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
    return PipelineSpec(cfg, table, schedule.lower(table), tuple(lengths))


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
        y, k_seg, v_seg = model.layers(p_chunk, x, k_prefix, v_prefix, offset, cfg)
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


def _stage_body(spec: PipelineSpec, layers_VxN: Params, shared: Params, tokens_BxL1: jax.Array):
    """Runs on one (data, stage) device; returns local loss and gradients."""
    cfg, prog, S, V = spec.cfg, spec.program, spec.stages, spec.virtual
    K, M = len(spec.lengths), spec.schedule.microbatches
    stage = jax.lax.axis_index(STAGE)
    last_chunk = V * S - 1
    rows = tokens_BxL1.shape[0] // M
    seq_len = tokens_BxL1.shape[1] - 1
    tokens_MxbxL1 = tokens_BxL1.reshape(M, rows, seq_len + 1)
    scale = 1.0 / (tokens_BxL1.shape[0] * seq_len)
    seg_max = max(spec.lengths)
    n_layers = jax.tree.leaves(layers_VxN)[0].shape[1]
    act_dtype = jnp.dtype(cfg.dtype)
    act = jnp.zeros((rows, seg_max, cfg.d_model), act_dtype)
    kv_shape = (prog.num_kv, n_layers, rows, seq_len, cfg.num_heads, cfg.head_dim)
    units = [_unit(spec, k, scale) for k in range(K)]

    def segment_tokens(mb, seg):
        off, length = spec.offsets[seg], spec.lengths[seg]
        window = jax.lax.dynamic_index_in_dim(tokens_MxbxL1, mb, keepdims=False)
        return window[:, off : off + length], window[:, off + 1 : off + length + 1]

    def chunk_params(chunk):
        return jax.tree.map(
            lambda w: jax.lax.dynamic_index_in_dim(w, chunk, keepdims=False), layers_VxN
        )

    def forward(carry, mb, seg, chunk, src, stash_slot, kv_slot):
        g = chunk * S + stage

        def run(seg_k, carry):
            off, length = spec.offsets[seg_k], spec.lengths[seg_k]
            tokens, targets = segment_tokens(mb, seg_k)
            x_in = carry["recv_fwd"][jnp.maximum(src, 0)]
            k_cache, v_cache = carry["kv_k"][kv_slot], carry["kv_v"][kv_slot]
            y, loss, k_seg, v_seg = units[seg_k](
                chunk_params(chunk),
                shared,
                x_in,
                k_cache[:, :, :off],
                v_cache[:, :, :off],
                tokens,
                targets,
                g == 0,
                g == last_chunk,
            )
            carry = dict(carry)
            carry["stash"] = carry["stash"].at[stash_slot].set(x_in)
            carry["kv_k"] = carry["kv_k"].at[kv_slot, :, :, off : off + length].set(k_seg)
            carry["kv_v"] = carry["kv_v"].at[kv_slot, :, :, off : off + length].set(v_seg)
            carry["loss"] = carry["loss"] + loss
            return carry, y

        branches = [functools.partial(run, k) for k in range(K)]
        return jax.lax.switch(seg, branches, carry)

    def backward(carry, mb, seg, chunk, src, stash_slot, kv_slot):
        g = chunk * S + stage

        def run(seg_k, carry):
            off, length = spec.offsets[seg_k], spec.lengths[seg_k]
            tokens, targets = segment_tokens(mb, seg_k)
            x_in = carry["stash"][stash_slot]
            k_cache, v_cache = carry["kv_k"][kv_slot], carry["kv_v"][kv_slot]
            dk_cache, dv_cache = carry["dkv_k"][kv_slot], carry["dkv_v"][kv_slot]
            unit = functools.partial(
                units[seg_k], tokens=tokens, targets=targets, first=g == 0, last=g == last_chunk
            )
            _, vjp = jax.vjp(
                unit, chunk_params(chunk), shared, x_in, k_cache[:, :, :off], v_cache[:, :, :off]
            )
            dy = jnp.where(src >= 0, carry["recv_bwd"][jnp.maximum(src, 0)], 0)
            cotangent = (
                dy,
                jnp.ones((), jnp.float32),
                dk_cache[:, :, off : off + length],
                dv_cache[:, :, off : off + length],
            )
            d_chunk, d_shared, dx, dk_prefix, dv_prefix = vjp(cotangent)
            carry = dict(carry)
            carry["grads_layers"] = jax.tree.map(
                lambda acc, d: acc.at[chunk].add(d.astype(acc.dtype)),
                carry["grads_layers"],
                d_chunk,
            )
            carry["grads_shared"] = jax.tree.map(jnp.add, carry["grads_shared"], d_shared)
            # Prefix cotangents wait for the earlier segments; this segment's own are spent.
            for name, d_prefix in (("dkv_k", dk_prefix), ("dkv_v", dv_prefix)):
                buf = carry[name].at[kv_slot, :, :, :off].add(d_prefix.astype(act_dtype))
                carry[name] = buf.at[kv_slot, :, :, off : off + length].set(0)
            return carry, dx.astype(act_dtype)

        branches = [functools.partial(run, k) for k in range(K)]
        return jax.lax.switch(seg, branches, carry)

    def tick(carry, ops):
        op = {name: row[stage] for name, row in ops.items()}
        carry, y = jax.lax.cond(
            op["fwd_mb"] >= 0,
            lambda c: forward(
                c,
                op["fwd_mb"],
                op["fwd_seg"],
                op["fwd_chunk"],
                op["fwd_in"],
                op["fwd_stash"],
                op["fwd_kv"],
            ),
            lambda c: (c, act),
            carry,
        )
        carry, dx = jax.lax.cond(
            op["bwd_mb"] >= 0,
            lambda c: backward(
                c,
                op["bwd_mb"],
                op["bwd_seg"],
                op["bwd_chunk"],
                op["bwd_in"],
                op["bwd_stash"],
                op["bwd_kv"],
            ),
            lambda c: (c, act),
            carry,
        )
        # Ring transfers; the schedule says which slot (if any) keeps what arrives.
        y_in = jax.lax.ppermute(y, STAGE, [(i, (i + 1) % S) for i in range(S)])
        dx_in = jax.lax.ppermute(dx, STAGE, [(i, (i - 1) % S) for i in range(S)])
        carry = dict(carry)
        for name, msg, slot in (
            ("recv_fwd", y_in, op["recv_fwd"]),
            ("recv_bwd", dx_in, op["recv_bwd"]),
        ):
            keep = jnp.where(slot >= 0, msg, carry[name][jnp.maximum(slot, 0)])
            carry[name] = carry[name].at[jnp.maximum(slot, 0)].set(keep)
        return carry, None

    init = {
        "stash": jnp.zeros((max(prog.num_stash, 1),) + act.shape, act_dtype),
        "recv_fwd": jnp.zeros((max(prog.num_recv_fwd, 1),) + act.shape, act_dtype),
        "recv_bwd": jnp.zeros((max(prog.num_recv_bwd, 1),) + act.shape, act_dtype),
        "kv_k": jnp.zeros(kv_shape, act_dtype),
        "kv_v": jnp.zeros(kv_shape, act_dtype),
        "dkv_k": jnp.zeros(kv_shape, act_dtype),
        "dkv_v": jnp.zeros(kv_shape, act_dtype),
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
        check_vma=False,
    )
    loss, grads_layers, grads_shared = body(layers, shared, tokens_BxL1)
    return loss, {**grads_shared, "layers": from_stage_layout(grads_layers)}


def layer_sharding_spec() -> Any:
    """Canonical [N, ...] layer params: contiguous blocks of layers per stage."""
    return P(STAGE)
