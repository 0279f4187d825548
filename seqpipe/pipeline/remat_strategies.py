"""What a unit's forward keeps for its backward, and how that backward runs: one
`Strategy` per `remat.POLICIES` row, named in its `strategy` column.

- `RecomputeInput` keeps the unit's input; the backward re-runs the body under `jax.vjp`.
- `LayerwiseRecompute` keeps the input; the backward re-runs the chunk keeping each layer's
  input, then runs the layers' backwards last first, each forward recomputed.
- `KeepLayerResiduals` keeps each layer's vjp residuals, written into the stash slot and
  read back a layer at a time.

Each owns its forward and backward whole. What they share (the body, the head, the K/V
bookkeeping, one layer's vjp) is the unit's, `unit` here (a `seqpipe.pipeline.units.SegmentUnit`),
and its inputs a `units.UnitInputs`. A new policy is a subclass here and a row in
`remat.POLICIES` naming it. Letters as in `seqpipe.pipeline.units`.
"""

from typing import ClassVar

import jax
import jax.numpy as jnp

from seqpipe.kernels import kv_cache
from seqpipe.models import model


class Strategy:
    """What the unit and the executor ask of a remat strategy. A subclass is known by its
    class name (`named`), which a `remat.POLICIES` row gives as its `strategy`."""

    by_name: ClassVar[dict[str, type["Strategy"]]] = {}
    keeps_residuals = False  # as the policy rows naming it say (`remat.Policy`)
    slot_fields = ("fwd_stash", "bwd_stash")  # the `Program` rows naming a unit's slot
    # The units read their prefix from the KV cache where it lies: nothing of it is
    # stashed (else each unit's prefix is copied out of the cache).
    reads_cache = True
    # The executor reads the stash before branching on the segment, and `backward`'s
    # `saved` is the values; else it is the unit's `units.Stash` slot.
    read_before_branching = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        Strategy.by_name[cls.__name__] = cls

    @classmethod
    def of(cls, spec, units) -> "Strategy":
        """This strategy for `spec`, whose segments' units are `units`."""
        return cls()

    def forward(self, unit, inputs, stash):
        """((y padded to Lseg, K, V), what the backward needs) of `unit` on `inputs`. With
        `stash` (a `units.Stash`: the executor's slot) what the backward needs is written
        there and the updated `Stash` takes its place; without (a unit run alone), the
        values."""
        raise NotImplementedError

    def backward(self, unit, inputs, saved, cotangents, into, grads):
        """(outputs recomputed or None, (d chunk, d shared, dx, dK prefix, dV prefix[, what
        W reads])) from what the forward saved and the cotangents (dy, dK, dV) of the
        body's outputs. With `into` (a `kv_cache.Cotangents`) the prefix's dK, dV are
        added to it, which takes their place; with `grads` (a `units.LayerGrads`) so is d
        chunk."""
        raise NotImplementedError

    def saved_avals(self, unit, rows: int, first=None, depth: bool = False) -> tuple:
        """The abstract values one forward keeps (one stash slot)."""
        raise NotImplementedError

    def slot_counts(self, program) -> tuple[int, ...]:
        """Slots of each stash (`group`) in the executor's carry."""
        return (program.num_stash,)

    def group(self, seg: int) -> int:
        """The stash segment `seg`'s saved values go to."""
        return 0


def named(name: str) -> type[Strategy]:
    """The strategy class a `remat.POLICIES` row names."""
    if name not in Strategy.by_name:
        raise ValueError(f"no remat strategy {name!r}; there are {', '.join(Strategy.by_name)}")
    return Strategy.by_name[name]


class RecomputeInput(Strategy):
    """Keep the unit's input (one message, [b, Lseg, D]); the backward re-runs the body
    under `jax.vjp`. Every segment's input has the same padded shape, so all share one
    stash."""

    # Every backward reads one message from the one stash: read before branching, XLA
    # needs no copy of it per branch.
    read_before_branching = True

    def forward(self, unit, inputs, stash):
        saved = (inputs.x_in,)
        return unit.run(inputs), saved if stash is None else stash.put(saved)

    def backward(self, unit, inputs, saved, cotangents, into, grads):
        (x_in,) = saved
        outputs, pullback = unit.vjp(inputs.replace(x_in=x_in))
        d_chunk, *rest = _added(unit.pull(pullback, cotangents), into)
        return outputs, (d_chunk if grads is None else grads.add(d_chunk), *rest)

    def saved_avals(self, unit, rows: int, first=None, depth: bool = False) -> tuple:
        return (unit.avals(rows)[2],)


