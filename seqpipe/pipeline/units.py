"""One unit of pipeline work: one segment of one micro-batch through one model chunk.

The executor (`seqpipe.pipeline`), `tools.flops` and `tools.memory` all run units through
this module, so what they measure is what the executor runs.

A unit is a body (the token embedding on global chunk 0, then the chunk's layers) and, on
the last global chunk, a head (final norm, logits, loss). The head's backward runs in the
unit's forward: the loss's cotangent is the constant 1, so only dy [b, L_k, D] waits for
the body's backward, not the logits. How the body's forward and backward run, and what
the forward keeps for the backward, is the remat policy's strategy (`strategy`,
`seqpipe.pipeline.remat_strategies`); the unit holds what they share: the body, the head, one
layer's vjp and the storage they write in place (`Stash`, `LayerGrads`). A unit's inputs
travel as a `UnitInputs`.

Letters: b micro-batch rows, n layers per chunk, L_k segment k's length, Lseg the longest
segment, P the prefix length (segment k's offset), H heads of width E.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from seqpipe.kernels import attention, kv_cache
from seqpipe.models import document_mask, model
from seqpipe.models.model import Params
from seqpipe.parallel import sharding
from seqpipe.pipeline import remat_strategies
from seqpipe.pipeline.spec import PipelineSpec


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


@struct.dataclass
class UnitInputs:
    """What a unit reads besides what its forward saved (`SegmentUnit.forward`,
    `backward`); letters as above."""

    chunk: Params  # the chunk's layers, [n, ...] each
    shared: Params  # the embedding, final norm and head
    x_in: Any  # the message in, [b, Lseg, D]; None in a backward (the strategy keeps it)
    # The K/V prefix, [n, b, P, H, E]; with `cache`, zero sinks for its cotangents
    # ([n, b, >= P, H, E]; `model.layer`), the prefix itself read from the cache.
    k_prefix: Any
    v_prefix: Any
    tokens: Any  # the segment's tokens [b, L_k], embedded on global chunk 0
    # Global chunk 0: a run-time flag, or a bool fixed at trace time (a chunk's unit
    # measured alone).
    first: Any
    depth: Any = None  # the chunk's first `depth` layers run (a run-time count); None: all n
    cache: Any = None  # the unit's slot of the K/V cache (a `kv_cache.Prefix`), or None

    def arrays(self) -> tuple:
        """(chunk, shared, x_in, K prefix, V prefix): what the body is differentiated in."""
        return self.chunk, self.shared, self.x_in, self.k_prefix, self.v_prefix

    def prefix_cache(self) -> kv_cache.Prefix:
        """The K/V cache slot; without one (a unit run alone) a cache of one slot holding
        the prefix arrays, so that layers run a layer at a time as in the executor."""
        if self.cache is not None:
            return self.cache
        return kv_cache.Prefix.holding(self.k_prefix, self.v_prefix)


def strategy(spec: PipelineSpec) -> remat_strategies.Strategy:
    """The remat strategy of a spec's policy (`remat.Policy.strategy`), its stashes
    shared by segments where they can be."""
    units = tuple(SegmentUnit(spec, k) for k in range(spec.segments))
    return remat_strategies.named(spec.policy.strategy).of(spec, units)


@dataclasses.dataclass(frozen=True)
class SegmentUnit:
    """Segment `seg` through a chunk of `layers` layers (default: the schedule's); on packed
    rows, `packing` (a `document_mask.Packing`: the rows' document ids and RoPE positions)
    goes to every layer. Its forward and backward are its remat strategy's."""

    spec: PipelineSpec
    seg: int
    layers: int | None = None
    packing: Any = dataclasses.field(default=None, compare=False, hash=False)

    def with_packing(self, packing) -> "SegmentUnit":
        """This unit on rows packed as `packing` (None: unpacked rows, this unit)."""
        return self if packing is None else dataclasses.replace(self, packing=packing)

    @property
    def segment_layout(self):
        """What every layer reads of how the segment's positions lie: `packing`, with the
        context split where there is one (`PipelineSpec.context_split`)."""
        split = self.spec.context_split(self.seg)
        if split is None:
            return self.packing
        return dataclasses.replace(self.packing or document_mask.Packing(), context=split)

    @property
    def n(self) -> int:
        return self.layers or self.spec.chunk_layers

    @property
    def length(self) -> int:
        return self.spec.lengths[self.seg]

    @property
    def strategy(self) -> remat_strategies.Strategy:
        return strategy(self.spec)

    @property
    def split(self) -> bool:
        """The table splits backwards into B (this unit's `backward`) and W (`weight`)."""
        return self.spec.schedule.split

    @property
    def group(self) -> int:
        """The stash this unit's saved values go to (`Program` slots of that stash)."""
        return self.strategy.group(self.seg)

    # ----------------------------------------------------------------- what runs

    def forward(self, inputs: UnitInputs, stash: Stash | None = None):
        """((y padded to Lseg, K, V), what the backward needs) of the body on `inputs`. With
        `stash` (a `Stash`: the executor's slot) what the backward needs is written there
        and the updated `Stash` takes its place."""
        return self.strategy.forward(self, inputs, stash)

    def backward(self, inputs, saved, cotangents, into=None, grads=None, keep_outputs=False):
        """(d chunk, d shared, dx, dK prefix, dV prefix[, what W reads]) from what the
        forward saved (values, or their `Stash` slot) and the cotangents (dy, dK, dV) of the
        body's outputs; `into`, `grads`: see `Strategy.backward`. `keep_outputs`
        (measurement only) also returns a recomputed forward's outputs, so XLA cannot drop
        the work only they need, as it cannot inside the executor's layer loop."""
        outputs, result = self.strategy.backward(self, inputs, saved, cotangents, into, grads)
        return (outputs, result) if keep_outputs else result

    def start(self, inputs: UnitInputs):
        """shared, x_in -> the chunk's input: the embedding on global chunk 0, else the
        message's first L_k positions."""
        cfg, length, first = self.spec.cfg, self.spec.local_length(self.seg), inputs.first

        def start(shared, x_in):
            embedded = lambda: model.embed(shared, inputs.tokens, cfg)  # noqa: E731
            return _choose(first, embedded, lambda: x_in[:, :length])

        return start

    def body(self, inputs: UnitInputs):
        """(chunk, shared, x_in, K prefix, V prefix[, taps]) -> (y padded to Lseg, K, V)
        of the segment: `start`, then the chunk's first `inputs.depth` layers."""
        spec, start = self.spec, self.start(inputs)

        def unit_body(chunk, shared, x_in, k_prefix, v_prefix, taps=None):
            x, offset = start(shared, x_in), spec.offsets[self.seg]
            run = (spec.policy.checkpoint, taps, inputs.depth, inputs.cache, self.segment_layout)
            y, *rest = model.layers(chunk, x, k_prefix, v_prefix, offset, spec.cfg, *run)
            return self.padded(y), *rest

        return unit_body

    def run(self, inputs: UnitInputs):
        """(y, K, V) of the body on `inputs`, nothing kept."""
        return self.body(inputs)(*inputs.arrays())

    def padded(self, y):
        """The body's output y [b, L_k, D] padded to a message's length, [b, Lseg, D]."""
        pad = self.spec.msg_len - self.spec.local_length(self.seg)
        return jnp.pad(y, ((0, 0), (0, pad), (0, 0)))

    def vjp(self, inputs: UnitInputs):
        """(outputs, pullback) of the body at `inputs`, in `inputs.arrays()`. Split (zero
        bubble): the weight matmuls are constants of the vjp, zero taps on their outputs take
        their output cotangents, and the pullback is (vjp, the matmuls' inputs) (`pull`)."""
        body, args = self.body(inputs), inputs.arrays()
        if not self.split:
            return jax.vjp(body, *args)
        taps = _zero_taps(self.spec.cfg, (self.n, inputs.x_in.shape[0], self.length))
        outputs, vjp, matmul_inputs = _split_vjp(body, *args, taps)
        return outputs, (vjp, matmul_inputs)

    def pull(self, pullback, cotangents):
        """(d chunk, d shared, dx, dK prefix, dV prefix) of a `vjp` pullback; split, less the
        weight matmuls', and what `weight` reads: (the matmuls' inputs, output cotangents)."""
        if not self.split:
            return pullback(cotangents)
        vjp, inputs = pullback
        d_rest, d_shared, dx, dk, dv, d_taps = vjp(cotangents)
        return d_rest, d_shared, dx, dk, dv, (inputs, d_taps)

    def weight(self, pack):
        """W: the weight matmuls' gradients of the chunk from what its B left (`pull`)."""
        return model.weight_grads(*pack, self.spec.cfg)

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

    # ---------------------------------------------------- one layer at a time

    def sinks(self, rows: int):
        """Zeros [b, P, H, E] that take one layer's prefix dK, dV where the prefix is read
        from the cache (their values are never read)."""
        cfg = self.spec.cfg
        shape = (rows, self.spec.offsets[self.seg], cfg.local_kv_heads, cfg.head_dim)
        return (jnp.zeros(shape, cfg.dtype),) * 2

    def layer_prefix(self, rows: int, at):
        """(K prefix, V prefix, cache view) that `kept_layer_vjp` takes, `at` the cache at
        the layer: sinks and the view where attention reads the cache in place, else the
        prefix copied out and no view. Inputs: re-read by the backward, never stashed."""
        cfg, offset = self.spec.cfg, self.spec.offsets[self.seg]
        if attention.reads_cache_in_place(cfg.attention):
            return (*self.sinks(rows), at)
        return at.block(0, 0, offset, cfg.dtype), at.block(1, 0, offset, cfg.dtype), None

    def layer_vjp(self, run, p, x, *args):
        """((y, K, V), pullback) of one layer, run(p, x, *args[, taps]) -> (y, K, V[, the
        matmuls' inputs]); split (zero bubble), the pullback is (vjp with the weight
        matmuls held constant, their inputs), as `vjp`'s (`pull_layer`)."""
        if not self.split:
            return jax.vjp(run, p, x, *args)
        taps = _zero_taps(self.spec.cfg, (x.shape[0], self.length))
        outputs, vjp, inputs = _split_vjp(run, p, x, *args, taps)
        return outputs, (vjp, inputs)

    def kept_layer_vjp(self, p, x, k_prefix, v_prefix, at):
        """`layer_vjp` of one layer on its `layer_prefix` under the policy's per-layer
        checkpoint, in (p, x, K prefix, V prefix, at, packing): arguments, not closures, so
        that their leaves are known as the backward's inputs, never stashed (`ResidualLayout`)."""
        spec, cfg = self.spec, self.spec.cfg
        offset = spec.offsets[self.seg]

        def run(p, x, k_prefix, v_prefix, at, packing, taps=None):
            return model.layer(p, x, k_prefix, v_prefix, offset, cfg, taps, at, packing)

        if spec.policy.checkpoint is not None:
            run = jax.checkpoint(run, policy=model.CHECKPOINT_POLICIES[spec.policy.checkpoint])
        return self.layer_vjp(run, p, x, k_prefix, v_prefix, at, self.segment_layout)

    def pull_layer(self, pullback, d_out):
        """(d p, dx, dK prefix, dV prefix, what W reads) of a `layer_vjp` pullback."""
        if not self.split:
            d_p, dx, dk, dv, *_ = pullback(d_out)
            return d_p, dx, dk, dv, ()
        vjp, inputs = pullback
        d_rest, dx, dk, dv, *_, d_taps = vjp(d_out)
        return d_rest, dx, dk, dv, (inputs, d_taps)

    # A unit run alone (no executor): a one-slot stash of the values saved (None: zeros
    # before its forward), a one-chunk gradient accumulator of zeros.

    def stash_of(self, saved, rows: int) -> Stash:
        if isinstance(saved, Stash):
            return saved
        return Stash.empty(self.saved_avals(rows)) if saved is None else Stash.holding(saved)

    def grads_of(self, grads, chunk) -> LayerGrads:
        return grads if grads is not None else LayerGrads.zeros(chunk)

    # ----------------------------------------------------------------- shapes

    def avals(self, rows: int) -> tuple:
        """Abstract (chunk, shared, x_in, K prefix, V prefix, tokens, targets) as the executor
        passes them (parameters cast once a step to the compute dtype if residuals are kept)."""
        spec, cfg, sds = self.spec, self.spec.cfg, jax.ShapeDtypeStruct
        act = jnp.dtype(cfg.dtype)
        shapes = model.param_shapes(cfg)
        if spec.policy.keeps_residuals:
            shapes = model.in_compute_dtype(shapes, act)
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
        """What a last-chunk unit keeps of its head: dy of its (tensor device's) positions."""
        cfg = self.spec.cfg
        shape = (rows, self.spec.local_length(self.seg), cfg.d_model)
        return jax.ShapeDtypeStruct(shape, cfg.dtype)

    def saved_avals(self, rows: int, first=None, depth: bool = False) -> tuple:
        """The abstract values one forward keeps for its backward (one stash slot); `depth`:
        with a run-time layer count, as the executor runs an uneven split."""
        return self.strategy.saved_avals(self, rows, first, depth)

    def weight_avals(self, rows: int) -> tuple:
        """What B leaves for W ([n, b, L_k, ...] per matmul input and output cotangent)."""
        cfg, sds = self.spec.cfg, jax.ShapeDtypeStruct
        shapes = model.matmul_shapes(cfg, (self.n, rows, self.length))
        return tuple({k: sds(s, cfg.dtype) for k, s in d.items()} for d in shapes)

    def packing_avals(self, rows: int):
        """The abstract `document_mask.Packing` this unit's rows carry (None: unpacked): kernel
        ids of the prefix and the segment [b, P + L_k], positions [b, L_k]."""
        spec, sds, i32 = self.spec, jax.ShapeDtypeStruct, jnp.int32
        if not spec.packed:
            return None
        keys = spec.offsets[self.seg] + self.length
        ids = sds((rows, keys), i32) if spec.documents else None
        return document_mask.Packing(ids, sds((rows, self.length), i32) if spec.positions else None)

    def layer_layout(self, rows: int, cache=None) -> ResidualLayout:
        """One layer's residual layout (`KeepLayerResiduals`), the same for every layer of
        the chunk, from an abstract trace on `cache` (a `kv_cache.Prefix`; default: the
        executor's, of one slot): its pullback knows its inputs' shapes."""
        spec, cfg = self.spec, self.spec.cfg
        words = (1, self.n, rows, spec.kv_len, cfg.local_kv_heads, cfg.head_dim)
        words = words if cache is None else cache.words_k.shape
        key = (spec.cfg, spec.remat, spec.lengths, spec.context, self.seg, self.n, rows, self.split)
        key += (words,)
        key += (jax.sharding.get_abstract_mesh(), spec.documents, spec.positions)
        if key not in _LAYOUTS:
            _LAYOUTS[key] = _probe_layer_layout(self, rows, words)
        return _LAYOUTS[key]


_LAYOUTS: dict = {}  # what a layout depends on -> the layout (probes are abstract traces)


def _probe_layer_layout(unit: SegmentUnit, rows: int, words: tuple) -> ResidualLayout:
    found = []

    def probe(p, x, words_k, words_v, slot, layer, packing):
        prefix = unit.layer_prefix(rows, kv_cache.Prefix(words_k, words_v, slot, layer))
        packed = dataclasses.replace(unit, packing=packing)
        _, pullback = packed.kept_layer_vjp(p, x, *prefix)
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
    jax.eval_shape(
        sharding.bound(probe, spec.tensor, spec.context, data=spec.cfg.expert_parallel),
        p,
        x,
        words,
        words,
        index,
        index,
        packing,
    )
    return found[0]


def _zero_taps(cfg, lead: tuple) -> dict:
    """Zeros shaped as each weight matmul's output (`lead` dimensions in front), added to
    them so that their cotangents are the matmuls' output cotangents (a split B)."""
    return {k: jnp.zeros(s, cfg.dtype) for k, s in model.matmul_shapes(cfg, lead)[1].items()}


def _split_vjp(fn, p, *args):
    """(outputs, vjp, the matmuls' inputs) of fn(p, *args) -> (*outputs, inputs), the last
    of `args` being the taps, with p's tapped weight matmuls held constant: vjp gives (d p
    less those matmuls, *d args), the taps' cotangents last. (A model mixing MLPs taps
    none of its MLPs': their weights' gradients come with the rest.)"""
    mats = {k: w for k, w in p.items() if k in args[-1]}

    def tapped(rest, *args):
        *outputs, inputs = fn({**rest, **mats}, *args)
        return tuple(outputs), inputs

    rest = {k: w for k, w in p.items() if k not in mats}
    return jax.vjp(tapped, rest, *args, has_aux=True)


def _choose(flag, if_true, if_false):
    """lax.cond on a run-time flag; a Python bool picks its branch at trace time, so
    neither the other branch nor its residuals exist."""
    if isinstance(flag, bool):
        return if_true() if flag else if_false()
    return jax.lax.cond(flag, if_true, if_false)
