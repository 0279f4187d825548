"""One unit of pipeline work: one segment of one micro-batch through one model chunk.

The executor (`seqpipe.pipeline`), `tools.flops` and `tools.memory` all run units through
this module, so what they measure is what the executor runs.

A unit is a body (the token embedding on global chunk 0, then the chunk's layers) and, on
the last global chunk, a head (final norm, logits, loss). The head's backward runs in the
unit's forward: the loss's cotangent is the constant 1, so only dy [b, L_k, D] waits for
the body's backward, not the logits. What the body's forward keeps for its backward is the
remat policy's strategy (`strategy`): `RecomputeInput` keeps the input and re-runs the
body under `jax.vjp` (`LayerwiseRecompute` a layer at a time); `KeepLayerResiduals` keeps
what each layer's vjp holds, less what the backward re-reads (the parameters and the K/V
prefix, which lives in the KV cache), in the stash slot where the executor keeps it.

Letters: b micro-batch rows, n layers per chunk, L_k segment k's length, Lseg the longest
segment, P the prefix length (segment k's offset), H heads of width E.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from seqpipe import attention, document_mask, kv_cache, model, tensor
from seqpipe.model import Params
from seqpipe.spec import PipelineSpec


@dataclasses.dataclass(frozen=True)
class ResidualLayout:
    """How a body's vjp is rebuilt in its backward: its pytree structure, and for each leaf
    whether it comes from the residual stash (an index into `stored`), from the backward's
    own inputs (`("input", j)`: parameters and the K/V prefix, re-read rather than stashed)
    or is a constant of the trace (`("const", value)`)."""

    treedef: Any
    sources: tuple
    stored: tuple  # ShapeDtypeStruct of each stashed leaf

    @classmethod
    def split(cls, vjp, inputs) -> tuple["ResidualLayout", list]:
        """(layout, the leaves to stash) of a vjp whose re-readable inputs are `inputs`."""
        leaves, treedef = jax.tree.flatten(vjp)
        input_at = {id(x): j for j, x in enumerate(jax.tree.leaves(inputs))}
        stored_at, stored, sources = {}, [], []
        for leaf in leaves:
            if id(leaf) in input_at:
                sources.append(("input", input_at[id(leaf)]))
            elif not isinstance(leaf, jax.core.Tracer):
                sources.append(("const", leaf))
            elif leaf.size == 0:  # nothing to stash (a length kept as a shape)
                sources.append(("const", np.zeros(leaf.shape, leaf.dtype)))
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

    def take(self, vjp, inputs, name: str) -> list:
        """The leaves to stash, by this layout, of the same body's vjp traced elsewhere.
        A leaf this layout holds constant may be a tracer there: under `shard_map` JAX
        lifts a kernel's constant residuals (splash's mask tables) into its trace. The
        probe saw it constant with every input abstract, so it depends on none of them,
        and the backward rebuilds it from the probe's constant."""
        leaves = jax.tree.leaves(vjp)
        input_at = {id(x): j for j, x in enumerate(jax.tree.leaves(inputs))}
        stored = [None] * len(self.stored)
        fits = len(leaves) == self.treedef.num_leaves
        for leaf, src in zip(leaves, self.sources, strict=False) if fits else ():
            if isinstance(src, int):
                aval = jax.ShapeDtypeStruct(jnp.shape(leaf), jnp.result_type(leaf))
                fits &= id(leaf) not in input_at and aval == self.stored[src]
                stored[src] = leaf
            elif src[0] == "input":
                fits &= input_at.get(id(leaf)) == src[1]
            else:
                fits &= jnp.shape(leaf) == jnp.shape(src[1])
        if not fits:
            raise AssertionError(f"{name}: the forward's residuals differ from the probe's")
        return stored