class LayerwiseRecompute(RecomputeInput):
    """Keep the unit's input, as `RecomputeInput`; the backward re-runs the chunk keeping
    each layer's input, then runs the layers' backwards last first, each layer's forward
    recomputed under its own vjp, and adds each layer's prefix dK/dV into the cotangent
    cache as it goes: no cotangent of the whole chunk's prefix ([n, b, P, H, E], as long
    as the context) is ever made."""

    def backward(self, unit, inputs, saved, cotangents, into, grads):
        (x_in,) = saved
        index = jnp.arange(unit.n)
        x0, start_vjp = jax.vjp(unit.start(inputs), inputs.shared, x_in)
        # The prefix arrays when there is no cache (a unit measured alone); else sinks.
        prefix = (None, None) if inputs.cache is not None else (inputs.k_prefix, inputs.v_prefix)
        y, (layer_in, k, v) = jax.lax.scan(
            lambda x, per: _layer_forward(unit, inputs, x, *per), x0, (index, inputs.chunk, *prefix)
        )
        outputs = (unit.padded(y), k, v)
        per_layer = (index, inputs.chunk, layer_in, *prefix, *cotangents[1:])
        # Each layer's gradients go into the accumulator at the layer, in place: stacked
        # as the scan's output, the chunk's gradients would be a second copy of it.
        acc = unit.grads_of(grads, inputs.chunk)
        (dx0, into, acc), (pack, dk, dv) = jax.lax.scan(
            lambda carry, per: _layer_backward(unit, inputs, *carry, *per),
            (cotangents[0][:, : unit.spec.local_length(unit.seg)], into, acc),
            per_layer,
            reverse=True,
        )
        d_shared, dx = start_vjp(dx0)
        kept = (into,) if into is not None else (dk, dv)
        d_chunk = acc if grads is not None else acc.of_chunk()
        return outputs, (d_chunk, d_shared, dx, *kept, *((pack,) if unit.split else ()))


def _layer_run(unit, inputs, i):
    """Layer i of the chunk, (p, x, K prefix, V prefix[, taps]) -> its outputs, reading
    the prefix from the cache when there is one (`LayerwiseRecompute`)."""
    spec, cache = unit.spec, inputs.cache

    def run(p, x, k_prefix, v_prefix, taps=None):
        at = None if cache is None else cache.at_layer(i)
        offset = spec.offsets[unit.seg]
        return model.layer(
            p, x, k_prefix, v_prefix, offset, spec.cfg, taps, at, unit.segment_layout
        )

    return run


def _layer_prefix(unit, inputs, rows, k_prefix, v_prefix):
    """One layer's prefix: zero sinks for its cotangents when it lies in the cache."""
    return (k_prefix, v_prefix) if inputs.cache is None else unit.sinks(rows)


def _layer_forward(unit, inputs, x, i, p, k_prefix=None, v_prefix=None):
    """One step of `LayerwiseRecompute`'s re-run: (y, (x, K, V))."""

    def live(i, p, x, k_prefix, v_prefix):
        return _layer_run(unit, inputs, i)(p, x, k_prefix, v_prefix)[:3]

    args = (i, p, x, *_layer_prefix(unit, inputs, x.shape[0], k_prefix, v_prefix))
    y, k, v = _alive(inputs.depth, i, live, _passed(live), *args)
    return y, (x, k, v)


