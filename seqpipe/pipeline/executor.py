"""The pipeline executor: any valid schedule table, run inside shard_map over (data, stage).

One SPMD program: a `lax.scan` over ticks. In each tick every stage runs

  forward    at most one forward unit (`seqpipe.pipeline.units`), keeping what its backward needs
             (`Carry.saved`) and its segment's K/V for later segments (`Carry.kv_*`);
  head       on the last global chunk, the head and its backward at once (loss, dy);
  backward   at most one backward unit, adding its parameter gradients to `Carry.grads`
             and its prefix K/V cotangents to `Carry.dkv_*` for earlier segments (a split
             table's B: the weight matmuls' gradients are left to W, in `Carry.weight`);
  weight     a split table's W: the weight matmuls' gradients from what its B left;
  transfer   two `ppermute`s: activations to the next stage, cotangents to the previous.

Each phase is a function of (context, stage inputs, carry, this tick's ops). A unit runs
in a loop of at most one trip per segment (`run_if`), so bubbles compute nothing and
what a unit updates (stash slot, K/V cache, gradients, K/V cotangents) is updated where
it lies: `lax.cond` would copy every buffer it carries, each tick, on a GPU. Gradients
are averaged over `data` once, after the loop (`reduce`).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun
from jax.sharding import PartitionSpec as P

from seqpipe.kernels import kv_cache
from seqpipe.models import document_mask, model, moe
from seqpipe.models.model import Params
from seqpipe.parallel import context, sharding
from seqpipe.parallel.sharding import CONTEXT, DATA, STAGE, TENSOR
from seqpipe.parallel.tensor import KV_PARAMS
from seqpipe.pipeline import carry as carry_lib
from seqpipe.pipeline import units
from seqpipe.pipeline.carry import Carry, put_slot, write_slot
from seqpipe.pipeline.spec import PipelineSpec, make_spec  # noqa: F401 (make_spec: the entry point)

# --------------------------------------------------------------------------- context


@dataclasses.dataclass(frozen=True)
class Context:
    """What every tick of a stage's program knows statically."""

    spec: PipelineSpec
    rows: int  # sequences per micro-batch on this data replica
    scale: float  # 1 / the batch's token count: the units' summed losses add to the mean

    @functools.cached_property
    def units(self) -> tuple[units.SegmentUnit, ...]:
        return tuple(units.SegmentUnit(self.spec, k) for k in range(self.spec.segments))

    @functools.cached_property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Segments by the stash they share (their saved values have one shape); one group
        in an evaluation, which saves nothing."""
        if self.spec.forward_only:
            return (tuple(range(self.spec.segments)),)
        out: dict[int, list[int]] = {}
        for u in self.units:
            out.setdefault(u.group, []).append(u.seg)
        return tuple(tuple(out[g]) for g in sorted(out))

    def saved_avals(self, group: int) -> tuple:
        """What one forward of `group` keeps for its backward (nothing in an evaluation)."""
        if self.spec.forward_only:
            return ()
        return self.units[self.groups[group][0]].saved_avals(self.rows, depth=self.spec.uneven)

    def zeros(self, kind: str):
        """Zeros: a message ("message": an idle unit's output), or K/V as long as the
        cache ("kv_all": a unit's prefix sinks)."""
        cfg, spec, act = self.spec.cfg, self.spec, jnp.dtype(self.spec.cfg.dtype)
        if kind == "message":
            return jnp.zeros((self.rows, spec.msg_len, cfg.d_model), act)
        shape = (spec.chunk_layers, self.rows, spec.kv_len, cfg.local_kv_heads, cfg.head_dim)
        return jnp.zeros(shape, act)

    @property
    def reads_cache(self) -> bool:
        """Whether units read their prefix from the KV cache where it lies (`kv_cache`);
        else it is copied out of it for each unit."""
        return self.spec.forward_only or units.strategy(self.spec).reads_cache


@struct.dataclass
class StageInputs:
    """What a stage's ticks read and never write: its parameters and the batch, as
    micro-batches of this context device's local rows (`seqpipe.parallel.context`; the
    rows themselves without context parallelism)."""

    layers_VxN: Params  # the stage's V chunks of n layers (padded to n: `seqpipe.parallel.layout`)
    shared: Params  # embedding, final norm, head
    inputs_MxbxL: jax.Array  # the replica's micro-batches' input tokens
    targets_MxbxL: jax.Array  # and each one's next token
    stage: jax.Array  # this device's stage index
    # Packed rows (`seqpipe.models.document_mask`): the inputs' document ids and positions,
    # which targets count, and 1 / the global batch's count of counted targets (the loss's
    # scale); else None.
    documents_MxbxL: jax.Array | None = None
    positions_MxbxL: jax.Array | None = None
    counted_MxbxL: jax.Array | None = None
    scale: jax.Array | None = None

    def chunk(self, c) -> Params:
        return jax.tree.map(
            lambda w: jax.lax.dynamic_index_in_dim(w, c, keepdims=False), self.layers_VxN
        )

    def depth(self, spec: PipelineSpec, c):
        """Layers that local chunk c runs: None (all n) unless the split is uneven."""
        if not spec.uneven:
            return None
        per_chunk = jnp.asarray(spec.layers_per_chunk, jnp.int32)
        return per_chunk[c * spec.stages + self.stage]

    def first(self, c, stages: int):
        """Whether local chunk c is global chunk 0 (it embeds tokens)."""
        return c * stages + self.stage == 0

    @staticmethod
    def _window(x_MxbxL, spec: PipelineSpec, mb, seg: int):
        """Segment `seg` of micro-batch `mb` of x, [b, L_k]."""
        off, length = spec.offsets[seg], spec.lengths[seg]
        return jax.lax.dynamic_index_in_dim(x_MxbxL, mb, keepdims=False)[:, off : off + length]

    def tokens(self, spec: PipelineSpec, mb, seg: int) -> tuple[jax.Array, jax.Array]:
        """(inputs, targets) [b, L_k] of segment `seg` of micro-batch `mb`."""
        return tuple(
            self._window(x, spec, mb, seg) for x in (self.inputs_MxbxL, self.targets_MxbxL)
        )

    def packing(self, spec: PipelineSpec, mb, seg: int):
        """The `document_mask.Packing` of segment `seg` of micro-batch `mb` (its own rows' ids
        and positions), or None (unpacked rows)."""
        if not spec.packed:
            return None
        docs, pos = (
            jax.lax.dynamic_index_in_dim(x, mb, keepdims=False) if on else None
            for x, on in (
                (self.documents_MxbxL, spec.documents),
                (self.positions_MxbxL, spec.positions),
            )
        )
        return document_mask.of_rows(docs, pos, spec.offsets[seg], spec.lengths[seg], True)

    def counted(self, spec: PipelineSpec, mb, seg: int):
        """[b, L_k] which targets of the segment count (None: unpacked rows, all)."""
        if self.counted_MxbxL is None:
            return None
        return self._window(self.counted_MxbxL, spec, mb, seg)

    def loss_scale(self, ctx: "Context"):
        """What each unit's summed loss is scaled by: 1 / the global batch's target count."""
        return ctx.scale if self.scale is None else self.scale


class TickOps:
    """This stage's row of the `Program` for one tick: slot and unit indices, -1 for none."""

    def __init__(self, row: dict, stage):
        self.raw = {name: values[stage] for name, values in row.items()}

    def __getitem__(self, name: str):
        """The index, clamped to 0 where there is none: always safe to read with."""
        return jnp.maximum(self.raw[name], 0)

    def on(self, name: str):
        return self.raw[name] >= 0


def _prefix_args(ctx: Context, words_k, words_v, slot, seg: int):
    """(K prefix, V prefix, cache) a unit of segment `seg` takes: zero sinks and the cache
    view when it reads the cache in place, else the prefix copied out of slot `slot`."""
    if ctx.reads_cache:
        sink = ctx.zeros("kv_all")  # the cotangents come back as long as the cache
        return sink, sink, kv_cache.Prefix(words_k, words_v, slot, jnp.int32(0))
    act, off = ctx.spec.cfg.dtype, ctx.spec.offsets[seg]
    k, v = (
        kv_cache.from_words(jax.lax.dynamic_index_in_dim(w, slot, keepdims=False), act)
        for w in (words_k, words_v)
    )
    return k[:, :, :off], v[:, :, :off], None


def _accumulate(acc, d):
    """acc + d, leaf by leaf, in the accumulator's dtype."""
    return jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, d)


def _switch(index, branches, *operands):
    """lax.switch, or the one branch itself."""
    if len(branches) == 1:
        return branches[0](*operands)
    return jax.lax.switch(index, branches, *operands)


def run_if(on, fn, *state) -> tuple:
    """`fn(*state)` where `on`, else `state`, in place: a loop that runs once or not at all.

    Not `lax.cond`: a conditional's results never share its operands' buffers on a GPU,
    so each buffer it passes through (gradients, K/V cotangents) is copied whole every
    tick, run or idle; a loop updates what it carries where it lies. What `fn` reads
    goes through the loop with its state and the trip counter, behind a barrier: else
    XLA hoists a unit that reads no state (a first segment's forward) out of its loop,
    to run every tick. Both are held row-major (`kv_cache.row_major`). (gpt_1b seq1f1b
    M=8 K=4 on an H200: 7.22 TB moved a step with one conditional a tick, 6.14 this
    way, `seqpipe.tools.step_cost`.)"""
    leaves, tree = jax.tree.flatten(state)
    traced = jax.make_jaxpr(lambda *xs: jax.tree.leaves(fn(*jax.tree.unflatten(tree, xs))))
    closed = traced(*leaves)  # its consts: everything fn reads besides its state

    def body(c):
        trip, leaves, reads = jax.lax.optimization_barrier(c)
        run = jaxpr_as_fun(ClosedJaxpr(closed.jaxpr, kv_cache.row_major(reads)))
        return trip + 1, kv_cache.row_major(run(*kv_cache.row_major(leaves))), reads

    _, leaves, _ = jax.lax.while_loop(
        lambda c: c[0] < on.astype(jnp.int32), body, (jnp.int32(0), leaves, closed.consts)
    )
    return jax.tree.unflatten(tree, leaves)


# --------------------------------------------------------------------------- the tick


def forward(ctx: Context, inp: StageInputs, carry: Carry, op: TickOps) -> tuple[Carry, jax.Array]:
    """The tick's forward unit: its output y (zeros if none), what its backward needs
    stored in its stash slot, its K/V cached for later segments of the micro-batch."""
    spec = ctx.spec
    x_in = carry.recv_fwd[op["fwd_in"]]
    mb, chunk, kv_slot = op["fwd_mb"], op["fwd_chunk"], op["fwd_kv"]
    params = (inp.chunk(chunk), inp.shared)
    first, depth = inp.first(chunk, spec.stages), inp.depth(spec, chunk)
    slot = op[units.strategy(spec).slot_fields[0]]

    def run(k, _y, stash, *kv):  # _y: the idle unit's zeros, replaced
        tokens, _ = inp.tokens(spec, mb, k)
        kv_k, kv_v = kv or (carry.kv_k, carry.kv_v)
        k_prefix, v_prefix, cache = _prefix_args(ctx, kv_k, kv_v, kv_slot, k)
        inputs = units.UnitInputs(*params, x_in, k_prefix, v_prefix, tokens, first, depth, cache)
        unit = ctx.units[k].with_packing(inp.packing(spec, mb, k))
        if spec.forward_only:  # nothing to keep for a backward
            y, k_seg, v_seg = unit.run(inputs)
        else:
            (y, k_seg, v_seg), kept = unit.forward(inputs, units.Stash(stash, slot))
            stash = kept.buffers
        if k < spec.segments - 1:  # only segments before the last are read back as a prefix
            at = (kv_slot, 0, 0, spec.offsets[k], 0, 0)
            kv = tuple(
                jax.lax.dynamic_update_slice(w, kv_cache.to_words(x)[None], at)
                for w, x in zip(kv, (k_seg, v_seg), strict=True)
            )
        return y, stash, *kv

    # With one segment the K/V cache holds no positions: nothing to write.
    y, stashes = ctx.zeros("message"), list(carry.saved)
    kv = (carry.kv_k, carry.kv_v) if spec.kv_len else ()
    for k, unit in enumerate(ctx.units):
        g = unit.group if stashes else None  # an evaluation keeps nothing
        on = op.on("fwd_mb") & (op.raw["fwd_seg"] == k)
        y, stash, *kv = run_if(on, functools.partial(run, k), y, stashes[g] if stashes else (), *kv)
        if stashes:
            stashes[g] = stash
    carry = carry.replace(saved=tuple(stashes))
    return (carry.replace(kv_k=kv[0], kv_v=kv[1]) if kv else carry), y


def head(ctx: Context, inp: StageInputs, carry: Carry, op: TickOps, y: jax.Array) -> Carry:
    """On the last global chunk, the head on the forward's y and its backward at once:
    its loss and shared-weight gradients go straight into the carry, dy to a slot."""
    spec, mb = ctx.spec, op["fwd_mb"]
    if spec.forward_only:  # no head slots: the last global chunk scores what it ran
        last = op["fwd_chunk"] * spec.stages + inp.stage == spec.stages * spec.virtual - 1
        on = op.on("fwd_mb") & last
        return carry.replace(loss=carry.loss + _eval_loss(ctx, inp, op, y, on))
    on = op.on("fwd_mb") & op.on("fwd_head")

    def run(k, loss, acc, dy_buf):
        _, targets = inp.tokens(spec, mb, k)
        counted = inp.counted(spec, mb, k)
        loss_k, d_shared, dy = ctx.units[k].head(
            inp.shared, y, targets, inp.loss_scale(ctx), counted
        )
        dy_buf = put_slot(dy_buf, op["fwd_head"], dy[:, : dy_buf.shape[2]])
        return loss + loss_k, _accumulate(acc, d_shared), dy_buf

    loss, grads_shared, head_dy = carry.loss, carry.grads["shared"], list(carry.head_dy)
    for k in range(spec.segments):
        loss, grads_shared, head_dy[k] = run_if(
            on & (op.raw["fwd_seg"] == k),
            functools.partial(run, k),
            loss,
            grads_shared,
            head_dy[k],
        )
    return carry.replace(
        loss=loss, grads={**carry.grads, "shared": grads_shared}, head_dy=tuple(head_dy)
    )


def _eval_loss(ctx: Context, inp: StageInputs, op: TickOps, y: jax.Array, on) -> jax.Array:
    """The head's scaled loss on y where `on`, else 0 (an evaluation: no gradients)."""

    def run(k):
        _, targets = inp.tokens(ctx.spec, op["fwd_mb"], k)
        counted = inp.counted(ctx.spec, op["fwd_mb"], k)
        return ctx.units[k].head_loss(inp.shared, y, targets, inp.loss_scale(ctx), counted)

    branches = [functools.partial(run, k) for k in range(ctx.spec.segments)]
    zero = jnp.zeros((), jnp.float32)
    return jax.lax.cond(on, lambda: _switch(op["fwd_seg"], branches), lambda: zero)


def _output_cotangent(ctx: Context, carry: Carry, op: TickOps) -> jax.Array:
    """dy of the backward unit: from the next stage, plus the head's on the last chunk."""
    dy = jnp.where(op.on("bwd_in"), carry.recv_bwd[op["bwd_in"]], 0)
    for k in range(ctx.spec.segments):
        pad = ((0, 0), (0, ctx.spec.msg_len - ctx.spec.local_length(k)), (0, 0))
        dy_head = jnp.pad(carry.head_dy[k][op["bwd_head"]], pad)
        dy = jnp.where(op.on("bwd_head") & (op.raw["bwd_seg"] == k), dy + dy_head, dy)
    return dy


def _backward_unit(ctx: Context, inp: StageInputs, op: TickOps, k: int, saved, dy, caches, layers):
    """Segment k's backward on the tick's unit: (dx, `layers` (a `units.LayerGrads`) with
    the chunk's parameter cotangents added, those of the shared weights, the K/V
    cotangent caches with its prefix dK and dV added). `saved`: what its forward kept, or
    the `units.Stash` slot holding it; `caches`: the carry's K/V and K/V cotangent buffers
    (storage words, every slot). Each is read and updated where it lies."""
    spec, unit, chunk = ctx.spec, ctx.units[k], op["bwd_chunk"]
    words_k, words_v, words_dk, words_dv = caches
    act = jnp.dtype(spec.cfg.dtype)
    off = spec.offsets[k]
    own = unit.kv_avals(ctx.rows)
    if k < spec.segments - 1:  # K/V cotangents that later segments left for this one
        at = (op["bwd_dkv"], 0, 0, off, 0, 0)
        dk_own, dv_own = (
            kv_cache.from_words(jax.lax.dynamic_slice(w, at, (1, *own.shape))[0], act)
            for w in (words_dk, words_dv)
        )
    else:  # no segment attends to the last one
        dk_own = dv_own = jnp.zeros(own.shape, spec.cfg.dtype)
    tokens, _ = inp.tokens(spec, op["bwd_mb"], k)
    if spec.packed:  # this micro-batch's rows' ids and positions
        unit = unit.with_packing(inp.packing(spec, op["bwd_mb"], k))
    k_prefix, v_prefix, cache = _prefix_args(ctx, words_k, words_v, op["bwd_kv"], k)
    # With one segment there is no prefix: nothing to add to.
    into = (
        None
        if words_dk is None
        else kv_cache.Cotangents(words_dk, words_dv, op["bwd_dkv"], off, act)
    )
    params = (inp.chunk(chunk), inp.shared)
    first, depth = inp.first(chunk, spec.stages), inp.depth(spec, chunk)
    inputs = units.UnitInputs(*params, None, k_prefix, v_prefix, tokens, first, depth, cache)
    layers, d_shared, dx, *rest = unit.backward(inputs, saved, (dy, dk_own, dv_own), into, layers)
    into, *pack = rest if into is not None else (None, *rest[2:])
    # pack: a split B's (matmul inputs, output cotangents) for its W; else empty.
    return dx.astype(act), layers, d_shared, into, pack


def backward(ctx: Context, inp: StageInputs, carry: Carry, op: TickOps) -> tuple[Carry, jax.Array]:
    """The tick's backward unit: dx for the previous stage (zeros if none), its parameter
    gradients accumulated, its prefix K/V cotangents kept for the earlier segments."""
    spec, chunk = ctx.spec, op["bwd_chunk"]
    dy = _output_cotangent(ctx, carry, op)
    strategy = units.strategy(spec)
    slot = op[strategy.slot_fields[1]]

    def stash(group):
        return units.Stash(carry.saved[group], slot)

    shared_stash = stash(0).get(ctx.saved_avals(0)) if strategy.read_before_branching else None

    def run(k, _dx, grads, weight, *dkv):  # _dx: the idle unit's zeros, replaced
        saved = shared_stash if shared_stash is not None else stash(ctx.units[k].group)
        caches = (carry.kv_k, carry.kv_v, *(dkv or (None, None)))
        layers = units.LayerGrads(grads["layers"], chunk)
        dx, layers, d_shared, into, pack = _backward_unit(
            ctx, inp, op, k, saved, dy, caches, layers
        )
        grads = {"layers": layers.layers, "shared": _accumulate(grads["shared"], d_shared)}
        if pack:  # a split B: its W reads these from its slot
            slot = op["bwd_wgt"]
            buf = jax.tree.map(lambda b, x: put_slot(b, slot, x), weight[k], pack[0])
            weight = (*weight[:k], buf, *weight[k + 1 :])
        return dx, grads, weight, *(() if into is None else (into.words_k, into.words_v))

    # Everything a unit updates (gradients, K/V cotangents, a split B's W slot) is
    # updated inside its loop, in place, and one loop a segment: a switch between them
    # would pass each buffer through the segments that did not run, copying it.
    dkv = (carry.dkv_k, carry.dkv_v) if spec.kv_len else ()
    state = (ctx.zeros("message"), carry.grads, carry.weight, *dkv)
    for k in range(spec.segments):
        on = op.on("bwd_mb") & (op.raw["bwd_seg"] == k)
        state = run_if(on, functools.partial(run, k), *state)
    dx, grads, weight, *dkv = state
    carry = carry.replace(grads=grads, weight=weight)
    if dkv:
        carry = carry.replace(dkv_k=dkv[0], dkv_v=dkv[1])
    return carry, dx


def weight(ctx: Context, inp: StageInputs, carry: Carry, op: TickOps) -> Carry:
    """A split table's W: the weight matmuls' gradients of the unit, from what its B left
    in its slot, added to `Carry.grads`."""
    chunk, slot = op["wgt_chunk"], op["wgt_in"]

    def run(k, layers):
        pack = jax.tree.map(
            lambda b: jax.lax.dynamic_index_in_dim(b, slot, keepdims=False), carry.weight[k]
        )
        return (units.LayerGrads(layers, chunk).add(ctx.units[k].weight(pack)).layers,)

    layers = carry.grads["layers"]
    for k in range(ctx.spec.segments):
        on = op.on("wgt_mb") & (op.raw["wgt_seg"] == k)
        (layers,) = run_if(on, functools.partial(run, k), layers)
    return carry.replace(grads={**carry.grads, "layers": layers})


def transfer(ctx: Context, carry: Carry, op: TickOps, y: jax.Array, dx: jax.Array) -> Carry:
    """Ring transfers: y to the next stage, dx to the previous; the schedule says which
    slot (if any) keeps what arrives."""
    S = ctx.spec.stages
    y_in = jax.lax.ppermute(y, STAGE, [(i, (i + 1) % S) for i in range(S)])
    carry = carry.replace(
        recv_fwd=write_slot(carry.recv_fwd, op["recv_fwd"], y_in, op.on("recv_fwd"))
    )
    if dx is None:  # an evaluation sends nothing back
        return carry
    dx_in = jax.lax.ppermute(dx, STAGE, [(i, (i - 1) % S) for i in range(S)])
    return carry.replace(
        recv_bwd=write_slot(carry.recv_bwd, op["recv_bwd"], dx_in, op.on("recv_bwd"))
    )


def tick(ctx: Context, inp: StageInputs, carry: Carry, row: dict) -> Carry:
    op = TickOps(row, inp.stage)
    carry, y = forward(ctx, inp, carry, op)
    carry = head(ctx, inp, carry, op, y)
    dx = None
    if not ctx.spec.forward_only:
        carry, dx = backward(ctx, inp, carry, op)
    if ctx.spec.schedule.split:
        carry = weight(ctx, inp, carry, op)
    return transfer(ctx, carry, op, y, dx)


# --------------------------------------------------------------------------- the step


_LAYERS = jax.tree_util.DictKey("layers")


def reduce(
    final: Carry,
    scatter: bool = False,
    tensor: int = 1,
    kv_replicated: bool = False,
    context: int = 1,
    experts: int = 1,
) -> tuple[jax.Array, Params, Params] | jax.Array:
    """The step's only collectives over `stage`, `context` and `data`, after the loop:
    the mean loss, and unless this was an evaluation the stage's gradients and the shared
    ones. Each context device's are sums over its own positions: they add up.

    With `scatter` (the sharded optimizer) a gradient is reduce-scattered over `data`
    along `sharding.data_split_dim`: each replica gets the mean of its share alone, for
    half the bytes of an all-reduce (leaves that do not split are all-reduced).

    With `tensor` > 1 the gradients of the weights whole on every tensor device (norm
    gains), each of which saw only this device's positions, are summed over `tensor`; so
    are those of K/V projections held whole (`kv_replicated`), each device's holding its
    query heads' share of its K/V head's gradient.

    With `experts` > 1 (expert parallelism over `data`) each replica holds its own experts,
    whose gradients already sum every replica's tokens (the dispatch's transposes brought
    them): they are only divided by the replica count, for the mean."""
    summed = (CONTEXT,) if context > 1 else ()  # each device's share adds up
    loss = jax.lax.pmean(jax.lax.psum(final.loss, (STAGE, *summed)), DATA)
    if not final.grads:
        return loss
    data = jax.lax.axis_size(DATA) if scatter else 1

    def whole(path, shape):  # a local gradient's shape as among the parameters
        dim = sharding.tensor_split_dim(path, shape)
        if dim is None or (kv_replicated and path[-1].key in KV_PARAMS):
            return shape
        return (*shape[:dim], shape[dim] * tensor, *shape[dim + 1 :])

    def mean(g, path, shape, lead: int):  # `shape`: as among the parameters
        axes = summed
        if experts > 1 and sharding.is_expert(path):
            return (jax.lax.psum(g, axes) if axes else g) / jax.lax.axis_size(DATA)
        if tensor > 1 and sharding.tensor_split_dim(path, shape, tensor) is None:
            axes += (TENSOR,)
        dim = sharding.data_split_dim(path, shape, data, tensor)
        if dim is None:  # one all-reduce over the data replicas and the devices that add up
            return jax.lax.psum(g, (DATA, *axes)) / jax.lax.axis_size(DATA)
        g = jax.lax.psum(g, axes) if axes else g
        return jax.lax.psum_scatter(g, DATA, scatter_dimension=dim + lead, tiled=True) / data

    def shared(path, g):
        return mean(g, path, whole(path, g.shape), 0)

    def layer(path, g):  # [V, n, ...] here, [N, ...] among the parameters
        path = (_LAYERS, *path)
        return mean(g, path, whole(path, (None, *g.shape[2:])), 1)

    grads_shared = jax.tree_util.tree_map_with_path(
        shared, jax.lax.psum(final.grads["shared"], STAGE)
    )
    grads_layers = jax.tree_util.tree_map_with_path(layer, final.grads["layers"])
    return loss, jax.tree.map(lambda g: g[None], grads_layers), grads_shared


def program_rows(spec: PipelineSpec) -> dict[str, jax.Array]:
    """The schedule's per-tick rows [T, S] that the scan steps through."""
    prog = spec.program
    return {
        f.name: jnp.asarray(getattr(prog, f.name))
        for f in dataclasses.fields(prog)
        if isinstance(getattr(prog, f.name), np.ndarray)
    }


def stage_step(
    spec: PipelineSpec,
    layers_VxN: Params,
    shared: Params,
    tokens_BxL1: jax.Array,
    scatter: bool = False,
    packed: tuple = (),
):
    """Runs on one (data, stage) device: the replica's loss and this stage's gradients
    (the loss alone in an evaluation); with `scatter`, this replica's share of them.
    `packed` (packed rows): the replica's (documents, positions) [B, L+1] (either may be
    None) and the global batch's count of counted targets."""
    M = spec.schedule.microbatches
    rows, seq_len = tokens_BxL1.shape[0] // M, tokens_BxL1.shape[1] - 1
    ctx = Context(spec, rows, 1.0 / (tokens_BxL1.shape[0] * seq_len))
    documents, positions, count = packed or (None, None, None)
    init = carry_lib.zeros(carry_lib.abstract(spec, rows, layers_VxN, shared))
    if spec.policy.casts_once:
        # Once a step, not in every unit's every layer: a vjp keeps the compute-dtype
        # weights by reference rather than a cast copy per stashed unit, and no unit
        # re-reads float32 weights to convert them (on a GPU, 8 kernels a layer pass and
        # twice the weight bytes, in every unit: 96 layer-stack passes a step for seq1f1b
        # M=8 K=4).
        act = jnp.dtype(spec.cfg.dtype)
        layers_VxN, shared = model.in_compute_dtype((layers_VxN, shared), act)

    def micro(x_BxL):  # [B, L] -> this context device's local rows, [M, b, L / context]
        if x_BxL is None:
            return None
        x_BxL = context.local_rows(x_BxL, spec.sequence_lengths, spec.context)
        return x_BxL.reshape(M, rows, -1)

    counted = None if documents is None else document_mask.counted_targets(documents)
    inp = StageInputs(
        layers_VxN,
        shared,
        micro(tokens_BxL1[:, :-1]),
        micro(tokens_BxL1[:, 1:]),
        jax.lax.axis_index(STAGE),
        micro(None if documents is None else documents[:, :-1]),
        micro(None if positions is None else positions[:, :-1]),
        micro(counted),
        # The gradients and the loss are averaged over `data` (`reduce`): each replica's
        # sum is scaled by the replica count over the global count.
        None
        if count is None
        else jax.lax.axis_size(DATA) / jnp.maximum(count, 1).astype(jnp.float32),
    )
    final, _ = jax.lax.scan(lambda c, row: (tick(ctx, inp, c, row), None), init, program_rows(spec))
    cfg = spec.cfg
    return reduce(final, scatter, spec.tensor, cfg.kv_replicated, spec.context, cfg.expert_parallel)


def param_specs(params: Params, tensor: int, data: int = 1, experts: int = 1) -> Params:
    """Each parameter's PartitionSpec (`sharding.leaf_spec`): how the step's shard_map
    reads the parameters, and with `data` > 1 how it returns reduce-scattered gradients;
    `experts`: the replicas a mixture's experts are split over."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: sharding.leaf_spec(p, x.shape, data, tensor, experts), params
    )


def _on_stages(params: Params, batch, spec: PipelineSpec, mesh, out_specs, scatter=False):
    """`stage_step` on every (data, stage, tensor) device of the mesh. `params["layers"]`
    is in stage order (`seqpipe.parallel.layout`): each stage's block is its V chunks, viewed as
    [V, n, ...] where it lies; the layer gradients return in the same order. Each tensor
    device reads its share of the split weights (`sharding.leaf_spec`). `batch`: tokens
    [B, L+1], or a dict of them and, packed, "documents" and "positions" (`packing`)."""
    tokens_BxL1, packed = _unpack(batch)
    spec = spec.packed_as(batch)
    if mesh.shape[TENSOR] != spec.tensor:
        raise ValueError(f"the mesh has tensor={mesh.shape[TENSOR]}, the spec {spec.tensor}")
    experts = spec.cfg.expert_parallel
    if spec.cfg.num_experts and mesh.shape[DATA] != experts:
        raise ValueError(f"the mesh has data={mesh.shape[DATA]}, the spec's experts {experts}")
    V, n = spec.virtual, spec.chunk_layers
    shared = {k: v for k, v in params.items() if k != "layers"}
    specs = param_specs(params, spec.tensor, 1, experts)

    platform = mesh.devices.flat[0].platform

    def local(layers, sh, tok, *packed):  # this stage's [V * n] layers, as V chunks and back
        chunks = jax.tree.map(lambda w: w.reshape(V, n, *w.shape[1:]), _with_kinds(layers, spec))
        step = _routed_over(spec, tok, moe.METER in layers)
        with kv_cache.layouts_for(platform):
            if step.forward_only:
                return stage_step(step, chunks, sh, tok, packed=packed)
            loss, grads, grads_shared = stage_step(step, chunks, sh, tok, scatter, packed)
        grads = {k: g for k, g in grads.items() if k != model.KIND}
        return loss, jax.tree.map(lambda g: g.reshape(V * n, *g.shape[3:]), grads), grads_shared

    rows = P(DATA)
    body = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(
            specs["layers"],
            {k: specs[k] for k in shared},
            rows,
            *(rows, rows, P())[: len(packed)],
        ),
        out_specs=out_specs,
        # Every value here is per-device and every vjp is local: with no implicit
        # invariant-to-varying casts, no psum can sneak into the tick loop (a test reads
        # the HLO to make sure); the reductions are the explicit ones after it.
        check_vma=False,
    )
    return body(params["layers"], shared, tokens_BxL1, *packed)


def _with_kinds(layers: Params, spec: PipelineSpec) -> Params:
    """This stage's layers with each one's `model.KIND` where the model mixes MLPs: the
    kinds of the layers at its stage-order positions (`seqpipe.parallel.layout`)."""
    if not spec.cfg.mixed:
        return layers
    table = model.kinds(spec.cfg, spec.placement.positions()).reshape(spec.stages, -1)
    stage = jax.lax.axis_index(STAGE)
    kinds = jax.lax.dynamic_index_in_dim(jnp.asarray(table), stage, keepdims=False)
    return {**layers, model.KIND: kinds}


def _routed_over(spec: PipelineSpec, tokens_BxL1, metered: bool) -> PipelineSpec:
    """The spec whose router losses average over the tokens of this data replica's rows
    (`seqpipe.models.moe`), as the reference's do over its batch, and are metered where
    the layers carry the meter (`model.metered`)."""
    if not spec.cfg.num_experts:
        return spec
    rows, window = tokens_BxL1.shape
    cfg = dataclasses.replace(spec.cfg, router_tokens=rows * (window - 1), router_meter=metered)
    return dataclasses.replace(spec, cfg=cfg)


def _unpack(batch) -> tuple[jax.Array, tuple]:
    """(tokens, packed) of a batch: packed rows give (documents, positions, the global
    count of counted targets), each [B, L+1] but the count (documents or positions None
    where the batch lacks them); unpacked rows ()."""
    if not isinstance(batch, dict):
        return batch, ()
    documents, positions = batch.get("documents"), batch.get("positions")
    if documents is None and positions is None:
        return batch["tokens"], ()
    count = None if documents is None else jnp.sum(document_mask.counted_targets(documents))
    return batch["tokens"], (documents, positions, count)


def loss_and_grads(
    params: Params,
    tokens_BxL1: jax.Array,
    spec: PipelineSpec,
    mesh: jax.sharding.Mesh,
    scatter: bool = False,
) -> tuple[jax.Array, Params]:
    """Pipelined loss and gradients, equal to `reference.loss_and_grads` up to float rounding
    once both are in one order: `params["layers"]` and the returned gradients of them are
    in stage order (`seqpipe.parallel.layout`), so each stage's block is its V chunks.

    With `scatter` (the sharded optimizer) the gradients come back in the optimizer
    moments' shardings (`sharding.gradient_shardings`): reduce-scattered over `data`."""
    specs = param_specs(
        params, spec.tensor, mesh.shape[DATA] if scatter else 1, spec.cfg.expert_parallel
    )
    shared_specs = {k: v for k, v in specs.items() if k != "layers"}
    loss, grads_layers, grads_shared = _on_stages(
        params, tokens_BxL1, spec, mesh, (P(), specs["layers"], shared_specs), scatter
    )
    return loss, {**grads_shared, "layers": grads_layers}


def eval_loss(
    params: Params, tokens_BxL1: jax.Array, spec: PipelineSpec, mesh: jax.sharding.Mesh
) -> jax.Array:
    """The mean loss through the pipeline's forwards alone: `spec` from
    `seqpipe.pipeline.spec.forward_only`, the training step's stages, segments and micro-batches,
    `params["layers"]` in stage order. Each device holds its stage's layers and one
    micro-batch's logits at a time."""
    return _on_stages(params, tokens_BxL1, spec, mesh, P())