@struct.dataclass
class Stash:
    """Slot `slot` of one stash's buffers ([slots, ...] storage words each): what a
    forward keeps for its backward, written and read where it lies, whole or (buffers
    [slots, n, ...]) a layer at a time."""

    buffers: tuple
    slot: jax.Array

    @classmethod
    def holding(cls, values) -> "Stash":
        """A one-slot stash holding `values` (a unit run alone, outside the executor)."""
        return cls(tuple(kv_cache.to_words(x)[None] for x in values), kv_cache.slot_zero())

    @classmethod
    def empty(cls, avals) -> "Stash":
        """A one-slot stash of zeros for `avals`."""
        words = lambda a: jnp.zeros((1, *a.shape), kv_cache.storage_dtype(a.dtype))  # noqa: E731
        return cls(tuple(words(a) for a in avals), kv_cache.slot_zero())

    def put(self, values) -> "Stash":
        return self._write((self.slot,), values)

    def get(self, avals) -> list:
        return self._read((self.slot,), avals)

    def put_layer(self, layer, values) -> "Stash":
        return self._write((self.slot, layer), values)

    def get_layer(self, layer, avals) -> list:
        return self._read((self.slot, layer), avals)

    # Row-major wherever read or written (`kv_cache.row_major`): a layer loop left to
    # itself lays the stash out as its layer prefers, and XLA transposed the whole stash
    # between it and the tick's loops (0.66 TB a step of gpt_1b seq1f1b K=4 on an H200).
    def _write(self, lead: tuple, values) -> "Stash":
        def write(buf, x):
            at = lead + (0,) * x.ndim
            update = kv_cache.to_words(x)[(None,) * len(lead)]
            return kv_cache.row_major(
                jax.lax.dynamic_update_slice(kv_cache.row_major(buf), update, at)
            )

        # Strict: a slot that holds fewer buffers than the values kept must fail here, not
        # drop the rest for the backward's read to find missing.
        return self.replace(
            buffers=tuple(write(b, x) for b, x in zip(self.buffers, values, strict=True))
        )

    def _read(self, lead: tuple, avals) -> list:
        def read(buf, a):
            at = lead + (0,) * len(a.shape)
            size = (1,) * len(lead) + tuple(a.shape)
            window = jax.lax.dynamic_slice(kv_cache.row_major(buf), at, size)
            return kv_cache.from_words(window.reshape(a.shape), a.dtype)

        return [read(b, a) for b, a in zip(self.buffers, avals, strict=True)]


@struct.dataclass
class LayerGrads:
    """The stage's layer gradients ({name: [V, n, ...]}, in the parameter dtype) and the
    local chunk a backward adds to: a whole chunk's, or a layer's at a time, in place."""

    layers: dict
    chunk: jax.Array

    @classmethod
    def zeros(cls, chunk_avals) -> "LayerGrads":
        """A one-chunk accumulator of zeros (a unit run alone); `chunk_avals` [n, ...]."""
        layers = jax.tree.map(lambda a: jnp.zeros((1, *a.shape), a.dtype), chunk_avals)
        return cls(layers, jnp.int32(0))

    def add(self, d_chunk: dict) -> "LayerGrads":
        """Adds each gradient given (a split B gives no weight matmuls', its W no others)."""
        return self._add((self.chunk,), d_chunk)

    def add_layer(self, layer, d_layer: dict) -> "LayerGrads":
        return self._add((self.chunk, layer), d_layer)

    def of_chunk(self) -> dict:
        return jax.tree.map(lambda acc: acc[self.chunk], self.layers)

    def _add(self, lead: tuple, d: dict) -> "LayerGrads":
        def add(acc, x):
            at = lead + (0,) * x.ndim
            old = jax.lax.dynamic_slice(acc, at, (1,) * len(lead) + x.shape)
            new = old + x.astype(acc.dtype)[(None,) * len(lead)]
            return jax.lax.dynamic_update_slice(acc, new, at)

        layers = {k: add(acc, d[k]) if k in d else acc for k, acc in self.layers.items()}
        return self.replace(layers=layers)


class RecomputeInput:
    """Keep the unit's input (one message, [b, Lseg, D]); the backward re-runs the body.
    Every segment's input has the same padded shape, so all share one stash."""

    def forward(self, unit, body, params, x_in, k_prefix, v_prefix, first, depth):
        return body(*params, x_in, k_prefix, v_prefix), (x_in,)

    def backward(
        self, unit, saved, params, k_prefix, v_prefix, tokens, first, cotangents, depth, cache, into
    ):
        body = unit.body(tokens, first, depth, cache)
        outputs, vjp = unit.vjp(body, params, saved[0], k_prefix, v_prefix)
        return outputs, _added(unit.pull(vjp, cotangents), into)

    slot_fields = ("fwd_stash", "bwd_stash")  # the `Program` rows naming a unit's slot
    # The body runs afresh in the backward, so it can read the prefix from the KV cache
    # (`body`'s `cache`): nothing of it is stashed.
    reads_cache = True
    layerwise_stash = False
    # Every backward reads one message from the one stash: read before branching, XLA
    # needs no copy of it per branch.
    read_before_branching = True

    def slot_counts(self, program) -> tuple[int, ...]:
        return (program.num_stash,)

    def saved_avals(self, unit, rows: int, first=None, depth: bool = False) -> tuple:
        return (unit.avals(rows)[2],)

    def group(self, seg: int) -> int:
        return 0


class LayerwiseRecompute(RecomputeInput):
    """`full_layer`: keep the unit's input, as `RecomputeInput`; the backward re-runs the
    chunk keeping each layer's input, then runs the layers' backwards last first, each
    layer's forward recomputed under its own vjp, and adds each layer's prefix dK/dV into
    the cotangent cache as it goes (`SegmentUnit.layerwise_backward`): no cotangent of
    the whole chunk's prefix ([n, b, P, H, E], as long as the context) is ever made."""

    def backward(
        self, unit, saved, params, k_prefix, v_prefix, tokens, first, cotangents, depth, cache, into
    ):
        return unit.layerwise_backward(
            saved[0], params, k_prefix, v_prefix, tokens, first, cotangents, depth, cache, into
        )