def _layer_backward(unit, inputs, dx, into, acc, *per):
    """One step of `LayerwiseRecompute`'s backward, last layer first: ((dx, into, acc),
    (what W reads, dK prefix, dV prefix)), the layer's parameter gradients added into
    `acc` (a `units.LayerGrads`) and the prefix's into `into` when given."""
    # As jax.checkpoint does: XLA must not merge this forward with the one above (it
    # would, in a one-layer chunk, whose loops it unrolls).
    i, p, x, k_prefix, v_prefix, dk, dv = jax.lax.optimization_barrier(per)

    def layer_vjp(i, p, x, k_prefix, v_prefix, d_out):
        _, pullback = unit.layer_vjp(_layer_run(unit, inputs, i), p, x, k_prefix, v_prefix)
        return unit.pull_layer(pullback, d_out)

    prefix = _layer_prefix(unit, inputs, x.shape[0], k_prefix, v_prefix)
    args = (i, p, x, *prefix, (dx, dk, dv))
    d_p, dx, dkp, dvp, pack = _alive(inputs.depth, i, layer_vjp, _passed(layer_vjp, at=1), *args)
    acc = acc.add_layer(i, d_p)
    if into is None:
        return (dx, into, acc), (pack, dkp, dvp)
    return (dx, into.add_layer(i, dkp, dvp), acc), (pack, None, None)


