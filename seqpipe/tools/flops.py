"""FLOPs of a pipelined step: what the algorithm needs against what XLA executes.

    analytic   per layer and segment (s tokens after an offset o, b rows):
                 dense 2*b*s*(4*D*D + 2*D*F); attention QK and PV each 2*b*s*(o+s)*D
                 (the queries times their own causal key range, prefix plus itself);
                 the head 2*b*s*D*V on the last chunk. Backward = 2 x forward.
    executed   XLA `cost_analysis()["flops"]` of each forward unit and each backward unit
               (as the executor runs them: the body, and on the last chunk the head with
               its backward, forward; the body's vjp, backward), compiled on its
               units in the schedule table.

Two XLA counting rules shape the method. A while loop's body is counted once whatever
its trip count, so neither the scanned step nor a unit's scan over its n layers can be
read directly: each unit is compiled for a one-layer chunk (no loop), and the other n-1
layers are added as n-1 copies of a middle-chunk one-layer unit (no embedding, no head).
`check_layer_scan` shows the rule and checks the correction against an unrolled chunk.
A `lax.cond` counts its costliest branch; the unit's first/last-chunk switches are
compiled as constants, so XLA folds them to the branch that runs on that chunk.

With mesh.context = C > 1 (`seqpipe.parallel.context`) a unit runs one context device's
positions: it is compiled on C devices (its all-gathers bound), XLA counts what one of
them executes, and the step's executed count is C times that (the zigzag split gives
every device the same work; the device's `lax.switch` branches are equal). Likewise
with mesh.tensor = T: T devices, each its share of the matmuls. The analytic
count is the sequence's (`spec.sequence_lengths`). Under `xla` attention each device's two
pieces compute their own square, smaller than the segment's: executed attention is
below the analytic one, which counts the segment's whole square.

The head's backward runs in the last chunk's forward (the loss's cotangent is the constant
1), so no policy recomputes the head. With full rematerialisation (`pipeline.remat=full`)
the backward re-runs the body, so executed / analytic is (4 x layers + 3 x head) / (3 x
all), a little under 4/3, plus what XLA counts beyond the matmuls (softmax, norms, RoPE,
GELU, residual adds, the loss, the embedding's scatter-add); `layer` recomputes the
layers one at a time. Under `none` and `dots` the forward stashes its vjp's residuals
(`dots`: the matmul outputs, the element-wise work recomputed) and the backward unit
rebuilds the vjp from them, so the ratio is 1 plus that element-wise work. `breakdown`
splits the executed count from the jaxpr: matmul FLOPs exactly (2 per multiply-add), the
rest per source function.
"""

from __future__ import annotations

import collections
import functools
import gc
import math

import jax
import jax.extend

from seqpipe import schedule
from seqpipe.kernels import attention
from seqpipe.models import model
from seqpipe.models.model import GPTConfig
from seqpipe.parallel import sharding
from seqpipe.pipeline import units

# --------------------------------------------------------------------------- analytic


def analytic_forward(cfg: GPTConfig, lengths, rows: int) -> dict:
    """Forward FLOPs of one micro-batch of `rows` sequences cut into `lengths` segments."""
    d, v, n = cfg.d_model, cfg.vocab_size, cfg.num_layers
    dense = attention = 0
    offset = 0
    for s in lengths:
        dense += 2 * rows * s * model.layer_matmul_params(cfg) * n
        attention += 2 * (2 * rows * s * (offset + s) * cfg.q_width) * n
        offset += s
    head = 2 * rows * sum(lengths) * d * v
    return {
        "dense": dense,
        "attention": attention,
        "head": head,
        "forward": dense + attention + head,
    }


def analytic_step(spec, rows: int, replicas: int = 1) -> int:
    """Forward plus backward (2x) FLOPs of a whole step: M micro-batches per replica, of
    the sequence's segments (whatever devices split their positions)."""
    per_mb = analytic_forward(spec.cfg, spec.sequence_lengths, rows)["forward"]
    return 3 * per_mb * spec.schedule.microbatches * replicas


def padded_attention_excess(cfg: GPTConfig, lengths, rows: int) -> int:
    """Forward attention FLOPs a padded implementation would add per micro-batch: every
    segment's queries against all L keys (masked) instead of their prefix plus themselves."""
    seq, offset, extra = sum(lengths), 0, 0
    for s in lengths:
        extra += 2 * (2 * rows * s * (seq - offset - s) * cfg.d_model) * cfg.num_layers
        offset += s
    return extra