def _added(grads: tuple, into) -> tuple:
    """A backward's (d chunk, d shared, dx, dK prefix, dV prefix, ...), the prefix's
    cotangents added into `into` (a `kv_cache.Cotangents`) in their place when given."""
    if into is None:
        return grads
    d_chunk, d_shared, dx, dk, dv, *pack = grads
    return (d_chunk, d_shared, dx, into.add_chunk(dk, dv), *pack)


class KeepLayerResiduals:
    """Keep each layer's vjp residuals (what the per-layer checkpoint policy leaves), less
    what the backward re-reads (the layer's parameters and its K/V prefix, which lives in
    the KV cache), written into the stash slot a layer at a time as the forward runs
    (`SegmentUnit.stashing_forward`); the backward reads them back a layer at a time and
    adds each layer's parameter gradients and prefix dK/dV where they lie
    (`SegmentUnit.stashed_backward`). Under a vjp of the whole chunk, its layer scan
    stacked every layer's residuals in a buffer of its own, which the executor copied
    into the slot, and the backward copied the slot out whole and stacked every layer's
    gradients before adding them up (gpt_1b seq1f1b M=8 K=4 `pallas_gpu` on an H200, by
    `seqpipe.tools.step_cost`: 4.06 TB a step that way, 3.11 this way).

    Segments whose layers keep the same shapes (equal segments, attention that keeps
    nothing prefix-shaped) share one stash, as the input stash is shared: the schedule's
    stash slots, fewer in all than a pool per segment."""

    # The unit's own layer loops write and read the stash (`SegmentUnit.forward`).
    layerwise_stash = True
    reads_cache = True
    read_before_branching = False

    def __init__(self, shared: bool = False):
        self.shared = shared

    @property
    def slot_fields(self) -> tuple[str, str]:
        return ("fwd_stash", "bwd_stash") if self.shared else ("fwd_res", "bwd_res")

    def slot_counts(self, program) -> tuple[int, ...]:
        return (program.num_stash,) if self.shared else program.num_res

    def saved_avals(self, unit, rows: int, first=None, depth: bool = False) -> tuple:
        """Each kept leaf of a layer, for the chunk's n layers: [n, ...]."""
        sds = jax.ShapeDtypeStruct
        return tuple(sds((unit.n, *a.shape), a.dtype) for a in unit.layer_layout(rows).stored)

    def group(self, seg: int) -> int:
        return 0 if self.shared else seg


def strategy(spec: PipelineSpec):
    """The remat strategy of a spec's policy (stashes shared by segments where they can
    be)."""
    if not spec.policy.keeps_residuals:
        return LayerwiseRecompute() if spec.remat == "full_layer" else RecomputeInput()
    key = (spec.cfg, spec.remat, spec.lengths, spec.chunk_layers, spec.schedule.split)
    key += (spec.uneven, jax.sharding.get_abstract_mesh(), spec.documents, spec.positions)
    if key not in _SHARED:
        stored = {SegmentUnit(spec, k).layer_layout(1).stored for k in range(spec.segments)}
        _SHARED[key] = len(stored) == 1
    return KeepLayerResiduals(shared=_SHARED[key])


_SHARED: dict = {}  # what `strategy` depends on -> whether the segments share a stash


