"""Schedule tables: the registry of generators, the table types, generation and validation.

Pure Python/NumPy; nothing here knows about the model."""

from __future__ import annotations

import dataclasses
import enum
import functools

import numpy as np

DEPTHS = ("minimal", "full")


class ScheduleError(ValueError):
    """Raised, with a one-line message, for bad arguments or an invalid table."""


# --------------------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class Generator:
    """What distinguishes one schedule's generator from another's."""

    name: str
    # What an in-flight item (and an integer `inflight`) counts: whole micro-batches
    # ('microbatch', the 1F1B family) or segments ('segment', Seq1F1B).
    granularity: str
    interleaved: bool  # takes virtual > 1: Megatron's rounds of chunks
    forwards_first: bool  # GPipe: a stage starts its backwards after all its forwards
    # Zero bubble: the unsplit schedule whose table this one refines, backwards split into
    # B and W, W filling the bubbles at that schedule's stage-0 peak ("" if none).
    split_of: str = ""

    @property
    def split(self) -> bool:
        return bool(self.split_of)


GENERATORS: dict[str, Generator] = {
    g.name: g
    for g in (
        Generator("gpipe", "microbatch", interleaved=False, forwards_first=True),
        Generator("1f1b", "microbatch", interleaved=False, forwards_first=False),
        Generator("seq1f1b", "segment", interleaved=False, forwards_first=False),
        Generator("interleaved_1f1b", "microbatch", interleaved=True, forwards_first=False),
        Generator("seq1f1b_interleaved", "segment", interleaved=True, forwards_first=False),
        Generator("zb_h1", "microbatch", interleaved=False, forwards_first=False, split_of="1f1b"),
        Generator("seq_zb_h1", "segment", False, False, split_of="seq1f1b"),
    )
}
SCHEDULES = tuple(GENERATORS)
INTERLEAVED = tuple(n for n, g in GENERATORS.items() if g.interleaved)


def generator(name: str) -> Generator:
    """The registry entry of `name`; ScheduleError if there is none."""
    if name not in GENERATORS:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return GENERATORS[name]


# --------------------------------------------------------------------------- tables


class Kind(enum.StrEnum):
    F = "F"  # forward
    B = "B"  # backward (with a W in the table: its input-gradient half only)
    W = "W"  # weight-gradient half of a backward


F, B, W = Kind.F, Kind.B, Kind.W
KINDS = (F, B, W)  # the order a stage runs a cell's operations in
NAMES = {F: "forward", B: "backward", W: "weight"}  # also the JSON keys


@dataclasses.dataclass(frozen=True)
class Unit:
    mb: int  # micro-batch 0..M-1
    seg: int  # segment 0..K-1
    chunk: int  # local chunk 0..V-1 on its stage; global chunk = chunk * S + stage


@dataclasses.dataclass(frozen=True)
class Op:
    kind: Kind
    unit: Unit


Cell = tuple[Op, ...]  # what a stage runs in a tick: at most one Op per kind, in KINDS order


def make_cell(
    forward: Unit | None = None, backward: Unit | None = None, weight: Unit | None = None
) -> Cell:
    """The cell running these units (None: no operation of that kind)."""
    units = (forward, backward, weight)
    return tuple(Op(k, u) for k, u in zip(KINDS, units, strict=True) if u is not None)


def cell_unit(cell: Cell, kind: Kind) -> Unit | None:
    """The unit of the cell's `kind` operation, or None."""
    return next((op.unit for op in cell if op.kind == kind), None)


def has_weight_ops(s: Schedule) -> bool:
    """Whether the table splits backwards into B and W."""
    return any(op.kind == W for row in s.ticks for cell in row for op in cell)


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str
    stages: int
    microbatches: int
    segments: int
    virtual: int
    inflight: str | int
    ticks: tuple[tuple[Cell, ...], ...]  # ticks[t][stage]
    forward_only: bool = False  # an evaluation's table (`forward_only`): no backwards

    @functools.cached_property
    def split(self) -> bool:
        """Whether backwards are split into B and W (`has_weight_ops`)."""
        return has_weight_ops(self)


# --------------------------------------------------------------------------- generation