# --------------------------------------------------------------------------- executed


# A unit's kind, as `unit_functions` indexes its functions: forward, backward (B of a split
# table), weight (W); a bool `backward` reads as the first two.
KIND_INDEX = {schedule.F: 0, schedule.B: 1, schedule.W: 2}
KIND_LABELS = ("fwd", "bwd", "wgt")


def unit_functions(spec, seg: int, first: bool, last: bool, rows: int = 1, n: int = 1):
    """(forward, backward, weight) of one unit as the executor runs it (`units.SegmentUnit`), the
    chunk flags fixed, for a chunk of n layers.

    forward(p, shared, x, k, v, tokens, targets) runs the body and, on the last chunk, the
    head with its backward; it returns those outputs and what the unit saves for its
    backward (its input under `full` remat, else the body's residuals).
    backward(saved, p, shared, k, v, tokens, dy, dk_seg, dv_seg) rebuilds or recomputes
    the body's vjp and pulls the cotangents through; see `unit_args`.
    weight(pack) is a split table's W: the weight matmuls' gradients from what B left.
    """
    unit = units.SegmentUnit(spec, seg, n)

    def forward(p, sh, x, k, v, tokens, targets):
        outputs, saved = unit.forward(units.UnitInputs(p, sh, x, k, v, tokens, first))
        if last:
            outputs = (outputs, unit.head(sh, outputs[0], targets))
        return outputs, saved

    def backward(saved, p, sh, k, v, tokens, dy, dk, dv, keep_outputs=False):
        inputs = units.UnitInputs(p, sh, None, k, v, tokens, first)
        return unit.backward(inputs, saved, (dy, dk, dv), keep_outputs=keep_outputs)

    return forward, backward, unit.weight


def unit_args(spec, rows: int, seg: int, n: int, backward: bool, flags=(False, False)) -> tuple:
    """Abstract arguments of `unit_functions(spec, seg, *flags, rows, n)[backward]`."""
    unit = units.SegmentUnit(spec, seg, n)
    if backward == 2:  # W: what its B left
        return (unit.weight_avals(rows),)
    p, sh, x, k, v, tokens, targets = unit.avals(rows)
    if not backward:
        return p, sh, x, k, v, tokens, targets
    own = unit.kv_avals(rows)
    return (unit.saved_avals(rows, flags[0]), p, sh, k, v, tokens, x, own, own)


def xla_flops(fn, args) -> float:
    """XLA's FLOP count of `fn` compiled for abstract `args` (while bodies counted once)."""
    return float(jax.jit(fn).lower(*args).compile().cost_analysis()["flops"])


_COMPILED: dict = {}


def unit_key(spec, rows: int, seg: int, first: bool, last: bool, backward: bool, keep: bool):
    """What a one-layer unit's program depends on; schedules sharing a segment shape share
    its compilation."""
    off, length = spec.offsets[seg], spec.lengths[seg]
    seg_max = max(spec.lengths)
    keep = keep and backward and not spec.policy.keeps_residuals
    split = spec.schedule.split  # a split table's backward is B alone
    # Under context parallelism a unit gathers every earlier segment's pieces: all of
    # their lengths shape it (`context.Split`).
    pieces = spec.lengths[: seg + 1] if spec.context > 1 else ()
    key = (spec.cfg, spec.remat, spec.context, pieces, split, off, length, seg_max, rows)
    return key + (first, last, backward, keep)  # `keep` last: `unit_program` reads it


def compiled_unit(
    spec, rows: int, seg: int, first: bool, last: bool, backward: bool, keep: bool = False
):
    """(compiled, abstract args) of the unit through a one-layer chunk. With `keep` the
    backward also returns the recomputed forward's outputs, so XLA cannot drop the layer's
    last matmul (whose output only the primal result uses): inside the layer scan it runs."""
    key = unit_key(spec, rows, seg, first, last, backward, keep)
    if key not in _COMPILED:
        fn, args = unit_program(spec, rows, seg, first, last, backward, keep)
        fn = sharding.bound(fn, spec.tensor, spec.context, jax.devices(), spec.cfg.expert_parallel)
        _COMPILED[key] = (jax.jit(fn).lower(*args).compile(), args)
    return _COMPILED[key]