@dataclasses.dataclass(frozen=True)
class SegmentUnit:
    """Segment `seg` through a chunk of `layers` layers (default: the schedule's); on
    packed rows, `packing` (a `document_mask.Packing` of this micro-batch's rows: document ids
    and RoPE positions) goes to every layer (`with_packing`)."""

    spec: PipelineSpec
    seg: int
    layers: int | None = None
    packing: Any = dataclasses.field(default=None, compare=False, hash=False)

    def with_packing(self, packing) -> "SegmentUnit":
        """This unit on rows packed as `packing` (None: unpacked rows, this unit)."""
        return self if packing is None else dataclasses.replace(self, packing=packing)

    @property
    def n(self) -> int:
        return self.layers or self.spec.chunk_layers

    @property
    def strategy(self):
        return strategy(self.spec)

    @property
    def split(self) -> bool:
        """The table splits backwards into B (this unit's `backward`) and W (`weight`)."""
        return self.spec.schedule.split

    @property
    def group(self) -> int:
        """The stash this unit's saved values go to (`Program` slots of that stash)."""
        return self.strategy.group(self.seg)

    # ----------------------------------------------------------------- the functions

    def body(self, tokens_bxL, first, depth=None, cache=None):
        """(chunk params, shared, x_in, K prefix, V prefix) -> (y padded to Lseg, K, V) of
        the segment, embedding `tokens_bxL` first on global chunk 0 (`first`: a run-time
        flag, or a bool fixed at trace time, when one chunk's unit is measured alone), then
        running the chunk's first `depth` layers (a run-time count; None: all n). With
        `cache` (a `kv_cache.Prefix` of the unit's slot) the prefix is read from the KV
        cache and the K/V prefix arguments are zero sinks for its cotangents
        ([n, b, >= P, H, E]; `model.layer`)."""
        spec, length = self.spec, self.spec.local_length(self.seg)
        offset, cfg = spec.offsets[self.seg], spec.cfg

        def unit_body(p_chunk, shared, x_in, k_prefix, v_prefix, taps=None):
            def embedded():
                return model.embed(shared, tokens_bxL, cfg)

            x = _choose(first, embedded, lambda: x_in[:, :length])
            y, *rest = model.layers(
                p_chunk,
                x,
                k_prefix,
                v_prefix,
                offset,
                cfg,
                spec.policy.checkpoint,
                taps,
                depth,
                cache,
                self.packing,
            )
            return jnp.pad(y, ((0, 0), (0, spec.msg_len - length), (0, 0))), *rest

        return unit_body

    def vjp(self, body, params, x_in, k_prefix, v_prefix):
        """(outputs, pullback) of the body. Split (zero bubble): the weight matmuls are
        constants of the vjp, zero taps on their outputs take their output cotangents, and
        the pullback is (vjp, the matmuls' inputs) (`pull`)."""
        if not self.split:
            return jax.vjp(body, *params, x_in, k_prefix, v_prefix)
        chunk, shared = params
        taps = _zero_taps(self.spec.cfg, (self.n, x_in.shape[0], self.length))
        outputs, vjp, inputs = _split_vjp(body, chunk, shared, x_in, k_prefix, v_prefix, taps)
        return outputs, (vjp, inputs)

    def pull(self, pullback, cotangents):
        """(d chunk, d shared, dx, dK prefix, dV prefix) of a `vjp` pullback; split, d chunk
        lacks the weight matmuls and a sixth entry is what `weight` reads: (the matmuls'
        inputs, their output cotangents)."""
        if not self.split:
            return pullback(cotangents)
        vjp, inputs = pullback
        d_rest, d_shared, dx, dk, dv, d_taps = vjp(cotangents)
        return d_rest, d_shared, dx, dk, dv, (inputs, d_taps)

    def weight(self, pack):
        """W: the weight matmuls' gradients of the chunk from what its B left (`pull`)."""
        return model.weight_grads(*pack, self.spec.cfg)

    def weight_avals(self, rows: int) -> tuple:
        """What B leaves for W ([n, b, L_k, ...] per matmul input and output cotangent)."""
        cfg, sds = self.spec.cfg, jax.ShapeDtypeStruct
        shapes = model.matmul_shapes(cfg, (self.n, rows, self.length))
        return tuple({k: sds(s, cfg.dtype) for k, s in d.items()} for d in shapes)

    @property
    def length(self) -> int:
        return self.spec.lengths[self.seg]

    def packing_avals(self, rows: int):
        """The abstract `document_mask.Packing` this unit's rows carry (None: unpacked): kernel
        ids of the prefix and the segment [b, P + L_k], positions [b, L_k]."""
        spec, sds, i32 = self.spec, jax.ShapeDtypeStruct, jnp.int32
        if not spec.packed:
            return None
        keys = spec.offsets[self.seg] + self.length
        ids = sds((rows, keys), i32) if spec.documents else None
        return document_mask.Packing(ids, sds((rows, self.length), i32) if spec.positions else None)

    def head_loss(self, shared: Params, y, targets_bxL, scale=1.0, counted_bxL=None):
        """The head on the segment's rows of y: its summed token loss (of the `counted_bxL`
        targets alone, on packed rows), scaled."""
        length, cfg = self.spec.local_length(self.seg), self.spec.cfg
        return model.head_loss_sum(shared, y[:, :length], targets_bxL, cfg, counted_bxL) * scale

    def head(self, shared: Params, y, targets_bxL, scale=1.0, counted_bxL=None):
        """(loss, d shared, dy) of the head on y, its backward run at once."""

        def loss_of(sh, y):
            return self.head_loss(sh, y, targets_bxL, scale, counted_bxL)

        loss, vjp = jax.vjp(loss_of, shared, y)
        d_shared, dy = vjp(jnp.ones((), loss.dtype))
        return loss, d_shared, dy

    def forward(
        self,
        params,
        x_in,
        k_prefix,
        v_prefix,
        tokens_bxL,
        first,
        depth=None,
        cache=None,
        stash=None,
    ):
        """((y, K, V), what the backward needs) of the body; `params` = (chunk, shared);
        `cache`: see `body`. With `stash` (a `Stash`: the executor's slot) what the
        backward needs is written there and the updated `Stash` takes its place."""
        rows = x_in.shape[0]
        if self.strategy.layerwise_stash:
            own = stash if stash is not None else Stash.empty(self.saved_avals(rows))
            args = (params, x_in, k_prefix, v_prefix, tokens_bxL, first, depth, cache, own)
            outputs, own = self.stashing_forward(*args)
            return outputs, own if stash is not None else tuple(own.get(self.saved_avals(rows)))
        body = self.body(tokens_bxL, first, depth, cache)
        args = (self, body, params, x_in, k_prefix, v_prefix, first, depth)
        outputs, saved = self.strategy.forward(*args)
        return outputs, saved if stash is None else stash.put(saved)

    def backward(
        self,
        saved,
        params,
        k_prefix,
        v_prefix,
        tokens_bxL,
        first,
        cotangents,
        keep_outputs=False,
        depth=None,
        cache=None,
        into=None,
        grads=None,
    ):
        """(d chunk, d shared, dx, dK prefix, dV prefix) from what the forward saved (the
        values, or the `Stash` slot holding them) and the cotangents (dy, dK, dV) of the
        body's outputs; split, B's (`pull`). With `into` (a
        `kv_cache.Cotangents`) the prefix's dK, dV are added to it, which takes their
        place in the result; with `grads` (a `LayerGrads`) so is d chunk (layer by layer
        where the strategy runs the layers one at a time). `keep_outputs` (measurement
        only) also returns a recomputed forward's outputs, so XLA cannot drop the work
        that only they need, as it cannot inside the executor's layer loop."""
        if self.strategy.layerwise_stash:
            own = saved if isinstance(saved, Stash) else Stash.holding(saved)
            acc = grads if grads is not None else LayerGrads.zeros(params[0])
            args = (own, params, k_prefix, v_prefix, tokens_bxL, first, cotangents, depth)
            acc, *rest = self.stashed_backward(*args, cache, into, acc)
            result = (acc if grads is not None else acc.of_chunk(), *rest)
            return (None, result) if keep_outputs else result
        if isinstance(saved, Stash):
            rows = cotangents[0].shape[0]
            saved = saved.get(self.saved_avals(rows, depth=depth is not None))
        args = (self, saved, params, k_prefix, v_prefix, tokens_bxL, first, cotangents, depth)
        outputs, result = self.strategy.backward(*args, cache, into)
        if grads is not None:
            result = (grads.add(result[0]), *result[1:])
        return (outputs, result) if keep_outputs else result

    def _start(self, tokens_bxL, first):
        """shared, x_in -> the chunk's input: the embedding on global chunk 0, else the
        message's first L_k positions."""
        cfg, length = self.spec.cfg, self.spec.local_length(self.seg)

        def start(shared, x_in):
            return _choose(
                first, lambda: model.embed(shared, tokens_bxL, cfg), lambda: x_in[:, :length]
            )

        return start

    def _sinks(self, rows: int):
        """Zeros that take one layer's prefix dK, dV where the prefix is read from the cache
        ([b, P, H, E]; their values are never read)."""
        cfg = self.spec.cfg
        shape = (rows, self.spec.offsets[self.seg], cfg.local_kv_heads, cfg.head_dim)
        sink = jnp.zeros(shape, cfg.dtype)
        return sink, sink

    def _layer_prefix(self, rows: int, at):
        """(K prefix, V prefix, cache view) that one layer's vjp takes, `at` the cache at
        the layer (a `kv_cache.Prefix`): zero sinks for the prefix's cotangents and the
        view where the attention reads the cache in place; else the prefix copied out of
        the cache, and no view. Inputs either way: the backward re-reads them, so no
        prefix-shaped copy is ever stashed."""
        cfg, offset = self.spec.cfg, self.spec.offsets[self.seg]
        if attention.reads_cache_in_place(cfg.attention):
            return (*self._sinks(rows), at)
        return at.block(0, 0, offset, cfg.dtype), at.block(1, 0, offset, cfg.dtype), None

    def _layer_vjp(self, p, x, k_prefix, v_prefix, at):
        """((y, K, V), pullback) of one layer on its prefix (`_layer_prefix`: sinks and
        the cache view `at`, or arrays and None), differentiated in (p, x, K prefix, V
        prefix, at) under the policy's per-layer checkpoint; split (zero bubble), the
        pullback is (vjp with the weight matmuls held constant, their inputs), as `vjp`'s.
        `at` is an argument, not a closure, so that its leaves are known as the backward's
        own inputs (`ResidualLayout.split`), never stashed."""
        spec, cfg = self.spec, self.spec.cfg
        offset = spec.offsets[self.seg]

        def run(p, x, k_prefix, v_prefix, at, packing, taps=None):
            return model.layer(p, x, k_prefix, v_prefix, offset, cfg, taps, at, packing)

        if spec.policy.checkpoint is not None:
            run = jax.checkpoint(run, policy=model.CHECKPOINT_POLICIES[spec.policy.checkpoint])
        # The packing is an argument too: what of it a layer keeps (ids, positions) is
        # re-read from the backward's inputs, never stashed per layer.
        if not self.split:
            return jax.vjp(run, p, x, k_prefix, v_prefix, at, self.packing)
        taps = _zero_taps(cfg, (x.shape[0], self.length))
        outputs, vjp, inputs = _split_vjp(run, p, x, k_prefix, v_prefix, at, self.packing, taps)
        return outputs, (vjp, inputs)

    def _pull_layer(self, pullback, d_out):
        """(d p, dx, dK prefix, dV prefix, what W reads) of a `_layer_vjp` pullback."""
        if not self.split:
            d_p, dx, dk, dv, *_ = pullback(d_out)
            return d_p, dx, dk, dv, ()
        vjp, inputs = pullback
        d_rest, dx, dk, dv, *_, d_taps = vjp(d_out)
        return d_rest, dx, dk, dv, (inputs, d_taps)

    def stashing_forward(
        self, params, x_in, k_prefix, v_prefix, tokens_bxL, first, depth, cache, stash
    ):
        """`forward` a layer at a time (`KeepLayerResiduals`): ((y, K, V), stash), each
        layer's residuals written into `stash` at the layer as it runs. Without `cache` (a
        unit run alone) the prefix arrays are put in a cache of one slot first, so that
        the layers run as in the executor."""
        spec, rows = self.spec, x_in.shape[0]
        length, chunk, shared = spec.local_length(self.seg), *params
        cache = cache if cache is not None else kv_cache.Prefix.holding(k_prefix, v_prefix)
        layout = self.layer_layout(rows, cache)
        x0 = self._start(tokens_bxL, first)(shared, x_in)

        def live(i, p, x, words_k, words_v, slot):
            prefix = self._layer_prefix(rows, kv_cache.Prefix(words_k, words_v, slot, i))
            (y, k, v), pullback = self._layer_vjp(p, x, *prefix)
            inputs = (p, *prefix, self.packing)
            return y, k, v, layout.take(pullback, inputs, f"segment {self.seg}")

        def step(carry, per):
            x, stash = carry
            i, p = per
            args = (i, p, x, cache.words_k, cache.words_v, cache.slot)
            if depth is None:
                y, k, v, kept = live(*args)
            else:  # past `depth` a layer is padding (`model.layers`)
                y, k, v, kept = jax.lax.cond(i < depth, live, _passed(live), *args)
            return (y, stash.put_layer(i, kept)), (k, v)

        index = jnp.arange(self.n)
        (y, stash), (k, v) = jax.lax.scan(step, (x0, stash), (index, chunk))
        return (jnp.pad(y, ((0, 0), (0, spec.msg_len - length), (0, 0))), k, v), stash

    def stashed_backward(
        self,
        stash,
        params,
        k_prefix,
        v_prefix,
        tokens_bxL,
        first,
        cotangents,
        depth,
        cache,
        into,
        grads,
    ):
        """`backward` a layer at a time (`KeepLayerResiduals`): (grads, d shared, dx, into
        or dK, dV prefix[, what W reads]). Last layer first, each layer's vjp is rebuilt
        from its residuals in `stash` and pulls dx back; its parameter gradients go into
        `grads` (a `LayerGrads`) and its prefix dK/dV into `into` at once (without it,
        stacked and returned)."""
        spec, cfg = self.spec, self.spec.cfg
        chunk, shared = params
        dy, dk_own, dv_own = cotangents
        rows, length = dy.shape[0], spec.local_length(self.seg)
        cache = cache if cache is not None else kv_cache.Prefix.holding(k_prefix, v_prefix)
        layout = self.layer_layout(rows, cache)

        def pull(i, p, leaves, d_out):
            prefix = self._layer_prefix(rows, cache.at_layer(i))
            pullback = layout.rebuild(leaves, (p, *prefix, self.packing))
            return self._pull_layer(pullback, d_out)

        def step(carry, per):
            dx, into, grads = carry
            i, p, dk, dv = per
            args = (i, p, stash.get_layer(i, layout.stored), (dx, dk, dv))
            if depth is None:
                d_p, dx, dk_prefix, dv_prefix, pack = pull(*args)
            else:
                d_p, dx, dk_prefix, dv_prefix, pack = jax.lax.cond(
                    i < depth, pull, _passed(pull, at=1), *args
                )
            grads = grads.add_layer(i, d_p)
            if into is None:
                return (dx, into, grads), (pack, dk_prefix, dv_prefix)
            return (dx, into.add_layer(i, dk_prefix, dv_prefix), grads), (pack, None, None)

        per_layer = (jnp.arange(self.n), chunk, dk_own, dv_own)
        (dx0, into, grads), (pack, dk, dv) = jax.lax.scan(
            step, (dy[:, :length], into, grads), per_layer, reverse=True
        )
        x_in = jnp.zeros((rows, spec.msg_len, cfg.d_model), cfg.dtype)  # unread: linear
        _, start_vjp = jax.vjp(self._start(tokens_bxL, first), shared, x_in)
        d_shared, dx = start_vjp(dx0)
        kept = (into,) if into is not None else (dk, dv)
        return (grads, d_shared, dx, *kept, *((pack,) if self.split else ()))

    def layerwise_backward(
        self, x_in, params, k_prefix, v_prefix, tokens_bxL, first, cotangents, depth, cache, into
    ):
        """`backward` a layer at a time (`LayerwiseRecompute`): ((y, K, V) recomputed,
        grads). The chunk is re-run keeping each layer's input; then, last layer first, each
        layer's vjp (its forward recomputed) pulls dx back, and its prefix dK/dV go into
        `into` at once (or, without it, are stacked and returned as `backward` does)."""
        spec, cfg, n = self.spec, self.spec.cfg, self.n
        offset, length = spec.offsets[self.seg], spec.local_length(self.seg)
        chunk, shared = params
        dy, dk_own, dv_own = cotangents
        rows = x_in.shape[0]
        index = jnp.arange(n)

        start = self._start(tokens_bxL, first)

        def prefix(k_prefix, v_prefix):
            """One layer's prefix: zero sinks for its cotangents when it lies in the cache."""
            return (k_prefix, v_prefix) if cache is None else self._sinks(rows)

        def run(i, p, x, k_prefix, v_prefix, taps=None):
            at = None if cache is None else cache.at_layer(i)
            return model.layer(p, x, k_prefix, v_prefix, offset, cfg, taps, at, self.packing)

        def alive(i, live, dead, *args):  # past `depth` a layer is padding (`model.layers`)
            return live(*args) if depth is None else jax.lax.cond(i < depth, live, dead, *args)

        def forward(x, per):
            i, p, k_prefix, v_prefix = per
            args = (i, p, x, *prefix(k_prefix, v_prefix))
            y, k, v = alive(i, lambda *a: run(*a)[:3], _passed(lambda *a: run(*a)[:3]), *args)
            return y, (x, k, v)

        # The prefix arrays when there is no cache (a unit measured alone); else sinks.
        k_prefix, v_prefix = (k_prefix, v_prefix) if cache is None else (None, None)
        x0, start_vjp = jax.vjp(start, shared, x_in)
        y, (inputs, k, v) = jax.lax.scan(forward, x0, (index, chunk, k_prefix, v_prefix))
        outputs = (jnp.pad(y, ((0, 0), (0, spec.msg_len - length), (0, 0))), k, v)

        def layer_vjp(i, p, x, k_prefix, v_prefix, d_out):
            """(d params, dx, dK prefix, dV prefix, what W reads) of one layer."""
            if not self.split:
                _, vjp = jax.vjp(lambda *a: run(i, *a), p, x, k_prefix, v_prefix)
                return (*vjp(d_out), ())
            taps = _zero_taps(cfg, (rows, self.length))
            _, vjp, inputs = _split_vjp(lambda *a: run(i, *a), p, x, k_prefix, v_prefix, taps)
            d_rest, dx, dkp, dvp, d_taps = vjp(d_out)
            return d_rest, dx, dkp, dvp, (inputs, d_taps)

        def backward(carry, per):
            dx, into = carry
            # As jax.checkpoint does: XLA must not merge this forward with the one above
            # (it would, in a one-layer chunk, whose loops it unrolls).
            i, p, x, k_prefix, v_prefix, dk, dv = jax.lax.optimization_barrier(per)
            args = (i, p, x, *prefix(k_prefix, v_prefix), (dx, dk, dv))
            d_p, dx, dkp, dvp, pack = alive(i, layer_vjp, _passed(layer_vjp, at=1), *args)
            if into is None:
                return (dx, into), (d_p, pack, dkp, dvp)
            return (dx, into.add_layer(i, dkp, dvp)), (d_p, pack, None, None)

        per_layer = (index, chunk, inputs, k_prefix, v_prefix, dk_own, dv_own)
        (dx0, into), (d_chunk, pack, dk, dv) = jax.lax.scan(
            backward, (dy[:, :length], into), per_layer, reverse=True
        )
        d_shared, dx = start_vjp(dx0)
        kept = (into,) if into is not None else (dk, dv)
        return outputs, (d_chunk, d_shared, dx, *kept, *((pack,) if self.split else ()))

    # ----------------------------------------------------------------- shapes

    def avals(self, rows: int) -> tuple:
        """Abstract (chunk params, shared params, x_in, K prefix, V prefix, tokens, targets)
        as the executor passes them (parameters in the compute dtype when residuals are
        kept: the executor casts them once per step)."""
        spec, cfg, sds = self.spec, self.spec.cfg, jax.ShapeDtypeStruct
        act = jnp.dtype(cfg.dtype)
        shapes = model.param_shapes(cfg)
        if spec.policy.keeps_residuals:
            shapes = jax.tree.map(lambda x: sds(x.shape, act), shapes)
        chunk = jax.tree.map(lambda x: sds((self.n,) + x.shape[1:], x.dtype), shapes["layers"])
        shared = {k: x for k, x in shapes.items() if k != "layers"}
        x_in = sds((rows, spec.msg_len, cfg.d_model), act)
        prefix = sds((self.n, rows, spec.offsets[self.seg], cfg.local_kv_heads, cfg.head_dim), act)
        tokens = sds((rows, spec.lengths[self.seg]), jnp.int32)
        return chunk, shared, x_in, prefix, prefix, tokens, tokens

    def kv_avals(self, rows: int) -> jax.ShapeDtypeStruct:
        """The segment's own K (or V), or its cotangent: [n, b, L_k, H, E]."""
        cfg = self.spec.cfg
        shape = (self.n, rows, self.spec.lengths[self.seg], cfg.local_kv_heads, cfg.head_dim)
        return jax.ShapeDtypeStruct(shape, cfg.dtype)

    def head_dy_aval(self, rows: int) -> jax.ShapeDtypeStruct:
        """What a last-chunk unit keeps of its head: dy of its own positions (this tensor
        device's)."""
        cfg = self.spec.cfg
        shape = (rows, self.spec.local_length(self.seg), cfg.d_model)
        return jax.ShapeDtypeStruct(shape, cfg.dtype)

    def saved_avals(self, rows: int, first=None, depth: bool = False) -> tuple:
        """The abstract values one forward keeps for its backward (one stash slot); `depth`:
        with a run-time layer count, as the executor runs an uneven split."""
        return self.strategy.saved_avals(self, rows, first, depth)

    def layer_layout(self, rows: int, cache=None) -> ResidualLayout:
        """One layer's residual layout (`KeepLayerResiduals`), from an abstract trace: the
        same for every layer of the chunk. Its pullback knows its inputs' shapes, the K/V
        cache's (`cache`, a `kv_cache.Prefix`; default: the executor's, of one slot) among
        them."""
        spec, cfg = self.spec, self.spec.cfg
        words = (1, self.n, rows, spec.kv_len, cfg.local_kv_heads, cfg.head_dim)
        words = words if cache is None else cache.words_k.shape
        key = (spec.cfg, spec.remat, spec.lengths, self.seg, self.n, rows, self.split, words)
        key += (jax.sharding.get_abstract_mesh(), spec.documents, spec.positions)
        if key not in _LAYOUTS:
            _LAYOUTS[key] = _probe_layer_layout(self, rows, words)
        return _LAYOUTS[key]


