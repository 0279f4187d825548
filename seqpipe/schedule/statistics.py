"""What a table costs: bubble, peak units held and step time under per-unit costs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from seqpipe.schedule.lowering import lower
from seqpipe.schedule.tables import (
    KINDS,
    B,
    F,
    Kind,
    Schedule,
    ScheduleError,
    W,
    cell_unit,
    has_weight_ops,
)


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