def unit_program(
    spec, rows: int, seg: int, first: bool, last: bool, backward: bool, keep: bool = False
):
    """(function, abstract args) of the unit through a one-layer chunk, as
    `compiled_unit` compiles it."""
    fn = unit_functions(spec, seg, first, last, rows)[backward]
    if unit_key(spec, rows, seg, first, last, backward, keep)[-1]:
        fn = functools.partial(fn, keep_outputs=True)
    return fn, unit_args(spec, rows, seg, 1, backward, (first, last))


def needed_units(spec, rows: int, keep_all: bool = False) -> list[tuple]:
    """compiled_unit arguments (spec, rows, seg, first, last, backward, keep) of every
    one-layer unit that `unit_flops` reads for the table's units."""
    out = []
    for seg, first, last, backward, n in unit_counts(spec.schedule, spec.layers_per_chunk):
        for _, f, la, keep in chunk_terms(spec, seg, first, last, backward, n):
            out.append((spec, rows, seg, f, la, backward, keep or keep_all))
    return out


def precompile(units: list[tuple], workers: int) -> None:
    """Compile `needed_units` entries on `workers` threads (XLA releases the GIL)."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda a: compiled_unit(*a), distinct_units(units, _COMPILED)))


def distinct_units(units: list[tuple], done) -> list[tuple]:
    """`needed_units` entries, one per program (`unit_key`), less those keyed in `done`."""
    todo = {}
    for args in units:
        key = unit_key(*args)
        if key not in done:
            todo.setdefault(key, args)
    return list(todo.values())


def release() -> int:
    """Drop every compiled unit (and jax's own caches); returns how many units. Each live
    executable keeps its code mapped (hundreds of mappings a step, dozens a unit), and a
    process holding them all passes `vm.max_map_count` (65530 by default): LLVM then fails
    with "Cannot allocate memory" and XLA crashes. Call once their numbers are taken."""
    count = len(_COMPILED)
    _COMPILED.clear()
    jax.clear_caches()
    gc.collect()  # the executables go now, not at some later collection
    return count


def _one_layer_flops(spec, rows, seg, first, last, backward, keep=False) -> float:
    compiled, _ = compiled_unit(spec, rows, seg, first, last, backward, keep)
    return float(compiled.cost_analysis()["flops"])


def chunk_terms(
    spec, seg: int, first: bool, last: bool, backward: bool, n: int | None = None
) -> list:
    """[(count, first, last, keep)] one-layer units that add up to the unit of an n-layer
    chunk (default n: the deepest chunk's); see `unit_flops`. W (backward == 2) runs on
    every layer of the padded chunk, skipped ones included (its matmuls read zeros)."""
    n = n or spec.chunk_layers
    if backward == 2:  # W: the same per layer on every chunk (the embedding's is in B)
        return [(spec.chunk_layers, False, False, False)]
    if spec.chunk_layers == 1:  # no layer loop at all
        return [(1, first, last, False)]
    # Only a recomputed chunk forward carries each layer's output to the next (`keep`).
    keep = not spec.policy.keeps_residuals
    return [(1, first, last, keep)] + [(n - 1, False, False, keep)] * (n > 1)


def unit_flops(
    spec, rows: int, seg: int, first: bool, last: bool, backward: bool, n: int | None = None
) -> float:
    """XLA FLOPs of one unit through an n-layer chunk (default: the deepest chunk's; a
    shallower one skips its padding layers): the one-layer unit (with its embedding/head)
    plus n-1 middle one-layer units.

    With one layer there is no loop and XLA drops, in a backward, the recomputed
    forward's work that only feeds the discarded primal output (the last matmul of a
    middle chunk). With n > 1 the layers run as a while loop whose body cannot drop it,
    so every layer is counted with its outputs kept."""
    return sum(
        count * _one_layer_flops(spec, rows, seg, f, la, backward, keep)
        for count, f, la, keep in chunk_terms(spec, seg, first, last, backward, n)
    )


def unit_counts(sched, layers_per_chunk=None) -> collections.Counter:
    """How many units of each kind (seg, first chunk?, last chunk?, `KIND_INDEX`, the
    chunk's layers from `layers_per_chunk`, by global chunk, or None) the table runs."""
    S, last = sched.stages, sched.stages * sched.virtual - 1
    counts = collections.Counter()
    for row in sched.ticks:
        for r, cell in enumerate(row):
            for op in cell:
                g = op.unit.chunk * S + r
                n = None if layers_per_chunk is None else layers_per_chunk[g]
                counts[op.unit.seg, g == 0, g == last, KIND_INDEX[op.kind], n] += 1
    return counts


def executed_step(spec, rows: int, replicas: int = 1) -> dict:
    """Executed FLOPs of a step, per unit kind (`flops`: one device's) and in total (all
    replicas, and the context and tensor devices of each stage)."""
    kinds = {}
    total = 0.0
    counts = unit_counts(spec.schedule, spec.layers_per_chunk)
    devices = spec.context * spec.tensor  # a stage's, each running its share of a unit
    for (seg, first, last, backward, n), count in sorted(counts.items()):
        each = unit_flops(spec, rows, seg, first, last, backward, n)
        name = f"{KIND_LABELS[backward]} seg{seg}{' first' * first}{' last' * last}"
        kinds[name + (f" {n} layers" if spec.uneven else "")] = {
            "count": count * replicas * devices,
            "flops": each,
        }
        total += each * count * replicas * devices
    return {"units": kinds, "executed": total}


def step_ratio(spec, rows: int, replicas: int = 1) -> dict:
    """Executed over analytic FLOPs of a step, and what padding the keys would give."""
    ex = executed_step(spec, rows, replicas)
    analytic = analytic_step(spec, rows, replicas)
    # Padded keys: the extra attention, forward + backward (2x) + a recomputed forward
    # where the policy recomputes attention's matmuls.
    pad = padded_attention_excess(spec.cfg, spec.sequence_lengths, rows)
    pad *= spec.policy.matmul_passes * spec.schedule.microbatches * replicas
    return {
        "analytic": analytic,
        "executed": ex["executed"],
        "ratio": ex["executed"] / analytic,
        "padded_ratio": (ex["executed"] + pad) / analytic,
        "units": ex["units"],
    }


# --------------------------------------------------------------------------- checks


def check_layer_scan(spec, rows: int, seg: int = 0) -> dict:
    """XLA's count of a middle forward unit with an n-layer scan, with a Python-unrolled
    n-layer chunk, and the correction `unit_flops` applies (which should match unrolled)."""
    cfg, n = spec.cfg, max(2, spec.cfg.num_layers // (spec.stages * spec.virtual))
    off = spec.offsets[seg]
    fwd = unit_functions(spec, seg, False, False, rows, n)[0]
    args = unit_args(spec, rows, seg, n, backward=False)

    def unrolled(p, sh, x, k, v, tokens, targets):
        x = x[:, : spec.lengths[seg]]
        for i in range(n):
            x, _, _ = model.layer(jax.tree.map(lambda w, i=i: w[i], p), x, k[i], v[i], off, cfg)
        return x

    one = _one_layer_flops(spec, rows, seg, False, False, False)
    return {
        "scanned": xla_flops(fwd, args),
        "unrolled": xla_flops(unrolled, args),
        "corrected": n * one,
        "layers": n,
    }


# --------------------------------------------------------------------------- breakdown

_ELEMENTWISE_FREE = {
    # Layouts, barriers and bitcasts (the executor's row-major buffers, its storage
    # words) move or pin data; they compute nothing.
    "layout_constraint",
    "optimization_barrier",
    "bitcast_convert_type",
    "broadcast_in_dim",
    "reshape",
    "convert_element_type",
    "concatenate",
    "slice",
    "dynamic_slice",
    "dynamic_update_slice",
    "squeeze",
    "expand_dims",
    "transpose",
    "gather",
    "iota",
    "pad",
    "copy",
    "copy_p",
    "select_n",
    "stop_gradient",
    "pjit",
    "closed_call",
    "custom_jvp_call",
    "custom_vjp_call",
    "remat",
    "checkpoint",
    "scan",
    "cond",
    "split",
    "rev",
    # Collectives (context parallelism's K/V gathers and their transposes) move data.
    "all_gather",
    "reduce_scatter",
    "psum",
    "psum_invariant",
    "pvary",
    "axis_index",
    "shard_map",
}


def _where(eqn) -> str:
    """The seqpipe function an equation came from (its innermost seqpipe frame; the
    attention's and GELU's rules by their name scopes: autodiff gives them the caller's
    frames)."""
    scopes = str(eqn.source_info.name_stack)
    for scope in (attention.NAME_SCOPE, model.GELU_SCOPE):
        if scope in scopes:
            return scope
    tb = eqn.source_info.traceback
    for frame in tb.frames if tb is not None else ():
        if "/seqpipe/" in frame.file_name and "flops.py" not in frame.file_name:
            return frame.function_name
    return "other"


def _count(jaxpr, mult: float, out: collections.Counter) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            contract = math.prod(lhs[i] for i in lc)
            out["matmul"] += mult * 2 * math.prod(eqn.outvars[0].aval.shape) * contract
            continue
        if name == "ragged_dot_general":  # the experts: each row of lhs meets one group
            numbers = eqn.params["ragged_dot_dimension_numbers"]
            (_, rc), (_, rb) = numbers.dot_dimension_numbers
            rhs = eqn.invars[1].aval.shape
            skip = {*rc, *rb, *numbers.rhs_group_dimensions}
            width = math.prod(n for i, n in enumerate(rhs) if i not in skip)
            out["matmul"] += mult * 2 * math.prod(eqn.invars[0].aval.shape) * width
            continue
        if name == "scan":
            _count(eqn.params["jaxpr"].jaxpr, mult * eqn.params["length"], out)
            continue
        if name == "cond":
            index = eqn.invars[0]
            branches = eqn.params["branches"]
            if isinstance(index, jax.extend.core.Literal):
                _count(branches[int(index.val)].jaxpr, mult, out)
            else:  # the costliest branch, as XLA counts it
                counts = []
                for b in branches:
                    c = collections.Counter()
                    _count(b.jaxpr, mult, c)
                    counts.append(c)
                out.update(max(counts, key=lambda c: sum(c.values())))
            continue
        subs = [
            getattr(v, "jaxpr", v)
            for v in eqn.params.values()
            if hasattr(getattr(v, "jaxpr", v), "eqns")
        ]
        if subs:
            for sub in subs:
                _count(sub, mult, out)
            continue
        if name in _ELEMENTWISE_FREE:
            continue
        if name.startswith("reduce") or name in ("argmax", "argmin", "cumsum"):
            size = math.prod(eqn.invars[0].aval.shape)
        elif name in ("scatter-add", "scatter_add", "scatter"):
            size = math.prod(eqn.invars[2].aval.shape)
        else:
            size = max((math.prod(v.aval.shape) for v in eqn.outvars), default=0)
        out[_where(eqn)] += mult * size


def jaxpr_flops(fn, args) -> collections.Counter:
    """FLOPs from the jaxpr, scans multiplied by their length: `matmul` (2 per multiply-add)
    and one per element of every other arithmetic op, keyed by its seqpipe source function."""
    out = collections.Counter()
    _count(jax.make_jaxpr(fn)(*args).jaxpr, 1.0, out)
    return out


def breakdown(spec, rows: int, replicas: int = 1) -> dict:
    """The step's FLOPs by source, from each unit's jaxpr times the table's unit counts,
    as fractions of the analytic total (`matmul` alone: 4/3 of the layers' and 1 of the
    head's with full remat, 1 without recomputation)."""
    total = collections.Counter()
    counts = unit_counts(spec.schedule, spec.layers_per_chunk)
    for (seg, first, last, backward, n), count in counts.items():
        # W runs on the whole padded chunk (`chunk_terms`).
        n = spec.chunk_layers if backward == 2 else n or spec.chunk_layers
        fns = unit_functions(spec, seg, first, last, rows, n)
        fn = sharding.bound(fns[backward], spec.tensor, spec.context, data=spec.cfg.expert_parallel)
        c = jaxpr_flops(fn, unit_args(spec, rows, seg, n, backward, (first, last)))
        for k, v in c.items():
            total[k] += v * count * replicas * spec.context * spec.tensor  # each device's share
    analytic = analytic_step(spec, rows, replicas)
    named = collections.Counter()
    for k, v in total.items():
        named[_SOURCES.get(k.split(".")[0], k)] += v / analytic
    return dict(sorted(named.items(), key=lambda kv: -kv[1]))


# What each source function's non-matmul work is, for the breakdown's keys.
_SOURCES = {
    "segment_attention": "attention mask, scale, softmax",
    "layer": "residual adds",
    "gelu": "GELU",
    "rms_norm": "RMS norms",
    "rope": "RoPE",
    "token_loss_sum": "loss (logsumexp)",
    "_chunk_xent": "loss (logsumexp, its gradient)",
    "embed": "embedding scatter-add",
    "unit_body": "unit glue (padding, loss scale)",
    "head_loss": "unit glue (padding, loss scale)",
    "other": "other",
}