_LAYOUTS: dict = {}  # what a layout depends on -> the layout (probes are abstract traces)


def _probe_layer_layout(unit: SegmentUnit, rows: int, words: tuple) -> ResidualLayout:
    found = []

    def probe(p, x, words_k, words_v, slot, layer, packing):
        prefix = unit._layer_prefix(rows, kv_cache.Prefix(words_k, words_v, slot, layer))
        packed = dataclasses.replace(unit, packing=packing)
        _, pullback = packed._layer_vjp(p, x, *prefix)
        layout, stored = ResidualLayout.split(pullback, (p, *prefix, packing))
        found.append(layout)
        return stored

    spec, cfg, sds = unit.spec, unit.spec.cfg, jax.ShapeDtypeStruct
    chunk, _, x_in, *_ = unit.avals(rows)
    p = jax.tree.map(lambda a: sds(a.shape[1:], a.dtype), chunk)
    x = sds((rows, spec.local_length(unit.seg), cfg.d_model), x_in.dtype)
    words = sds(words, kv_cache.storage_dtype(cfg.dtype))
    index = sds((), jnp.int32)
    packing = unit.packing_avals(rows)
    jax.eval_shape(tensor.bound(probe, spec.tensor), p, x, words, words, index, index, packing)
    return found[0]


