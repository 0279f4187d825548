"""The pipeline executor: any valid schedule table, run inside shard_map over (data, stage).

One SPMD program: a `lax.scan` over ticks; in each tick every stage runs at most one
forward unit and one backward unit (a unit is one segment of one micro-batch through one
model chunk), then two `ppermute`s move activations to the next stage and cotangents to
the previous one. Idle halves are skipped with `lax.cond`, so bubbles compute nothing.
Gradients accumulate in the scan carry and are averaged over `data` once, after the loop.

Per device (stage r) the carry holds, all with static shapes:
  stash   [slots, b, Lseg, D]   inputs of forwards whose backward has not run (remat `full`)
  res     per segment k, per residual: [slots_k, ...] what each forward's vjp keeps for its
          backward (remat `none`, `dots`, `layer`), less what the backward can re-read
          instead: the parameters and the K/V prefix, which lives in the KV cache
  head    per segment k: [slots_k, b, L_k, D] the head's dy: the last chunk runs the head's
          backward in its forward (the loss's cotangent is known), so no logits wait in
          the carry for the unit's backward, and no backward recomputes the head
  kv, dkv [slots, n, b, Lkv, H, E] K/V of each micro-batch in flight, and their cotangents
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

# pipeline.remat -> what a unit keeps for its backward, as a per-layer checkpoint policy:
#   full   the stage input only; the backward re-runs the unit's forward (least memory)
#   layer  each layer's input; the backward recomputes one layer at a time
#   dots   each layer's matmul outputs; the backward recomputes the element-wise work
#   none   every residual of the forward (no recomputation: the paper's setting)
REMAT = {"full": None, "layer": "layer", "dots": "dots", "none": None}


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    """Everything static about a pipelined step."""

    cfg: GPTConfig
    schedule: schedule.Schedule
    program: schedule.Program
    lengths: tuple[int, ...]  # segment lengths, summing to the sequence length
    remat: str = "full"  # one of REMAT: what a forward keeps for its backward

    @property
    def checkpoint(self) -> str | None:
        """The per-layer checkpoint policy (`model.layers`) of a unit under `remat`."""
        return REMAT[self.remat]

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
    return PipelineSpec(cfg, table, schedule.lower(table), tuple(lengths), p.remat)


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


def _body(spec: PipelineSpec, seg: int):
    """Segment `seg` through a chunk's layers, embedding it first on global chunk 0
    (`first`: a run-time flag, or a bool): (y padded to the longest segment, K, V)."""
    cfg, offset, length = spec.cfg, spec.offsets[seg], spec.lengths[seg]
    seg_max = max(spec.lengths)

    def f(p_chunk, shared, x_in, k_prefix, v_prefix, tokens, first):
        x = _choose(first, lambda: model.embed(shared, tokens, cfg), lambda: x_in[:, :length])
        y, k_seg, v_seg = model.layers(p_chunk, x, k_prefix, v_prefix, offset, cfg, spec.checkpoint)
        return jnp.pad(y, ((0, 0), (0, seg_max - length), (0, 0))), k_seg, v_seg

    return f


def _head(spec: PipelineSpec, seg: int, scale: float):
    """The last chunk's head on segment `seg`: its summed loss, scaled."""
    cfg, length = spec.cfg, spec.lengths[seg]

    def f(shared, y, targets):
        return model.token_loss_sum(model.logits(shared, y[:, :length], cfg), targets) * scale

    return f


def _choose(flag, if_true, if_false):
    """lax.cond on a run-time flag; a Python bool (flops, memory: one chunk's unit alone)
    picks its branch at trace time, so neither the other branch nor its residuals exist."""
    if isinstance(flag, bool):
        return if_true() if flag else if_false()
    return jax.lax.cond(flag, if_true, if_false)


