"""A valid table lowered to per-tick slot indices for one SPMD executor (`Program`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from seqpipe.schedule.tables import B, F, Schedule, Unit, W, cell_unit, validate


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


def _sender(u: Unit, r: int, S: int) -> tuple[int, Unit]:
    """The stage and unit whose forward output is unit `u`'s input on stage `r` (the
    previous global chunk)."""
    return (r - 1) % S, Unit(u.mb, u.seg, u.chunk - (r == 0))


def _receiver(u: Unit, r: int, S: int) -> tuple[int, Unit]:
    """The stage and unit whose input cotangent is unit `u`'s output cotangent on stage
    `r` (the next global chunk)."""
    return (r + 1) % S, Unit(u.mb, u.seg, u.chunk + (r == S - 1))


def _place(s: Schedule, arr: dict[str, np.ndarray]) -> tuple[dict, dict, dict]:
    """Writes each operation's unit into `arr`; returns the tick of each (stage, unit)'s
    forward, backward and weight operation."""
    at = {F: {}, B: {}, W: {}}
    prefix = {F: "fwd", B: "bwd", W: "wgt"}
    for t, row in enumerate(s.ticks):
        for r, cell in enumerate(row):
            for kind, ticks in at.items():
                u = cell_unit(cell, kind)
                if u is None:
                    continue
                ticks[r, u] = t
                for field in ("mb", "seg", "chunk"):
                    arr[f"{prefix[kind]}_{field}"][t, r] = getattr(u, field)
    return at[F], at[B], at[W]


def _lifetimes(s: Schedule, r: int, f_at: dict, b_at: dict) -> dict[str, list]:
    """Stage `r`'s slot lifetimes [first tick, last tick, key] by buffer: the stash, the
    K/V and dK/dV of each (mb, chunk), and the messages received from each neighbour."""
    S, last = s.stages, s.virtual * s.stages - 1
    out = {"stash": [], "kv": [], "dkv": [], "rf": [], "rb": []}
    for (rr, u), tf in f_at.items():
        if rr != r:
            continue
        g, whole = u.chunk * S + r, (u.mb, u.chunk)
        if g > 0:  # input arrives from the previous global chunk
            out["rf"].append((f_at[_sender(u, r, S)] + 1, tf, u))
        if s.forward_only:  # an evaluation: K/V until the last segment's forward reads them
            if u.seg == 0:
                out["kv"].append((tf, f_at[r, Unit(u.mb, s.segments - 1, u.chunk)], whole))
            continue
        tb = b_at[r, u]
        out["stash"].append((tf, tb, u))
        if u.seg == 0:
            out["kv"].append((tf, tb, whole))
            out["dkv"].append((b_at[r, Unit(u.mb, s.segments - 1, u.chunk)], tb, whole))
        if g < last:  # cotangent arrives from the next global chunk
            out["rb"].append((b_at[_receiver(u, r, S)] + 1, tb, u))
    return out


def _segment_slots(s, r, stash, at, arr, num) -> None:
    """Per-segment slots of stage `r` (their shapes differ by segment): the forward's
    residuals, what a split B leaves its W, and the head's residuals."""
    f_at, b_at, w_at = at
    for k in range(s.segments):
        mine = [x for x in stash if x[2].seg == k]
        res_of, n = _allocate(mine)
        num["res"][k] = max(num["res"][k], n)
        for u, slot in res_of.items():
            arr["fwd_res"][f_at[r, u], r] = arr["bwd_res"][b_at[r, u], r] = slot
        if w_at:  # B leaves its W what it reads
            wgt_of, n = _allocate([(b_at[r, u], w_at[r, u], u) for (_, _, u) in mine])
            num["wgt"][k] = max(num["wgt"][k], n)
            for u, slot in wgt_of.items():
                arr["bwd_wgt"][b_at[r, u], r] = arr["wgt_in"][w_at[r, u], r] = slot
        if r == s.stages - 1:  # the head (logits, loss) runs on the last global chunk alone
            head_of, num["head"][k] = _allocate([x for x in mine if x[2].chunk == s.virtual - 1])
            for u, slot in head_of.items():
                arr["fwd_head"][f_at[r, u], r] = arr["bwd_head"][b_at[r, u], r] = slot


def _write_slots(s: Schedule, r: int, slots: dict, f_at: dict, b_at: dict, arr) -> None:
    """Stage `r`'s allocated slots into the arrays, at the ticks that write and read them
    (a message's slot also at its sender's tick)."""
    S = s.stages
    for u, slot in slots["stash"].items():
        arr["fwd_stash"][f_at[r, u], r] = arr["bwd_stash"][b_at[r, u], r] = slot
    for (m, c), slot in slots["kv"].items():
        for k in range(s.segments):
            arr["fwd_kv"][f_at[r, Unit(m, k, c)], r] = slot
            if not s.forward_only:
                arr["bwd_kv"][b_at[r, Unit(m, k, c)], r] = slot
    for (m, c), slot in slots["dkv"].items():
        for k in range(s.segments):
            arr["bwd_dkv"][b_at[r, Unit(m, k, c)], r] = slot
    for u, slot in slots["rf"].items():
        arr["fwd_in"][f_at[r, u], r] = slot
        arr["recv_fwd"][f_at[_sender(u, r, S)], r] = slot
    for u, slot in slots["rb"].items():
        arr["bwd_in"][b_at[r, u], r] = slot
        arr["recv_bwd"][b_at[_receiver(u, r, S)], r] = slot


def lower(s: Schedule) -> Program:
    """Lower a valid table to per-tick slot indices for one SPMD executor.

    Slot lifetimes in ticks (inclusive): a stash slot from the forward to the backward;
    a KV slot from the segment-0 forward to the segment-0 backward of (mb, chunk); a
    message slot from the tick after it was sent to the tick that reads it (a slot read
    at tick t may take a message sent during t, since stores follow reads); a B-to-W slot
    (per segment) from a split backward's B to its W.
    """
    validate(s)
    T = len(s.ticks)
    arr = {
        f: np.full((T, s.stages), -1, dtype=np.int32)
        for f in (x.name for x in dataclasses.fields(Program))
        if not f.startswith("num_")
    }
    f_at, b_at, w_at = _place(s, arr)
    counts = {k: 0 for k in ("stash", "kv", "dkv", "rf", "rb")}
    per_segment = {k: [0] * s.segments for k in ("res", "head", "wgt")}
    for r in range(s.stages):
        lives = _lifetimes(s, r, f_at, b_at)
        _segment_slots(s, r, lives["stash"], (f_at, b_at, w_at), arr, per_segment)
        slots = {}
        for kind, intervals in lives.items():
            slots[kind], n = _allocate(intervals)
            counts[kind] = max(counts[kind], n)
        _write_slots(s, r, slots, f_at, b_at, arr)
    return Program(
        **arr,
        num_stash=counts["stash"],
        num_kv=counts["kv"],
        num_dkv=counts["dkv"],
        num_recv_fwd=counts["rf"],
        num_recv_bwd=counts["rb"],
        num_res=tuple(per_segment["res"]),
        num_head=tuple(per_segment["head"]),
        num_wgt=tuple(per_segment["wgt"]),
    )