class KeepLayerResiduals(Strategy):
    """Keep each layer's vjp residuals (what the per-layer checkpoint policy leaves), less
    what the backward re-reads (the layer's parameters and its K/V prefix, which lives in
    the KV cache), written into the stash slot a layer at a time as the forward runs; the
    backward reads them back a layer at a time and adds each layer's parameter gradients
    and prefix dK/dV where they lie. Under a vjp of the whole chunk, its layer scan
    stacked every layer's residuals in a buffer of its own, which the executor copied
    into the slot, and the backward copied the slot out whole and stacked every layer's
    gradients before adding them up (gpt_1b seq1f1b M=8 K=4 `pallas_gpu` on an H200, by
    `seqpipe.tools.step_cost`: 4.06 TB a step that way, 3.11 this way).

    Segments whose layers keep the same shapes (equal segments, attention that keeps
    nothing prefix-shaped) share one stash, as the input stash is shared: the schedule's
    stash slots, fewer in all than a pool per segment."""

    keeps_residuals = True

    def __init__(self, shared: bool = False):
        self.shared = shared

    @classmethod
    def of(cls, spec, units) -> "KeepLayerResiduals":
        key = (
            spec.cfg,
            spec.remat,
            spec.lengths,
            spec.context,
            spec.chunk_layers,
            spec.schedule.split,
        )
        key += (spec.uneven, jax.sharding.get_abstract_mesh(), spec.documents, spec.positions)
        if key not in _SHARED:
            _SHARED[key] = len({u.layer_layout(1).stored for u in units}) == 1
        return cls(shared=_SHARED[key])

    @property
    def slot_fields(self) -> tuple[str, str]:
        return ("fwd_stash", "bwd_stash") if self.shared else ("fwd_res", "bwd_res")

    def slot_counts(self, program) -> tuple[int, ...]:
        return (program.num_stash,) if self.shared else program.num_res

    def group(self, seg: int) -> int:
        return 0 if self.shared else seg

    def saved_avals(self, unit, rows: int, first=None, depth: bool = False) -> tuple:
        """Each kept leaf of a layer, for the chunk's n layers: [n, ...]."""
        sds = jax.ShapeDtypeStruct
        return tuple(sds((unit.n, *a.shape), a.dtype) for a in unit.layer_layout(rows).stored)

    def forward(self, unit, inputs, stash):
        """The body a layer at a time, each layer's residuals written into the stash at
        the layer as it runs. A unit run alone puts its prefix arrays in a cache of one
        slot first (`UnitInputs.prefix_cache`), so that its layers run as in the executor."""
        rows = inputs.x_in.shape[0]
        own = unit.stash_of(stash, rows)
        cache = inputs.prefix_cache()
        layout = unit.layer_layout(rows, cache)
        x0 = unit.start(inputs)(inputs.shared, inputs.x_in)

        def live(i, p, x, words_k, words_v, slot):
            prefix = unit.layer_prefix(rows, kv_cache.Prefix(words_k, words_v, slot, i))
            (y, k, v), pullback = unit.kept_layer_vjp(p, x, *prefix)
            kept = layout.take(pullback, (p, *prefix, unit.packing), f"segment {unit.seg}")
            return y, k, v, kept

        def step(carry, per):
            x, own = carry
            i, p = per
            args = (i, p, x, cache.words_k, cache.words_v, cache.slot)
            y, k, v, kept = _alive(inputs.depth, i, live, _passed(live), *args)
            return (y, own.put_layer(i, kept)), (k, v)

        index = jnp.arange(unit.n)
        (y, own), (k, v) = jax.lax.scan(step, (x0, own), (index, inputs.chunk))
        outputs = (unit.padded(y), k, v)
        return outputs, own if stash is not None else tuple(own.get(unit.saved_avals(rows)))

    def backward(self, unit, inputs, saved, cotangents, into, grads):
        """Last layer first, each layer's vjp is rebuilt from its residuals in the stash
        and pulls dx back; its parameter gradients go into `grads` and its prefix dK/dV
        into `into` at once (without it, stacked and returned)."""
        spec, cfg = unit.spec, unit.spec.cfg
        dy, dk_own, dv_own = cotangents
        rows = dy.shape[0]
        own = unit.stash_of(saved, rows)
        acc = unit.grads_of(grads, inputs.chunk)
        cache = inputs.prefix_cache()
        layout = unit.layer_layout(rows, cache)

        def pull(i, p, leaves, d_out):
            prefix = unit.layer_prefix(rows, cache.at_layer(i))
            pullback = layout.rebuild(leaves, (p, *prefix, unit.packing))
            return unit.pull_layer(pullback, d_out)

        def step(carry, per):
            dx, into, acc = carry
            i, p, dk, dv = per
            args = (i, p, own.get_layer(i, layout.stored), (dx, dk, dv))
            d_p, dx, dk_prefix, dv_prefix, pack = _alive(
                inputs.depth, i, pull, _passed(pull, at=1), *args
            )
            acc = acc.add_layer(i, d_p)
            if into is None:
                return (dx, into, acc), (pack, dk_prefix, dv_prefix)
            return (dx, into.add_layer(i, dk_prefix, dv_prefix), acc), (pack, None, None)

        per_layer = (jnp.arange(unit.n), inputs.chunk, dk_own, dv_own)
        (dx0, into, acc), (pack, dk, dv) = jax.lax.scan(
            step, (dy[:, : spec.local_length(unit.seg)], into, acc), per_layer, reverse=True
        )
        x_in = jnp.zeros((rows, spec.msg_len, cfg.d_model), cfg.dtype)  # unread: linear
        _, start_vjp = jax.vjp(unit.start(inputs), inputs.shared, x_in)
        d_shared, dx = start_vjp(dx0)
        kept = (into,) if into is not None else (dk, dv)
        d_chunk = acc if grads is not None else acc.of_chunk()
        return None, (d_chunk, d_shared, dx, *kept, *((pack,) if unit.split else ()))


_SHARED: dict = {}  # what `KeepLayerResiduals.of` depends on -> whether segments share a stash


def _added(grads: tuple, into) -> tuple:
    """A backward's (d chunk, d shared, dx, dK prefix, dV prefix, ...), the prefix's
    cotangents added into `into` (a `kv_cache.Cotangents`) in their place when given."""
    if into is None:
        return grads
    d_chunk, d_shared, dx, dk, dv, *pack = grads
    return (d_chunk, d_shared, dx, into.add_chunk(dk, dv), *pack)


def _alive(depth, i, live, dead, *args):
    """live(*args) for layer i; past a run-time `depth` the layer is padding
    (`model.layers`), and `dead` gives its outputs."""
    return live(*args) if depth is None else jax.lax.cond(i < depth, live, dead, *args)


def _passed(fn, at: int = 0):
    """What `fn` gives for a padding layer (past `depth`): its input x (argument 2, or the
    cotangent dx of a backward) passed through as output `at`, zeros elsewhere."""

    def passed(*args):
        out = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, *args))
        x = args[2] if at == 0 else args[-1][0]
        return (*out[:at], x, *out[at + 1 :])

    return passed