@dataclasses.dataclass(frozen=True)
class ResidualLayout:
    """How a unit's vjp is rebuilt in its backward: its pytree structure, and for each
    leaf whether it comes from the residual stash (an index into `stored`), from the
    backward's own inputs (`("input", j)`: parameters and the K/V prefix, re-read rather
    than stashed) or is a constant of the trace (`("const", value)`)."""

    treedef: Any
    sources: tuple
    stored: tuple  # ShapeDtypeStruct of each stashed leaf

    @classmethod
    def of(cls, vjp, inputs) -> "ResidualLayout":
        return cls.split(vjp, inputs)[0]

    @classmethod
    def split(cls, vjp, inputs) -> tuple["ResidualLayout", list]:
        """(layout, the leaves to stash) of a vjp whose primal inputs are `inputs`."""
        leaves, treedef = jax.tree.flatten(vjp)
        input_at = {id(x): j for j, x in enumerate(jax.tree.leaves(inputs))}
        stored_at, stored, sources = {}, [], []
        for leaf in leaves:
            if id(leaf) in input_at:
                sources.append(("input", input_at[id(leaf)]))
            elif not isinstance(leaf, jax.core.Tracer):
                sources.append(("const", leaf))
            else:  # a leaf may appear more than once: stash it once
                if id(leaf) not in stored_at:
                    stored_at[id(leaf)] = len(stored)
                    stored.append(leaf)
                sources.append(stored_at[id(leaf)])
        avals = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in stored)
        return cls(treedef, tuple(sources), avals), stored

    def rebuild(self, stored, inputs):
        """The vjp function from its stashed leaves and the backward's inputs."""
        inputs = jax.tree.leaves(inputs)
        leaves = [
            stored[src] if isinstance(src, int) else inputs[src[1]] if src[0] == "input" else src[1]
            for src in self.sources
        ]
        return jax.tree.unflatten(self.treedef, leaves)


def residual_forward(unit, params, x_in, k_prefix, v_prefix):
    """Outputs of `unit(params..., x_in, k_prefix, v_prefix)` and what its backward needs."""
    primals = (*params, x_in, k_prefix, v_prefix)
    outputs, vjp = jax.vjp(unit, *primals)
    layout, stored = ResidualLayout.split(vjp, _reread(primals))
    return outputs, layout, stored


def unit_avals(spec: PipelineSpec, rows: int, seg: int, layers: int | None = None) -> tuple:
    """Abstract (chunk params, shared params, x_in, K prefix, V prefix, tokens, targets) of
    segment `seg`'s unit through a chunk of `layers` layers (default: the schedule's), as
    the executor passes them (parameters in the compute dtype when residuals are kept)."""
    cfg, sds = spec.cfg, jax.ShapeDtypeStruct
    n = layers or cfg.num_layers // (spec.stages * spec.virtual)
    act = jnp.dtype(cfg.dtype)
    shapes = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    if spec.remat != "full":
        shapes = jax.tree.map(lambda x: sds(x.shape, act), shapes)
    chunk = jax.tree.map(lambda x: sds((n,) + x.shape[1:], x.dtype), shapes["layers"])
    shared = {k: x for k, x in shapes.items() if k != "layers"}
    x_in = sds((rows, max(spec.lengths), cfg.d_model), act)
    prefix = sds((n, rows, spec.offsets[seg], cfg.num_heads, cfg.head_dim), act)
    tokens = sds((rows, spec.lengths[seg]), jnp.int32)
    return chunk, shared, x_in, prefix, prefix, tokens, tokens


def residual_layout(
    spec: PipelineSpec,
    rows: int,
    seg: int,
    first: bool | None = None,
    layers: int | None = None,
) -> ResidualLayout:
    """The residual layout of segment `seg`'s body (embedding, layers; the head keeps
    nothing, `head_grads`), from an abstract trace; `first` (global chunk 0?) fixed, or
    decided at run time as in the executor."""
    found = []

    def probe(p, sh, x_in, k_prefix, v_prefix, tokens, *traced):
        flag = first if first is not None else traced[0]
        unit = functools.partial(_body(spec, seg), tokens=tokens, first=flag)
        _, layout, stored = residual_forward(unit, (p, sh), x_in, k_prefix, v_prefix)
        found.append(layout)
        return stored

    traced = () if first is not None else (jax.ShapeDtypeStruct((), jnp.bool_),)
    jax.eval_shape(probe, *unit_avals(spec, rows, seg, layers)[:6], *traced)
    return found[0]


def head_grads(head, shared, y, targets):
    """(loss, its cotangents of the shared weights and of y) of the head on y, at once.

    The loss's cotangent is the constant 1, so the head's backward need not wait for the
    unit's: run in the forward, it leaves only dy ([b, Lseg, D]) for the body's backward
    instead of the logits ([b, Lseg, V], in float32) and the head's inputs."""
    loss, vjp = jax.vjp(lambda sh, y: head(sh, y, targets), shared, y)
    d_shared, dy = vjp(jnp.ones((), loss.dtype))
    return loss, d_shared, dy