def _check_args(name, stages, microbatches, segments, virtual, inflight) -> None:
    gen = generator(name)
    for label, value in (
        ("stages", stages),
        ("microbatches", microbatches),
        ("segments", segments),
        ("virtual", virtual),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{label} must be an integer >= 1, got {value!r}")
    if virtual > 1 and not gen.interleaved:
        raise ScheduleError(f"schedule {name!r} takes virtual=1; use one of {INTERLEAVED}")
    if virtual > 1 and microbatches % stages:
        raise ScheduleError(
            f"virtual={virtual} needs microbatches ({microbatches}) to be a multiple of "
            f"stages ({stages})"
        )
    if isinstance(inflight, bool) or not (
        inflight in DEPTHS or (isinstance(inflight, int) and inflight >= 1)
    ):
        raise ScheduleError(
            f"inflight must be 'minimal', 'full' or an integer >= 1, got {inflight!r}"
        )


def _granularity(name: str, segments: int) -> int:
    """Units per in-flight item: whole micro-batches for the 1F1B family, segments for Seq1F1B."""
    return 1 if GENERATORS[name].granularity == "segment" else segments


def _rounds(name: str, stages: int, microbatches: int, segments: int) -> list[int]:
    """Micro-batches per chunk round of the interleaved forward order.

    Megatron sends S micro-batches through one chunk before the next. Seq1F1B-I treats
    segments as micro-batches, so a round needs only ceil(S/K) micro-batches (S or more
    segments keep the ring busy); it holds whole micro-batches, or a backward would be
    ordered before a later segment of its own micro-batch. The remainder is spread over
    the rounds, since a short round would stall the chunk hand-over.
    """
    segment = GENERATORS[name].granularity == "segment"
    per = -(-stages // segments) if segment else stages
    count = max(1, microbatches // per)
    base, extra = divmod(microbatches, count)
    return [base + (i < extra) for i in range(count)]


def _caps(name, stages, microbatches, segments, virtual, inflight) -> list[int]:
    """Most units a stage may hold between a forward and its backward, per stage."""
    total = microbatches * segments * virtual
    if GENERATORS[name].forwards_first:
        return [total] * stages
    unit = _granularity(name, segments)
    rounds = (virtual - 1) * max(_rounds(name, stages, microbatches, segments)) * segments
    # The first backward in order needs every forward before it in order: (V-1) rounds
    # plus one micro-batch's K segments. Less would deadlock.
    need = rounds + segments
    caps = []
    for r in range(stages):
        if inflight == "minimal" and virtual == 1:
            # Megatron / reference warm-up (S-r-1 items) plus the steady-state forward.
            cap = (stages - r) * unit + segments - unit
        elif inflight in DEPTHS:
            # A round trip from stage r to the last stage and back takes 2*(S-r-1) ticks;
            # Megatron's interleaved warm-up already counts it, so minimal == full there.
            cap = rounds + 2 * (stages - r - 1) * unit + segments
        else:
            cap = inflight * unit
            if cap < need:
                raise ScheduleError(
                    f"inflight={inflight} is too small for {name} with S={stages}, "
                    f"K={segments}, V={virtual}: it needs at least {-(-need // unit)}"
                )
        caps.append(min(max(cap, need), total))
    return caps


def _orders(name, stages, microbatches, segments, virtual) -> tuple[list[Unit], list[Unit]]:
    """Forward and backward op orders (the same on every stage)."""
    sizes = [microbatches] if virtual == 1 else _rounds(name, stages, microbatches, segments)
    fwd, bwd, first = [], [], 0
    for size in sizes:
        mbs = range(first, first + size)
        for c in range(virtual):
            fwd += [Unit(m, k, c) for m in mbs for k in range(segments)]
        # Backward: chunks descending, micro-batches FIFO, segments descending inside one.
        for c in reversed(range(virtual)):
            bwd += [Unit(m, k, c) for m in mbs for k in reversed(range(segments))]
        first += size
    return fwd, bwd


def build(
    name: str,
    stages: int,
    microbatches: int,
    segments: int = 1,
    virtual: int = 1,
    inflight: str | int = "full",
) -> Schedule:
    """Generate and pack a schedule into synchronous ticks.

    Each stage walks its forward order and its backward order and issues the next op
    of each in the earliest tick where its dependencies hold, a forward only while the
    stage holds fewer than its cap of units in flight. `inflight` sets the cap: an
    integer (in micro-batches for the 1F1B family and GPipe, segments for Seq1F1B),
    'minimal' (the reference warm-up plus one) or 'full' (2*(S-r-1)+K on stage r, one
    round trip of units, which keeps every tick busy). Packing is earliest-tick greedy,
    so unit costs do not change it. A split schedule (zero bubble) also places each
    backward's W (`_place_weights`) and holds a unit until its W.
    """
    _check_args(name, stages, microbatches, segments, virtual, inflight)
    gen = GENERATORS[name]
    S, K, V = stages, segments, virtual
    caps = _caps(name, S, microbatches, K, V, inflight)
    if gen.split:
        # ZB-H1: every stage may hold what the unsplit schedule's stage 0 holds at its
        # peak, so the peak stays that schedule's; later stages use theirs to delay W's.
        plain = build(gen.split_of, S, microbatches, K, V, inflight)
        caps = [_peak_held(plain, 0)] * S
    fwd_order, bwd_order = _orders(name, S, microbatches, K, V)
    f_tick = np.full((S, microbatches, K, V), -1, dtype=np.int64)
    b_tick = np.full((S, microbatches, K, V), -1, dtype=np.int64)
    f_next, b_next, held = [0] * S, [0] * S, [0] * S
    pending: list[list[Unit]] = [[] for _ in range(S)]  # backwards whose W has not run
    n_units = len(fwd_order)
    ticks: list[tuple[Cell, ...]] = []
    while min(b_next) < n_units or any(pending):
        t = len(ticks)
        fb = []
        for r in range(S):
            f = b = None
            if f_next[r] < n_units and held[r] < caps[r]:
                u = fwd_order[f_next[r]]
                g = u.chunk * S + r
                src = f_tick[(r - 1) % S, u.mb, u.seg, u.chunk - (r == 0)] if g else 0
                if 0 <= src < t or g == 0:
                    f, f_next[r], held[r] = u, f_next[r] + 1, held[r] + 1
                    f_tick[r, u.mb, u.seg, u.chunk] = t
            # GPipe: a stage starts its backwards once all its forwards have run.
            if b_next[r] < n_units and (not gen.forwards_first or f_next[r] == n_units):
                u = bwd_order[b_next[r]]
                g = u.chunk * S + r
                own = f_tick[r, u.mb, u.seg, u.chunk]
                if g == V * S - 1:
                    ready = own >= 0
                else:
                    src = b_tick[(r + 1) % S, u.mb, u.seg, u.chunk + (r == S - 1)]
                    ready = 0 <= src < t and own >= 0
                if ready:
                    b, b_next[r] = u, b_next[r] + 1
                    b_tick[r, u.mb, u.seg, u.chunk] = t
            fb.append((f, b))
        if gen.split:
            for r, (_, b) in enumerate(fb):
                pending[r] += [b] if b is not None else []
            weights = _place_weights(fb, pending, held, caps, f_next, b_next, n_units)
        else:
            weights = [None] * S
        row = tuple(make_cell(f, b, w) for (f, b), w in zip(fb, weights, strict=True))
        if not any(row):
            raise ScheduleError(f"{name} deadlocks with caps {caps} (S={S}, K={K}, V={V})")
        for r, cell in enumerate(row):
            held[r] -= cell_unit(cell, W if gen.split else B) is not None
        ticks.append(row)
    return Schedule(name, S, microbatches, K, V, inflight, tuple(ticks))


def _peak_held(s: Schedule, stage: int) -> int:
    """The most units `stage` holds between a forward and its backward (W if split)."""
    free, held, peak = W if has_weight_ops(s) else B, 0, 0
    for row in s.ticks:
        held += cell_unit(row[stage], F) is not None
        peak = max(peak, held)
        held -= cell_unit(row[stage], free) is not None
    return peak


def _place_weights(fb, pending, held, caps, f_next, b_next, n_units) -> list[Unit | None]:
    """This tick's W per stage (popped from `pending`, oldest first), under F = B = W = 1.

    A W must run where a stage would otherwise stop: it holds its cap and still has
    forwards to issue (a W frees a unit), or it has nothing else left. Otherwise a W
    runs only where it fits in the tick for free, the tick lasting as long as its
    busiest stage; so W's fill the warm-up and cool-down bubbles.
    """
    S = len(fb)
    cost = [(f is not None) + (b is not None) for f, b in fb]
    out: list[Unit | None] = [None] * S
    for r in range(S):
        done = f_next[r] == n_units and b_next[r] == n_units and not cost[r]
        blocked = f_next[r] < n_units and held[r] >= caps[r]
        if pending[r] and (done or blocked):
            out[r] = pending[r].pop(0)
    tick = max(c + (w is not None) for c, w in zip(cost, out, strict=True))
    for r in range(S):
        if out[r] is None and pending[r] and cost[r] + 1 <= tick:
            out[r] = pending[r].pop(0)
    return out


def forward_only(s: Schedule) -> Schedule:
    """The forwards of `s` alone (evaluation): the same stages, units and forward order,
    each forward in the earliest tick its input and KV prefix allow. Nothing waits for a
    backward, so no cap applies; a micro-batch's K/V live until its last segment's forward.
    """
    S, V = s.stages, s.virtual
    order, _ = _orders(s.name, S, s.microbatches, s.segments, V)
    done: dict[tuple[int, Unit], int] = {}  # (stage, unit) -> tick
    ticks: list[tuple[Cell, ...]] = []
    nxt = [0] * S
    while min(nxt) < len(order):
        t, row = len(ticks), []
        for r in range(S):
            u = order[nxt[r]] if nxt[r] < len(order) else None
            if u is not None and u.chunk * S + r > 0:  # its input must have arrived
                src = done.get(((r - 1) % S, Unit(u.mb, u.seg, u.chunk - (r == 0))), t)
                u = u if src < t else None
            if u is not None:
                done[r, u], nxt[r] = t, nxt[r] + 1
            row.append(make_cell(u))
        ticks.append(tuple(row))
    name = f"{s.name} (forward only)"
    return dataclasses.replace(s, name=name, ticks=tuple(ticks), forward_only=True)


# --------------------------------------------------------------------------- validation


def _needs(kind: Kind, r: int, u: Unit, S: int, K: int, last: int) -> list[tuple]:
    """What must run before `kind` of `u` on stage r: (kind, stage, unit, same tick ok?, why).

    Same tick is fine only on the same stage and for an earlier kind (a cell runs F, B,
    W in order); a message from another stage arrives from the next tick.
    """
    m, k, c = u.mb, u.seg, u.chunk
    g = c * S + r
    out = []
    if kind == F:
        if g > 0:
            out.append((F, (r - 1) % S, Unit(m, k, c - (r == 0)), False, "runs before its input"))
        if k > 0:
            out.append((F, r, Unit(m, k - 1, c), False, "runs before its KV prefix"))
    elif kind == B:
        # The last global chunk's backward starts from the loss, in its forward's tick.
        out.append((F, r, u, g == last, "runs before its forward"))
        if g < last:
            nxt = Unit(m, k, c + (r == S - 1))
            out.append((B, (r + 1) % S, nxt, False, "runs before its cotangent"))
        if k < K - 1:
            why = f"precedes its K/V gradient (segment {k + 1})"
            out.append((B, r, Unit(m, k + 1, c), False, why))
    else:  # W reads what its own B computed (the output cotangent)
        out.append((B, r, u, True, "runs before its backward"))
    return out


def validate(s: Schedule) -> None:
    """Check the table against every rule, independently of the generators.

    Every F runs once per (stage, unit); every B too unless the table is forward-only,
    and every W if the table has any; each runs after what it needs (`_needs`). Raises
    ScheduleError naming the first violated rule.
    """
    S, M, K, V = s.stages, s.microbatches, s.segments, s.virtual
    last = V * S - 1
    at: dict[Kind, dict[tuple[int, Unit], int]] = {k: {} for k in KINDS}  # (stage, unit) -> tick
    for t, row in enumerate(s.ticks):
        if len(row) != S:
            raise ScheduleError(f"tick {t} has {len(row)} cells, expected one per stage ({S})")
        for r, cell in enumerate(row):
            ops = cell if isinstance(cell, tuple) else (None,)
            kinds = [getattr(op, "kind", None) for op in ops]
            if not all(isinstance(op, Op) for op in ops) or kinds != sorted(
                set(kinds), key=KINDS.index
            ):
                raise ScheduleError(
                    f"tick {t} stage {r}: a cell is a tuple of Op, at most one per kind, "
                    f"in the order F, B, W"
                )
            for op in cell:
                u, name = op.unit, NAMES[op.kind]
                if not (0 <= u.mb < M and 0 <= u.seg < K and 0 <= u.chunk < V):
                    raise ScheduleError(f"tick {t} stage {r}: {name} {u} is out of range")
                if (r, u) in at[op.kind]:
                    raise ScheduleError(f"tick {t} stage {r}: {name} {u} runs twice")
                at[op.kind][r, u] = t
    if s.forward_only and (at[B] or at[W]):
        raise ScheduleError(f"{s.name}: a forward-only table has backward operations")
    # Every F runs; every B unless the table is an evaluation's; every W if any runs.
    required = [F] + ([] if s.forward_only else [B]) + ([W] if at[W] else [])
    for kind in required:
        if len(at[kind]) != S * M * K * V:
            missing = next(
                (r, Unit(m, k, c))
                for r in range(S)
                for m in range(M)
                for k in range(K)
                for c in range(V)
                if (r, Unit(m, k, c)) not in at[kind]
            )
            raise ScheduleError(f"stage {missing[0]}: {NAMES[kind]} {missing[1]} never runs")
    for kind in KINDS:
        for (r, u), t in at[kind].items():
            for dep, stage, v, same_tick, why in _needs(kind, r, u, S, K, last):
                before = at[dep][stage, v]
                if before > t or (before == t and not same_tick):
                    raise ScheduleError(f"stage {r}: {NAMES[kind]} {u} at tick {t} {why}")