def _zero_taps(cfg, lead: tuple) -> dict:
    """Zeros shaped as each weight matmul's output (`lead` dimensions in front), added to
    them so that their cotangents are the matmuls' output cotangents (a split B)."""
    return {k: jnp.zeros(s, cfg.dtype) for k, s in model.matmul_shapes(cfg, lead)[1].items()}


def _split_vjp(fn, p, *args):
    """(outputs, vjp, the matmuls' inputs) of fn(p, *args) -> (*outputs, inputs), the last
    of `args` being the taps, with p's weight matmuls held constant: vjp gives (d p less
    the matmuls, *d args), the taps' cotangents last."""
    mats = {k: w for k, w in p.items() if k in model.MATMULS}

    def tapped(rest, *args):
        *outputs, inputs = fn({**rest, **mats}, *args)
        return tuple(outputs), inputs

    rest = {k: w for k, w in p.items() if k not in model.MATMULS}
    return jax.vjp(tapped, rest, *args, has_aux=True)


def _passed(fn, at: int = 0):
    """What `fn` gives for a padding layer (past `depth`): its input x (argument 2, or the
    cotangent dx of a backward) passed through as output `at`, zeros elsewhere."""

    def passed(*args):
        out = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, *args))
        x = args[2] if at == 0 else args[-1][0]
        return (*out[:at], x, *out[at + 1 :])

    return passed


def _choose(flag, if_true, if_false):
    """lax.cond on a run-time flag; a Python bool picks its branch at trace time, so
    neither the other branch nor its residuals exist."""
    if isinstance(flag, bool):
        return if_true() if flag else if_false()
    return jax.lax.cond(flag, if_true, if_false)