def head_cotangent(spec: PipelineSpec, rows: int, seg: int) -> jax.ShapeDtypeStruct:
    """What a last-chunk unit of segment `seg` keeps of its head: dy of its own positions."""
    return jax.ShapeDtypeStruct((rows, spec.lengths[seg], spec.cfg.d_model), spec.cfg.dtype)


def residual_stashes(spec: PipelineSpec, rows: int) -> list:
    """The executor's residual stashes (remat other than `full`), per segment: (slot count,
    the abstract leaves of one slot)."""
    return [(n, residual_layout(spec, rows, k).stored) for k, n in enumerate(spec.program.num_res)]


def head_stashes(spec: PipelineSpec, rows: int) -> list:
    """The executor's stashes of the head's dy, per segment: (slot count, one slot)."""
    return [(n, head_cotangent(spec, rows, k)) for k, n in enumerate(spec.program.num_head)]


def _reread(primals):
    """The primal inputs a backward re-reads instead of stashing: all but x_in."""
    return (*primals[:-3], primals[-2], primals[-1])


def _replace(items: tuple, i: int, new) -> tuple:
    return items[:i] + (new,) + items[i + 1 :]


def _zeros_like_tree(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def _accumulate(acc, d):
    """acc + d, leaf by leaf, in the accumulator's dtype."""
    return jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, d)


