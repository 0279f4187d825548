"""Pipeline schedules as data: generate, validate, lower to slot tables, measure, draw.

A schedule is a static table: for every synchronous tick and every stage, a cell of at
most one operation of each kind: F (forward), B (backward) and W (the weight-gradient
half of a split backward: `zb_h1`, `seq_zb_h1`). An operation acts on a unit
(micro-batch, segment, local chunk); the local chunk c of stage r holds global layer
chunk g = c*S + r. Within a tick a stage runs its F, then its B, then its W; then
results move one hop (forward outputs to stage (r+1) % S, input cotangents to stage
(r-1) % S) and can be used from the next tick.

Letters: S stages, M micro-batches, K segments per micro-batch, V chunks per stage.
Pure Python/NumPy; nothing here knows about the model.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import json
import os
import sys
from collections.abc import Mapping, Sequence

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


class Kind(str, enum.Enum):
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


# --------------------------------------------------------------------------- lowering


@dataclasses.dataclass(frozen=True)
class Program:
    """The table as int32 arrays of shape [T, S]; -1 means none. See `lower`."""

    fwd_mb: np.ndarray
    fwd_seg: np.ndarray
    fwd_chunk: np.ndarray
    fwd_in: np.ndarray  # recv_fwd slot with the input; -1: token embedding (global chunk 0)
    fwd_stash: np.ndarray  # stash slot that keeps the input for the backward
    fwd_kv: np.ndarray  # KV slot of (mb, chunk) on this stage
    bwd_mb: np.ndarray
    bwd_seg: np.ndarray
    bwd_chunk: np.ndarray
    bwd_in: np.ndarray  # recv_bwd slot with the output cotangent; -1: from the loss
    bwd_stash: np.ndarray  # stash slot to read (free from the next tick)
    bwd_kv: np.ndarray
    bwd_dkv: np.ndarray  # dK/dV accumulator slot of (mb, chunk): last segment's backward to seg 0's
    recv_fwd: np.ndarray  # slot storing what stage (s-1) % S sent during tick t
    recv_bwd: np.ndarray  # slot storing what stage (s+1) % S sent during tick t
    fwd_res: np.ndarray  # slot, among its segment's, keeping the forward's residuals
    bwd_res: np.ndarray  # the residual slot the backward reads
    fwd_head: np.ndarray  # slot keeping the head's residuals (last global chunk only)
    bwd_head: np.ndarray
    wgt_mb: np.ndarray  # the W operation (split tables only)
    wgt_seg: np.ndarray
    wgt_chunk: np.ndarray
    bwd_wgt: np.ndarray  # slot, among its segment's, where B leaves what its W reads
    wgt_in: np.ndarray  # the slot the W reads
    num_stash: int
    num_kv: int
    num_dkv: int
    num_recv_fwd: int
    num_recv_bwd: int
    num_res: tuple[int, ...]  # residual slots per segment (their shapes differ by segment)
    num_head: tuple[int, ...]  # head residual slots per segment: the last chunk's units only
    num_wgt: tuple[int, ...] = ()  # B-to-W slots per segment; all 0 unless the table splits


def _allocate(intervals: list[tuple[int, int, object]]) -> tuple[dict[object, int], int]:
    """Lowest-free slot for each [first, last] tick interval; returns (slot per key, count)."""
    free_at: list[int] = []  # free_at[slot]: first tick the slot is free again
    slot_of = {}
    for first, last, key in sorted(intervals, key=lambda x: x[:2]):
        slot = next((i for i, f in enumerate(free_at) if f <= first), len(free_at))
        if slot == len(free_at):
            free_at.append(0)
        free_at[slot] = last + 1
        slot_of[key] = slot
    return slot_of, len(free_at)


def lower(s: Schedule) -> Program:
    """Lower a valid table to per-tick slot indices for one SPMD executor.

    Slot lifetimes in ticks (inclusive): a stash slot from the forward to the backward;
    a KV slot from the segment-0 forward to the segment-0 backward of (mb, chunk); a
    message slot from the tick after it was sent to the tick that reads it (a slot read
    at tick t may take a message sent during t, since stores follow reads); a B-to-W slot
    (per segment) from a split backward's B to its W.
    """
    validate(s)
    S, V, T = s.stages, s.virtual, len(s.ticks)
    last = V * S - 1
    arr = {
        f: np.full((T, S), -1, dtype=np.int32)
        for f in (x.name for x in dataclasses.fields(Program))
        if not f.startswith("num_")
    }
    f_at, b_at, w_at = {}, {}, {}
    for t, row in enumerate(s.ticks):
        for r, cell in enumerate(row):
            f, b, w = cell_unit(cell, F), cell_unit(cell, B), cell_unit(cell, W)
            if w is not None:
                w_at[r, w] = t
                arr["wgt_mb"][t, r], arr["wgt_seg"][t, r] = w.mb, w.seg
                arr["wgt_chunk"][t, r] = w.chunk
            if f is not None:
                f_at[r, f] = t
                arr["fwd_mb"][t, r], arr["fwd_seg"][t, r], arr["fwd_chunk"][t, r] = (
                    f.mb,
                    f.seg,
                    f.chunk,
                )
            if b is not None:
                b_at[r, b] = t
                arr["bwd_mb"][t, r], arr["bwd_seg"][t, r], arr["bwd_chunk"][t, r] = (
                    b.mb,
                    b.seg,
                    b.chunk,
                )
    counts = {}
    num_res, num_head, num_wgt = [0] * s.segments, [0] * s.segments, [0] * s.segments
    forward_only = s.forward_only  # an evaluation: nothing is kept for a backward
    for r in range(S):
        stash, kv, dkv, rf, rb = [], [], [], [], []
        for (rr, u), tf in f_at.items():
            if rr != r:
                continue
            g = u.chunk * S + r
            if forward_only:  # K/V until the last segment's forward reads them
                if u.seg == 0:
                    end = f_at[r, Unit(u.mb, s.segments - 1, u.chunk)]
                    kv.append((tf, end, (u.mb, u.chunk)))
                if g > 0:
                    sent = f_at[(r - 1) % S, Unit(u.mb, u.seg, u.chunk - (r == 0))]
                    rf.append((sent + 1, tf, u))
                continue
            tb = b_at[r, u]
            stash.append((tf, tb, u))
            if u.seg == 0:
                kv.append((tf, b_at[r, u], (u.mb, u.chunk)))
                first_bwd = b_at[r, Unit(u.mb, s.segments - 1, u.chunk)]
                dkv.append((first_bwd, b_at[r, u], (u.mb, u.chunk)))
            if g > 0:  # input arrives from the previous global chunk
                sent = f_at[(r - 1) % S, Unit(u.mb, u.seg, u.chunk - (r == 0))]
                rf.append((sent + 1, tf, u))
            if g < last:  # cotangent arrives from the next global chunk
                sent = b_at[(r + 1) % S, Unit(u.mb, u.seg, u.chunk + (r == S - 1))]
                rb.append((sent + 1, tb, u))
        stash_of, counts[r, "stash"] = _allocate(stash)
        for k in range(s.segments):  # the same lifetimes, counted per segment
            res_of, n = _allocate([x for x in stash if x[2].seg == k])
            num_res[k] = max(num_res[k], n)
            for u, slot in res_of.items():
                arr["fwd_res"][f_at[r, u], r] = arr["bwd_res"][b_at[r, u], r] = slot
            if w_at:  # B leaves its W what it reads
                lives = [(b_at[r, u], w_at[r, u], u) for (_, _, u) in stash if u.seg == k]
                wgt_of, n = _allocate(lives)
                num_wgt[k] = max(num_wgt[k], n)
                for u, slot in wgt_of.items():
                    arr["bwd_wgt"][b_at[r, u], r] = arr["wgt_in"][w_at[r, u], r] = slot
            if r == S - 1:  # the head (logits, loss) runs on the last global chunk alone
                head_of, num_head[k] = _allocate(
                    [x for x in stash if x[2].seg == k and x[2].chunk == V - 1]
                )
                for u, slot in head_of.items():
                    arr["fwd_head"][f_at[r, u], r] = arr["bwd_head"][b_at[r, u], r] = slot
        kv_of, counts[r, "kv"] = _allocate(kv)
        dkv_of, counts[r, "dkv"] = _allocate(dkv)
        rf_of, counts[r, "rf"] = _allocate(rf)
        rb_of, counts[r, "rb"] = _allocate(rb)
        for u, slot in stash_of.items():
            arr["fwd_stash"][f_at[r, u], r] = arr["bwd_stash"][b_at[r, u], r] = slot
        for (m, c), slot in kv_of.items():
            for k in range(s.segments):
                u = Unit(m, k, c)
                arr["fwd_kv"][f_at[r, u], r] = slot
                if not forward_only:
                    arr["bwd_kv"][b_at[r, u], r] = slot
        for (m, c), slot in dkv_of.items():
            for k in range(s.segments):
                arr["bwd_dkv"][b_at[r, Unit(m, k, c)], r] = slot
        for u, slot in rf_of.items():
            arr["fwd_in"][f_at[r, u], r] = slot
            arr["recv_fwd"][f_at[(r - 1) % S, Unit(u.mb, u.seg, u.chunk - (r == 0))], r] = slot
        for u, slot in rb_of.items():
            arr["bwd_in"][b_at[r, u], r] = slot
            arr["recv_bwd"][b_at[(r + 1) % S, Unit(u.mb, u.seg, u.chunk + (r == S - 1))], r] = slot
    num = {k: max(counts[r, k] for r in range(S)) for k in ("stash", "kv", "dkv", "rf", "rb")}
    return Program(
        **arr,
        num_stash=num["stash"],
        num_kv=num["kv"],
        num_dkv=num["dkv"],
        num_recv_fwd=num["rf"],
        num_recv_bwd=num["rb"],
        num_res=tuple(num_res),
        num_head=tuple(num_head),
        num_wgt=tuple(num_wgt),
    )


# --------------------------------------------------------------------------- statistics


def _unit_costs(segments: int, costs: Sequence[float] | None) -> np.ndarray:
    """Per-segment forward cost, normalised to mean 1 (so equal segments cost 1 each)."""
    c = np.ones(segments) if costs is None else np.asarray(costs, dtype=float)
    if c.shape != (segments,) or (c <= 0).any():
        raise ScheduleError(f"costs must be {segments} positive numbers, got {list(c)}")
    return c * segments / c.sum()


def _token_shares(segments: int, lengths: Sequence[int] | None) -> np.ndarray:
    tok = np.ones(segments) / segments if lengths is None else np.asarray(lengths, dtype=float)
    if tok.shape != (segments,) or (tok <= 0).any():
        raise ScheduleError(f"lengths must be {segments} positive numbers, got {list(tok)}")
    return tok / tok.sum()


def _chunk_depths(chunks: int, chunk_costs: Mapping | None) -> np.ndarray:
    """Each global chunk's layer work relative to the mean chunk's (`"layers"`; all 1)."""
    if "layers" not in (chunk_costs or {}):
        return np.ones(chunks)
    d = np.asarray(chunk_costs["layers"], dtype=float)
    if d.shape != (chunks,) or (d < 0).any() or not d.sum():
        raise ScheduleError(
            f"chunk_costs['layers'] gives {chunks} layer counts >= 0 (one per global chunk), "
            f"got {list(np.atleast_1d(d))}"
        )
    return d * chunks / d.sum()


def _chunk_costs(chunks: int, chunk_costs: Mapping | None) -> dict[Kind, np.ndarray]:
    out = {k: np.zeros(chunks) for k in KINDS}
    for key, values in (chunk_costs or {}).items():
        if key == "layers":
            continue  # a factor, not an addition: `_chunk_depths`
        v = np.asarray(values, dtype=float)
        if key not in out or v.shape != (chunks,) or (v < 0).any():
            raise ScheduleError(
                f"chunk_costs maps F, B or W to {chunks} numbers >= 0 (one per global "
                f"chunk), got {key!r}: {list(np.atleast_1d(v))}"
            )
        out[Kind(key)] = v
    return out


def kind_costs(s: Schedule) -> dict[Kind, float]:
    """Cost of an operation of each kind relative to its forward: F 1, B 2; a table with
    W operations splits each backward into halves, F = B = W = 1."""
    return {F: 1.0, B: 1.0, W: 1.0} if has_weight_ops(s) else {F: 1.0, B: 2.0, W: 0.0}


def op_costs(
    s: Schedule,
    costs: Sequence[float] | None = None,
    lengths: Sequence[int] | None = None,
    chunk_costs: Mapping | None = None,
) -> np.ndarray:
    """[T, S, len(KINDS)] cost of each operation in the table, 0 where none; see `stats`."""
    S, K = s.stages, s.segments
    fc, tok = _unit_costs(K, costs), _token_shares(K, lengths)
    per_kind, add = kind_costs(s), _chunk_costs(s.virtual * S, chunk_costs)
    depth = _chunk_depths(s.virtual * S, chunk_costs)
    out = np.zeros((len(s.ticks), S, len(KINDS)))
    for t, row in enumerate(s.ticks):
        for r, cell in enumerate(row):
            for op in cell:
                u, g = op.unit, op.unit.chunk * S + r
                # Per-token extra work (head, embedding) follows the segment's tokens.
                extra = add[op.kind][g] * tok[u.seg] * K
                out[t, r, KINDS.index(op.kind)] = per_kind[op.kind] * fc[u.seg] * depth[g] + extra
    return out


def stats(
    s: Schedule,
    costs: Sequence[float] | None = None,
    lengths: Sequence[int] | None = None,
    chunk_costs: Mapping | None = None,
) -> dict:
    """Time, bubble and memory of a table under the synchronous-tick model.

    A forward of segment k costs costs[k] (normalised to mean 1; default all 1, pass
    `partition.segment_flops` for FLOP shares), its backward twice that (with W
    operations in the table, B and W once each). `chunk_costs` ({F, B or W: one number
    per global chunk}, default none) adds work to the operations of a global chunk, in
    units of a mean unit's forward and scaled by the segment's share of the tokens:
    `partition.chunk_costs` gives the head (its forward and backward run in the last
    chunk's F) and the embedding. `chunk_costs["layers"]` (default equal) scales each
    global chunk's layer work by its layer count over the mean chunk's (an uneven layer
    split, `partition.stage_layers`). A tick lasts as long as its busiest stage: time = sum
    over ticks of max over stages of the cell's cost. bubble = mean over stages of
    1 - busy_s / time, where busy_s is the work stage s runs. `inflight_peak[s]` is the
    most units stage s holds between a forward and its backward (its W if split);
    `activation_fraction[s]` is the peak of the same, weighted by each
    unit's share of a micro-batch's tokens (`lengths`, default equal) and divided by V:
    in units of one micro-batch's activations over all of the stage's layers (a unit
    counts from its forward to its W, the executor's B-to-W buffer holding it after
    its B). `weight_slots`: those buffers' slots per segment (None unless split).
    """
    S, V = s.stages, s.virtual
    tick_cost = op_costs(s, costs, lengths, chunk_costs).sum(axis=2)
    tok = _token_shares(s.segments, lengths)
    split = has_weight_ops(s)
    free = W if split else B  # the op after which a unit's stashed input is dropped
    held = np.zeros((len(s.ticks), S))  # units held during tick t (forward on, not yet freed)
    frac = np.zeros((len(s.ticks), S))
    h, fr = np.zeros(S), np.zeros(S)
    for t, row in enumerate(s.ticks):
        for r, cell in enumerate(row):
            f = cell_unit(cell, F)
            if f is not None:
                h[r] += 1
                fr[r] += tok[f.seg] / V
        held[t], frac[t] = h, fr
        for r, cell in enumerate(row):
            u = cell_unit(cell, free)
            if u is not None:
                h[r] -= 1
                fr[r] -= tok[u.seg] / V
    time = float(tick_cost.max(axis=1).sum())
    busy = tick_cost.sum(axis=0)
    prog = lower(s)
    return {
        "ticks": len(s.ticks),
        "time": round(time, 6),
        "bubble": round(float(np.mean(1 - busy / time)), 6),
        "inflight_peak": [int(x) for x in held.max(axis=0)],
        "activation_fraction": [round(float(x), 6) for x in frac.max(axis=0)],
        "stash_slots": prog and prog.num_stash,
        "kv_slots": prog and prog.num_kv,
        "dkv_slots": prog and prog.num_dkv,
        "recv_fwd_slots": prog and prog.num_recv_fwd,
        "recv_bwd_slots": prog and prog.num_recv_bwd,
        "weight_slots": list(prog.num_wgt) if split else None,
    }


# --------------------------------------------------------------------------- rendering


def _label(u: Unit, virtual: int) -> str:
    return f"{u.mb}.{u.seg}" + (f"c{u.chunk}" if virtual > 1 else "")


def to_text(s: Schedule, st: dict | None = None) -> str:
    """A grid, ticks across and stages down, cells like `F3.1/B2.0/W1.0`, then the statistics."""
    cells = [
        ["/".join(op.kind.value + _label(op.unit, s.virtual) for op in cell) or "." for cell in row]
        for row in s.ticks
    ]
    width = max(len(c) for row in cells for c in row)
    lines = ["tick     " + " ".join(f"{t:<{width}}" for t in range(len(cells)))]
    for r in range(s.stages):
        lines.append(f"stage {r:<2} " + " ".join(f"{row[r]:<{width}}" for row in cells))
    st = stats(s) if st is None else st
    lines.append("")
    lines.append(
        f"{s.name}  S={s.stages} M={s.microbatches} K={s.segments} V={s.virtual} "
        f"inflight={s.inflight}"
    )
    lines += [f"{k}: {v}" for k, v in st.items()]
    return "\n".join(lines) + "\n"


def to_json(s: Schedule, st: dict | None = None) -> dict:
    """The stable JSON form: header, ticks (one entry per stage per tick: its forward,
    backward and weight unit or null) and stats."""

    def unit(u: Unit | None):
        return None if u is None else {"mb": u.mb, "seg": u.seg, "chunk": u.chunk}

    return {
        "schedule": s.name,
        "stages": s.stages,
        "microbatches": s.microbatches,
        "segments": s.segments,
        "virtual": s.virtual,
        "ticks": [
            [
                {"stage": r, **{NAMES[k]: unit(cell_unit(cell, k)) for k in KINDS}}
                for r, cell in enumerate(row)
            ]
            for row in s.ticks
        ],
        "stats": stats(s) if st is None else st,
    }


_STYLE = {F: dict(alpha=0.45), B: dict(alpha=1.0, hatch="///"), W: dict(alpha=0.75, hatch="...")}


def to_png(
    s: Schedule,
    path: str,
    costs: Sequence[float] | None = None,
    lengths: Sequence[int] | None = None,
    chunk_costs: Mapping | None = None,
) -> None:
    """A timeline: one row per stage, x is synchronous time, boxes coloured by micro-batch.

    Time is in units of one whole micro-batch's forward on a stage (a unit costs 1/(K*V)
    of it), so pictures with different K or V share a scale. Forwards are light,
    backwards dark and hatched, weight gradients dotted; white gaps are bubbles. Ticks
    are drawn as long as their busiest stage, as the synchronous executor runs them.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    scale = s.segments * s.virtual
    width = op_costs(s, costs, lengths, chunk_costs) / scale
    st = stats(s, costs, lengths, chunk_costs)
    cmap = plt.get_cmap("tab10" if s.microbatches <= 10 else "tab20")
    total = st["time"] / scale
    fig, ax = plt.subplots(figsize=(max(8.0, total * 0.45), 0.55 * s.stages + 1.4))
    x = 0.0
    for t, row in enumerate(s.ticks):
        for r, cell in enumerate(row):
            y, x0 = s.stages - 1 - r, x
            for op in cell:
                u, w = op.unit, width[t, r, KINDS.index(op.kind)]
                ax.add_patch(
                    Rectangle(
                        (x0, y + 0.1),
                        w,
                        0.8,
                        facecolor=cmap(u.mb % cmap.N),
                        edgecolor="black",
                        linewidth=0.4,
                        **_STYLE[op.kind],
                    )
                )
                if w >= 0.2:
                    label = _label(u, s.virtual) if w >= 0.45 else str(u.mb)
                    if op.kind == W:
                        label = "W" + label
                    ax.text(x0 + w / 2, y + 0.5, label, ha="center", va="center", fontsize=6)
                x0 += w
        x += width[t].sum(axis=1).max()
    ax.set_xlim(0, x)
    ax.set_ylim(0, s.stages)
    ax.set_yticks([s.stages - 1 - r + 0.5 for r in range(s.stages)])
    ax.set_yticklabels([f"stage {r}" for r in range(s.stages)])
    ax.set_xlabel(
        "time (one micro-batch forward on a stage = 1; light = forward, hatched = backward"
        + (", dotted = W)" if has_weight_ops(s) else ")")
    )
    ax.set_title(
        f"{s.name}  S={s.stages} M={s.microbatches} K={s.segments} V={s.virtual} "
        f"inflight={s.inflight}: bubble {st['bubble']:.3f}, stage-0 peak "
        f"{st['inflight_peak'][0]} units = {st['activation_fraction'][0]:g} micro-batches"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")  # a path or a binary file
    plt.close(fig)


# --------------------------------------------------------------------------- CLI


ZB_TABLE = ("1f1b", "zb_h1", "seq1f1b", "seq_zb_h1")


def zero_bubble_table(inflight: str | int = "full") -> str:
    """Bubble and stage-0 peak (micro-batches of activations) of 1F1B, Seq1F1B and their
    zero-bubble forms over S = 4, 8; M = 8, 16; K = 1, 2, 4 (the unit cost model)."""
    lines = [
        f"inflight={inflight}; each cell: bubble / stage-0 peak in micro-batches",
        "| S | M | K | " + " | ".join(ZB_TABLE) + " |",
        "|---|---|---|" + "---|" * len(ZB_TABLE),
    ]
    for S in (4, 8):
        for M in (8, 16):
            for K in (1, 2, 4):
                cells = []
                for name in ZB_TABLE:
                    k = K if GENERATORS[name].granularity == "segment" else 1
                    st = stats(build(name, S, M, k, inflight=inflight))
                    cells.append(f"{st['bubble']:.3f} / {st['activation_fraction'][0]:g}")
                lines.append(f"| {S} | {M} | {K} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _parse_inflight(text: str) -> str | int:
    if text in DEPTHS:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be 'minimal', 'full' or an integer, got {text!r}"
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m seqpipe.schedule ...`: print or save a schedule; bad arguments exit 2."""
    from seqpipe import partition

    parser = argparse.ArgumentParser(
        prog="python -m seqpipe.schedule", description=__doc__.split("\n")[0]
    )

    def fail(message: str):
        sys.stderr.write(f"error: {message}\n")
        sys.exit(2)

    parser.error = fail  # one line, no usage dump
    if argv is None:
        argv = sys.argv[1:]
    if "--zero-bubble-table" in argv:  # the issue-16 comparison, at --inflight's depth
        rest = argv[argv.index("--inflight") + 1 :] if "--inflight" in argv else ["full"]
        sys.stdout.write(zero_bubble_table(_parse_inflight(rest[0])))
        return 0
    parser.add_argument("--schedule", required=True, help=", ".join(SCHEDULES))
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--segments", type=int, default=1)
    parser.add_argument("--virtual", type=int, default=1)
    parser.add_argument("--inflight", type=_parse_inflight, default="full")
    parser.add_argument("--format", choices=("text", "json", "png"), default="text")
    parser.add_argument("--out", help="output file (required for png; default stdout)")
    parser.add_argument("--seq-len", type=int, help="check K against it; weight stats by it")
    parser.add_argument("--partition", choices=partition.KINDS, default="uniform")
    parser.add_argument("--multiple", type=int, default=1, help="segment lengths multiple")
    for dim in ("d-model", "num-heads", "d-ff", "vocab-size", "num-layers"):
        parser.add_argument(f"--{dim}", type=int, help="model shape: FLOP-weighted costs")
    parser.add_argument(
        "--head",
        action="store_true",
        help="add the head's and embedding's work to the end chunks (needs --seq-len and "
        "the model shape with --num-layers)",
    )
    args = parser.parse_args(argv)
    try:
        costs = lengths = None
        if args.seq_len is not None or args.partition == "flops":
            if args.seq_len is None:
                raise ScheduleError("--partition flops needs --seq-len")
            shape = ("d_model", "num_heads", "d_ff", "vocab_size")
            if args.partition == "flops" and (
                missing := [k for k in shape if not getattr(args, k)]
            ):
                flags = " ".join(f"--{k.replace('_', '-')}" for k in missing)
                raise ScheduleError(f"--partition flops needs the model shape: give {flags}")
            dims = dict(
                d_model=args.d_model,
                num_heads=args.num_heads,
                d_ff=args.d_ff,
                vocab_size=args.vocab_size,
                num_layers=args.num_layers,
            )
            lengths = partition.segment_lengths(
                args.seq_len, args.segments, args.partition, multiple=args.multiple, **dims
            )
            # Weight units by FLOPs whenever the model shape is known.
            if args.partition == "flops" or args.d_model is not None:
                costs = partition.segment_flops(lengths, **dims)
        sched = build(
            args.schedule,
            args.stages,
            args.microbatches,
            args.segments,
            args.virtual,
            args.inflight,
        )
        extra = None
        if args.head:
            if args.seq_len is None or args.d_model is None or args.num_layers is None:
                raise ScheduleError("--head needs --seq-len and the model shape (--num-layers too)")
            extra = partition.chunk_costs(args.stages * args.virtual, args.seq_len, **dims)
        if args.format == "png" and not args.out:
            raise ScheduleError("--format png needs --out FILE")
        if args.out:
            _check_out(args.out)
    except ValueError as e:  # ScheduleError and PartitionError
        fail(str(e))
    st = stats(sched, costs, lengths, extra)
    if args.format == "png":
        write = lambda f: to_png(sched, f, costs, lengths, extra)
    else:
        text = to_text(sched, st) if args.format == "text" else json.dumps(to_json(sched, st))
        if not args.out:
            sys.stdout.write(text if args.format == "text" else text + "\n")
            return 0
        write = lambda f: f.write((text if args.format == "text" else text + "\n").encode())
    from seqpipe.files import atomic_write

    try:
        atomic_write(args.out, write)  # whole or not at all
    except OSError as e:
        fail(f"--out {args.out}: writing failed ({e.strerror or e}); free space or choose another")
    return 0


def _check_out(path: str) -> None:
    """An --out that cannot be written is refused before any work."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ScheduleError(f"--out {path} is a directory; give a file name")
    if not os.path.isdir(parent):
        raise ScheduleError(
            f"--out {path}: {parent} is not a directory; create it or choose another"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ScheduleError(
            f"--out {path}: {parent} is not writable; make it writable or choose another --out"
        )


if __name__ == "__main__":
    sys.exit(main())