def _zeros_of(layout: ResidualLayout) -> tuple:
    return tuple(jnp.zeros(a.shape, a.dtype) for a in layout.stored)


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
    cfg, prog, S = spec.cfg, spec.program, spec.stages
    K, M = len(spec.lengths), spec.schedule.microbatches
    stage = jax.lax.axis_index(STAGE)
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
    bodies = [_body(spec, k) for k in range(K)]
    head_fns = [_head(spec, k, scale) for k in range(K)]
    grads_init = {
        "grads_layers": _zeros_like_tree(layers_VxN),
        "grads_shared": _zeros_like_tree(shared),
    }
    if spec.remat != "full":
        # Cast once: a vjp then keeps the compute-dtype weights by reference (re-read in
        # the backward) rather than a cast copy of them per stashed unit.
        layers_VxN, shared = jax.tree.map(lambda w: w.astype(act_dtype), (layers_VxN, shared))

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

    def body_of(seg, mb, chunk):
        """Segment `seg`'s body with its tokens and first-chunk switch bound."""
        tokens, _ = segment_tokens(mb, seg)
        return functools.partial(bodies[seg], tokens=tokens, first=chunk * S + stage == 0)

    def prefix(cache, seg):
        return cache[:, :, : spec.offsets[seg]]

    def forward(op, x_in, k_cache, v_cache):
        """One forward unit's body: (y, K/V of the segment padded to the longest segment)."""

        def run(seg):
            y, k_seg, v_seg = body_of(seg, op["fwd_mb"], op["fwd_chunk"])(
                chunk_params(op["fwd_chunk"]),
                shared,
                x_in,
                prefix(k_cache, seg),
                prefix(v_cache, seg),
            )
            return y, pad_to(k_seg, seg_max), pad_to(v_seg, seg_max)

        return jax.lax.switch(op["fwd_seg"], [functools.partial(run, k) for k in range(K)])

    def pull(vjp, seg, dy, dk_cache, dv_cache):
        """Run a body's vjp: (dx, parameter cotangents, prefix K/V cotangents padded)."""
        off, length = spec.offsets[seg], spec.lengths[seg]
        if seg < K - 1:  # K/V cotangents that later segments left for this one
            dk_own = dk_cache[:, :, off : off + length]
            dv_own = dv_cache[:, :, off : off + length]
        else:  # no segment attends to the last one
            dk_own = dv_own = jnp.zeros((n_layers, rows, length, *heads), act_dtype)
        d_chunk, d_shared, dx, dk_prefix, dv_prefix = vjp((dy, dk_own, dv_own))
        return (
            dx.astype(act_dtype),
            d_chunk,
            d_shared,
            pad_to(dk_prefix.astype(act_dtype), kv_len),
            pad_to(dv_prefix.astype(act_dtype), kv_len),
        )

    def backward(op, x_in, dy, k_cache, v_cache, dk_cache, dv_cache):
        """One backward unit under full remat: recompute the body from its input."""

        def run(seg):
            _, vjp = jax.vjp(
                body_of(seg, op["bwd_mb"], op["bwd_chunk"]),
                chunk_params(op["bwd_chunk"]),
                shared,
                x_in,
                prefix(k_cache, seg),
                prefix(v_cache, seg),
            )
            return pull(vjp, seg, dy, dk_cache, dv_cache)

        return jax.lax.switch(op["bwd_seg"], [functools.partial(run, k) for k in range(K)])

    # Units that keep residuals: the forward stashes what its vjp holds, the backward
    # rebuilds the vjp from it. Residual shapes differ by segment, so each segment has its
    # own stash (slots from `Program.fwd_res`) and its own conditional in the forward.
    def forward_keep(op, seg, x_in, k_cache, v_cache):
        """The body's outputs and the residuals its backward needs."""
        body = body_of(seg, op["fwd_mb"], op["fwd_chunk"])
        params = (chunk_params(op["fwd_chunk"]), shared)
        (y, k_seg, v_seg), _, stored = residual_forward(
            body, params, x_in, prefix(k_cache, seg), prefix(v_cache, seg)
        )
        return y, pad_to(k_seg, seg_max), pad_to(v_seg, seg_max), tuple(stored)

    def head(op, y):
        """The last chunk's head, its backward run at once: (loss, d shared, dy padded)."""

        def run(seg):
            _, targets = segment_tokens(op["fwd_mb"], seg)
            return head_grads(head_fns[seg], shared, y, targets)

        return jax.lax.switch(op["fwd_seg"], [functools.partial(run, k) for k in range(K)])

    def backward_keep(op, res, dy, k_cache, v_cache, dk_cache, dv_cache):
        def run(seg):
            stored = [
                jax.lax.dynamic_index_in_dim(b, op["bwd_res"], keepdims=False) for b in res[seg]
            ]
            inputs = (
                chunk_params(op["bwd_chunk"]),
                shared,
                prefix(k_cache, seg),
                prefix(v_cache, seg),
            )
            return pull(layouts[seg].rebuild(stored, inputs), seg, dy, dk_cache, dv_cache)

        return jax.lax.switch(op["bwd_seg"], [functools.partial(run, k) for k in range(K)])

    keeps_residuals = spec.remat != "full"
    if keeps_residuals:
        layouts = [residual_layout(spec, rows, k) for k in range(K)]

    def tick(carry, ops):
        op = {name: jnp.maximum(row[stage], 0) for name, row in ops.items()}
        raw = {name: row[stage] for name, row in ops.items()}
        carry = dict(carry)

        # Forward: input from the receive buffer (chunk 0 embeds its tokens instead).
        f_on = raw["fwd_mb"] >= 0
        x_in = carry["recv_fwd"][op["fwd_in"]]
        k_cache, v_cache = carry["kv_k"][op["fwd_kv"]], carry["kv_v"][op["fwd_kv"]]
        if keeps_residuals:
            outs = []
            for k in range(K):  # one conditional per segment shape; at most one runs
                on_k = f_on & (raw["fwd_seg"] == k)
                *out, stored = jax.lax.cond(
                    on_k,
                    functools.partial(forward_keep, op, k, x_in, k_cache, v_cache),
                    lambda k=k: (act, kv_seg_zero, kv_seg_zero, _zeros_of(layouts[k])),
                )
                outs.append(out)
                carry["res"] = _replace(
                    carry["res"],
                    k,
                    tuple(
                        _masked_write(b, (op["fwd_res"],) + (0,) * r.ndim, r[None], on_k)
                        for b, r in zip(carry["res"][k], stored, strict=True)
                    ),
                )
            y, k_seg, v_seg = jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *outs)
        else:
            y, k_seg, v_seg = jax.lax.cond(
                f_on,
                lambda: forward(op, x_in, k_cache, v_cache),
                lambda: (act, kv_seg_zero, kv_seg_zero),
            )
            at = (op["fwd_stash"], 0, 0, 0)
            carry["stash"] = _masked_write(carry["stash"], at, x_in[None], f_on)
        # The head runs where the schedule gave it a slot (the last global chunk), its
        # backward at once: its gradients go straight to the accumulator, dy to a slot.
        head_on = f_on & (raw["fwd_head"] >= 0)

        def head_into(acc):
            loss, d_head, dy = head(op, y)
            return loss, _accumulate(acc, d_head), dy

        loss, carry["grads_shared"], dy_head = jax.lax.cond(
            head_on,
            head_into,
            lambda acc: (jnp.zeros((), jnp.float32), acc, act),
            carry["grads_shared"],
        )
        carry["loss"] = carry["loss"] + loss
        for k, length in enumerate(spec.lengths):
            on = head_on & (raw["fwd_seg"] == k)
            at = (op["fwd_head"], 0, 0, 0)
            new = _masked_write(carry["head"][k], at, dy_head[None, :, :length], on)
            carry["head"] = _replace(carry["head"], k, new)
        if K > 1:  # only segments before the last are ever read back as a prefix
            at = (op["fwd_kv"], 0, 0, offsets[op["fwd_seg"]], 0, 0)
            keep = f_on & (raw["fwd_seg"] < K - 1)
            carry["kv_k"] = _masked_write(carry["kv_k"], at, k_seg[None], keep)
            carry["kv_v"] = _masked_write(carry["kv_v"], at, v_seg[None], keep)

        # Backward: rebuild the unit's vjp (from its residuals, or by recomputing it from
        # its stashed input) and pull the cotangents through.
        b_on = raw["bwd_mb"] >= 0
        dy = jnp.where(raw["bwd_in"] >= 0, carry["recv_bwd"][op["bwd_in"]], 0)
        for k, length in enumerate(spec.lengths):  # the head's, kept by the forward
            dy_head = jnp.pad(
                carry["head"][k][op["bwd_head"]], ((0, 0), (0, seg_max - length), (0, 0))
            )
            dy = jnp.where((raw["bwd_head"] >= 0) & (raw["bwd_seg"] == k), dy + dy_head, dy)
        k_cache, v_cache = carry["kv_k"][op["bwd_kv"]], carry["kv_v"][op["bwd_kv"]]
        dk_cache, dv_cache = carry["dkv_k"][op["bwd_dkv"]], carry["dkv_v"][op["bwd_dkv"]]
        if keeps_residuals:
            source = carry["res"]
            run_backward = backward_keep
        else:
            source = carry["stash"][op["bwd_stash"]]
            run_backward = backward

        def backward_into(grads):
            dx, d_chunk, d_shared, dk_prefix, dv_prefix = run_backward(
                op, source, dy, k_cache, v_cache, dk_cache, dv_cache
            )
            grads = {
                "grads_layers": jax.tree.map(
                    lambda acc, d: acc.at[op["bwd_chunk"]].add(d.astype(acc.dtype)),
                    grads["grads_layers"],
                    d_chunk,
                ),
                "grads_shared": _accumulate(grads["grads_shared"], d_shared),
            }
            return dx, grads, dk_prefix, dv_prefix

        # Gradients accumulate inside the branch: returned apart, a parameter-sized
        # cotangent tree would be one more temporary.
        dx, grads, dk_prefix, dv_prefix = jax.lax.cond(
            b_on,
            backward_into,
            lambda grads: (act, grads, kv_all_zero, kv_all_zero),
            {name: carry[name] for name in ("grads_layers", "grads_shared")},
        )
        carry.update(grads)
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
        "recv_fwd": jnp.zeros((max(prog.num_recv_fwd, 1),) + act.shape, act_dtype),
        "recv_bwd": jnp.zeros((max(prog.num_recv_bwd, 1),) + act.shape, act_dtype),
        "kv_k": jnp.zeros(kv_shape, act_dtype),
        "kv_v": jnp.zeros(kv_shape, act_dtype),
        "dkv_k": jnp.zeros(dkv_shape, act_dtype),
        "dkv_v": jnp.zeros(dkv_shape, act_dtype),
        **grads_init,
        "loss": jnp.zeros((), jnp.float32),
    }
    init["head"] = tuple(
        jnp.zeros((max(n, 1),) + a.shape, a.dtype) for n, a in head_stashes(spec, rows)
    )
    if keeps_residuals:
        init["res"] = tuple(
            tuple(jnp.zeros((max(n, 1),) + a.shape, a.dtype) for a in stored)
            for n, stored in residual_stashes(spec, rows)
        )
    else:
        init["stash"] = jnp.zeros((max(prog.num_stash, 1),) + act.shape, act_dtype)
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
