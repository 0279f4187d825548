"""Schedule tables: validity, depth bounds, bubble formulas, slot lowering, CLI."""

import dataclasses
import hashlib
import json
import os
import subprocess

import numpy as np
import pytest
from helpers import run_python
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from seqpipe import schedule as sc
from seqpipe.schedule import (
    B,
    F,
    Schedule,
    ScheduleError,
    Unit,
    W,
    cell_unit,
    make_cell,
    partition,
    render,
)

# SEQPIPE_EXAMPLES=500 for a thorough sweep; the default keeps the file under ~20 s.
PROPS = settings(
    max_examples=int(os.environ.get("SEQPIPE_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def configs(draw, names=sc.SCHEDULES, depths=("minimal", "full", "int")):
    """(name, S, M, K, V, inflight) over S 1..8, M 1..16, K 1..8, V 1..3."""
    name = draw(st.sampled_from(names))
    S = draw(st.integers(1, 8))
    K = draw(st.integers(1, 8))
    V = draw(st.integers(1, 3)) if name in sc.INTERLEAVED else 1
    # V > 1 needs M to be a multiple of S (Megatron's rule).
    M = S * draw(st.integers(1, 16 // S)) if V > 1 else draw(st.integers(1, 16))
    depth = draw(st.sampled_from(depths))
    inflight = draw(st.integers(1, 40)) if depth == "int" else depth
    return name, S, M, K, V, inflight


def build_or_skip(name, S, M, K, V, inflight):
    """Build; an integer depth below the schedule's minimum is refused, never deadlocks."""
    try:
        return sc.build(name, S, M, K, V, inflight)
    except ScheduleError as e:
        assert isinstance(inflight, int) and "too small" in str(e), e
        return None


def units_by_stage(s: Schedule):
    fwd = [[] for _ in range(s.stages)]
    bwd = [[] for _ in range(s.stages)]
    for row in s.ticks:
        for r, cell in enumerate(row):
            f, b = cell_unit(cell, F), cell_unit(cell, B)
            if f is not None:
                fwd[r].append(f)
            if b is not None:
                bwd[r].append(b)
    return fwd, bwd


def key(u: Unit):
    return (u.mb, u.seg, u.chunk)


def all_units(s: Schedule):
    units = [
        Unit(m, k, c)
        for m in range(s.microbatches)
        for k in range(s.segments)
        for c in range(s.virtual)
    ]
    return sorted(units, key=key)


def with_cell(s: Schedule, t: int, r: int, cell) -> Schedule:
    ticks = [list(row) for row in s.ticks]
    ticks[t][r] = cell
    return Schedule(**{**s.__dict__, "ticks": tuple(tuple(row) for row in ticks)})


def find(s: Schedule, r: int, u: Unit, kind) -> int:
    return next(t for t, row in enumerate(s.ticks) if cell_unit(row[r], kind) == u)


# --------------------------------------------------------------------------- simulator


def simulate(s: Schedule, p: sc.Program) -> None:
    """Run a Program's slot reads and writes and check each read finds the right content.

    This is what the SPMD executor does with the arrays, so a lowering bug shows up here
    as a wrong or missing message, stash entry or KV cache.
    """
    S, V, K = s.stages, s.virtual, s.segments
    last = V * S - 1
    stash = [[None] * p.num_stash for _ in range(S)]
    kv = [[None] * p.num_kv for _ in range(S)]
    dkv = [[None] * p.num_dkv for _ in range(S)]
    rf = [[None] * p.num_recv_fwd for _ in range(S)]
    rb = [[None] * p.num_recv_bwd for _ in range(S)]
    for t, row in enumerate(s.ticks):
        sent_f, sent_b = [None] * S, [None] * S  # by receiving stage
        freed_stash = []
        for r, cell in enumerate(row):
            f, b = cell_unit(cell, F), cell_unit(cell, B)
            if f is None:
                assert p.fwd_mb[t, r] == -1 and p.fwd_stash[t, r] == -1
            else:
                assert (p.fwd_mb[t, r], p.fwd_seg[t, r], p.fwd_chunk[t, r]) == (
                    f.mb,
                    f.seg,
                    f.chunk,
                )
                g = f.chunk * S + r
                if g == 0:
                    assert p.fwd_in[t, r] == -1
                else:
                    slot = p.fwd_in[t, r]
                    assert rf[r][slot] == ("act", f.mb, f.seg, g - 1), (t, r, f)
                    rf[r][slot] = None  # consumed; reusable for a store at the end of t
                slot = p.fwd_stash[t, r]
                assert stash[r][slot] is None, f"stash slot {slot} overwritten at {t, r}"
                stash[r][slot] = ("x", f.mb, f.seg, g)
                slot = p.fwd_kv[t, r]
                if f.seg == 0:
                    assert kv[r][slot] is None, f"kv slot {slot} overwritten at {t, r}"
                    kv[r][slot] = [f.mb, f.chunk, 0, K]  # mb, chunk, segs written, lowest bwd
                else:
                    assert kv[r][slot][:3] == [f.mb, f.chunk, f.seg], (t, r, f)
                kv[r][slot][2] += 1
                if g < last:
                    sent_f[(r + 1) % S] = ("act", f.mb, f.seg, g)
            if b is None:
                assert p.bwd_mb[t, r] == -1 and p.bwd_stash[t, r] == -1
                continue
            assert (p.bwd_mb[t, r], p.bwd_seg[t, r], p.bwd_chunk[t, r]) == (
                b.mb,
                b.seg,
                b.chunk,
            )
            g = b.chunk * S + r
            if g == last:
                assert p.bwd_in[t, r] == -1
            else:
                slot = p.bwd_in[t, r]
                assert rb[r][slot] == ("grad", b.mb, b.seg, g + 1), (t, r, b)
                rb[r][slot] = None
            slot = p.bwd_stash[t, r]
            assert stash[r][slot] == ("x", b.mb, b.seg, g), (t, r, b)
            freed_stash.append((r, slot))
            slot = p.bwd_kv[t, r]
            # All K segments' K/V are cached, and segments above b.seg already ran backward.
            assert kv[r][slot] == [b.mb, b.chunk, K, b.seg + 1], (t, r, b, kv[r][slot])
            kv[r][slot][3] = b.seg
            if b.seg == 0:
                kv[r][slot] = None
            # The dK/dV accumulator lives from the last segment's backward to segment 0's.
            slot = p.bwd_dkv[t, r]
            if b.seg == K - 1:
                assert dkv[r][slot] is None, f"dkv slot {slot} overwritten at {t, r}"
                dkv[r][slot] = (b.mb, b.chunk)
            assert dkv[r][slot] == (b.mb, b.chunk), (t, r, b, dkv[r][slot])
            if b.seg == 0:
                dkv[r][slot] = None
            if g > 0:
                sent_b[(r - 1) % S] = ("grad", b.mb, b.seg, g)
        for r, slot in freed_stash:
            stash[r][slot] = None
        for r in range(S):
            for msg, slots, bufs in ((sent_f[r], p.recv_fwd, rf), (sent_b[r], p.recv_bwd, rb)):
                if msg is None:
                    assert slots[t, r] == -1
                else:
                    assert bufs[r][slots[t, r]] is None, f"message overwritten at {t, r}"
                    bufs[r][slots[t, r]] = msg
    for bufs in (stash, kv, rf, rb):
        assert all(x is None for per in bufs for x in per), "something left unconsumed"


# --------------------------------------------------------------------------- properties


@PROPS
@given(configs())
def test_every_generator_is_valid_and_runs_every_unit_once(cfg):
    s = build_or_skip(*cfg)
    if s is None:
        return
    sc.validate(s)
    fwd, bwd = units_by_stage(s)
    for r in range(s.stages):
        assert sorted(fwd[r], key=key) == all_units(s)
        assert sorted(bwd[r], key=key) == all_units(s)
    simulate(s, sc.lower(s))


@PROPS
@given(configs())
def test_forward_only_tables_run_every_forward_once_and_keep_nothing(cfg):
    """An evaluation's table: the training table's forwards in order, no backward, each
    forward as early as its input allows; its program keeps K/V only while the micro-batch's
    later segments need them, and nothing for a backward."""
    s = build_or_skip(*cfg)
    if s is None:
        return
    e = sc.forward_only(s)
    sc.validate(e)
    with pytest.raises(ScheduleError, match="forward-only table has backward"):
        sc.validate(dataclasses.replace(s, forward_only=True))
    with pytest.raises(ScheduleError, match="never runs"):  # only an evaluation skips them
        sc.validate(dataclasses.replace(e, forward_only=False))
    fwd, bwd = units_by_stage(e)
    for r in range(e.stages):
        assert sorted(fwd[r], key=key) == all_units(e) and not bwd[r]
        assert fwd[r] == units_by_stage(s)[0][r]  # the training order
    p = sc.lower(e)
    assert p.num_stash == p.num_dkv == p.num_recv_bwd == 0
    assert sum(p.num_res) == sum(p.num_head) == 0
    assert (p.bwd_mb < 0).all() and (p.fwd_head < 0).all()
    assert len(e.ticks) <= len(s.ticks)
    # Stage 0 never waits: its forwards fill the first M*K*V ticks.
    assert all(cell_unit(e.ticks[t][0], F) is not None for t in range(len(fwd[0])))


def others(cell, *kinds):
    return [cell_unit(cell, k) for k in kinds]


def w_of(s, t, r):
    return cell_unit(s.ticks[t][r], W)


@PROPS
@given(configs(), st.randoms(use_true_random=False))
def test_broken_tables_are_rejected(cfg, rnd):
    s = build_or_skip(*cfg)
    if s is None:
        return
    S, K = s.stages, s.segments
    r = rnd.randrange(S)
    u = rnd.choice(all_units(s))
    tf, tb = find(s, r, u, F), find(s, r, u, B)
    # A unit missing.
    with pytest.raises(ScheduleError, match="never runs"):
        sc.validate(with_cell(s, tb, r, make_cell(cell_unit(s.ticks[tb][r], F))))
    # A unit run twice: append a tick repeating it.
    twice = Schedule(**{**s.__dict__, "ticks": s.ticks + ((make_cell(u),) * S,)})
    with pytest.raises(ScheduleError, match="twice"):
        sc.validate(twice)
    if K > 1 and u.seg < K - 1:
        # Two segments of one micro-batch swapped: the KV prefix (forward) or the K/V
        # gradient (backward) comes too late.
        v = Unit(u.mb, u.seg + 1, u.chunk)
        tv = find(s, r, v, F)
        broken = with_cell(s, tf, r, make_cell(v, *others(s.ticks[tf][r], B, W)))
        broken = with_cell(broken, tv, r, make_cell(u, *others(s.ticks[tv][r], B, W)))
        with pytest.raises(ScheduleError, match="KV prefix|input"):
            sc.validate(broken)
        tv = find(s, r, v, B)
        broken = with_cell(s, tb, r, make_cell(cell_unit(s.ticks[tb][r], F), v, w_of(s, tb, r)))
        broken = with_cell(
            broken, tv, r, make_cell(cell_unit(s.ticks[tv][r], F), u, w_of(s, tv, r))
        )
        with pytest.raises(ScheduleError, match="K/V gradient|cotangent|before its forward"):
            sc.validate(broken)
    # Everything on stage r one tick later: its backwards now meet their cotangents (or
    # the next stage meets its inputs) in the same tick.
    if S > 1:
        ticks = [list(row) for row in s.ticks] + [[make_cell()] * S]
        for t in reversed(range(1, len(ticks))):
            ticks[t][r] = ticks[t - 1][r]
        ticks[0][r] = make_cell()
        late = Schedule(**{**s.__dict__, "ticks": tuple(tuple(row) for row in ticks)})
        with pytest.raises(ScheduleError, match="input|cotangent"):
            sc.validate(late)


@PROPS
@given(configs(depths=("minimal", "full")))
def test_inflight_bounds(cfg):
    name, S, M, K, V, depth = cfg
    peak = sc.stats(sc.build(*cfg))["inflight_peak"]
    # With V == 1 the interleaved names are their plain forms (tested exactly below).
    if name == "gpipe":
        bound = M * K
    elif V > 1:
        bound = V * M * K
        assert sc.build(*cfg).ticks == sc.build(name, S, M, K, V, "minimal").ticks
    elif sc.GENERATORS[name].granularity == "segment":
        bound = min(S + K - 1 if depth == "minimal" else 2 * (S - 1) + K, M * K)
    else:  # whole micro-batches
        bound = min(S if depth == "minimal" else 2 * S - 1, M) * K
    assert peak[0] <= bound
    if sc.GENERATORS[name].split:  # ZB-H1: later stages may hold up to stage 0's cap
        assert max(peak) <= bound
    else:
        assert peak == sorted(peak, reverse=True)  # later stages never hold more


def test_stage0_peaks_reach_the_stated_depths():
    for S, M, K in [(4, 8, 4), (8, 16, 4), (4, 8, 1), (3, 5, 2)]:
        seq = {d: sc.stats(sc.build("seq1f1b", S, M, K, inflight=d)) for d in sc.DEPTHS}
        assert seq["minimal"]["inflight_peak"][0] == min(S + K - 1, M * K)
        assert seq["full"]["inflight_peak"][0] == min(2 * (S - 1) + K, M * K)
        one = {d: sc.stats(sc.build("1f1b", S, M, inflight=d)) for d in sc.DEPTHS}
        assert one["minimal"]["inflight_peak"][0] == min(S, M)
        assert one["full"]["inflight_peak"][0] == min(2 * S - 1, M)
        assert sc.stats(sc.build("gpipe", S, M, K))["inflight_peak"][0] == M * K


@PROPS
@given(configs(names=("1f1b", "seq1f1b", *sc.INTERLEAVED), depths=("full",)))
def test_full_depth_reaches_the_asynchronous_bubble(cfg):
    name, S, M, K, V, _ = cfg
    bubble = sc.stats(sc.build(*cfg))["bubble"]
    assert bubble == pytest.approx((S - 1) / (V * M * K + S - 1), abs=5e-4)


# --------------------------------------------------------------------------- stated numbers


@pytest.mark.parametrize("S", [4, 8])
@pytest.mark.parametrize("M", [8, 16])
@pytest.mark.parametrize("K", [1, 2, 4, 8])
def test_bubble_table_full(S, M, K):
    seq = sc.stats(sc.build("seq1f1b", S, M, K))["bubble"]
    assert round(seq, 3) == round((S - 1) / (M * K + S - 1), 3)
    one = sc.stats(sc.build("1f1b", S, M))["bubble"]
    assert round(one, 3) == round((S - 1) / (M + S - 1), 3)


def test_minimal_depth_numbers_from_the_design_note():
    assert round(sc.stats(sc.build("1f1b", 4, 8, inflight="minimal"))["bubble"], 3) == 0.5
    got = sc.stats(sc.build("seq1f1b", 4, 8, 4, inflight="minimal"))
    assert round(got["bubble"], 3) == 0.425
    assert got["inflight_peak"][0] == 7
    got = sc.stats(sc.build("seq1f1b", 8, 16, 4, inflight="minimal"))
    assert round(got["bubble"], 3) == 0.478


def test_headline_seq1f1b_4_8_4():
    got = sc.stats(sc.build("seq1f1b", 4, 8, 4))
    assert round(got["bubble"], 3) == 0.086
    assert got["inflight_peak"] == [10, 8, 6, 4]
    assert got["activation_fraction"][0] == pytest.approx(2.5)  # 10 quarter micro-batches
    assert got["kv_slots"] == 4  # micro-batches with a live KV cache on stage 0
    assert sc.stats(sc.build("1f1b", 4, 8))["activation_fraction"][0] == pytest.approx(7.0)


@pytest.mark.parametrize("depth", ["minimal", "full", 1, 3, 6])
@pytest.mark.parametrize("S,M", [(1, 1), (1, 5), (2, 1), (4, 8), (5, 3), (8, 16)])
def test_seq1f1b_with_one_segment_is_1f1b(S, M, depth):
    a = sc.build("seq1f1b", S, M, 1, inflight=depth)
    assert a.ticks == sc.build("1f1b", S, M, 1, inflight=depth).ticks
    assert a.ticks == sc.build("seq1f1b_interleaved", S, M, 1, inflight=depth).ticks
    assert a.ticks == sc.build("interleaved_1f1b", S, M, 1, inflight=depth).ticks


def test_gpipe_runs_all_forwards_first():
    s = sc.build("gpipe", 3, 4, 2)
    fwd_end = max(t for t, row in enumerate(s.ticks) if cell_unit(row[0], F) is not None)
    bwd_start = min(t for t, row in enumerate(s.ticks) if cell_unit(row[0], B) is not None)
    assert fwd_end < bwd_start


def test_time_and_bubble_by_hand():
    # S=2, M=1: F on stage 0 (1), F+B on stage 1 (3), B on stage 0 (2).
    got = sc.stats(sc.build("1f1b", 2, 1))
    assert (got["ticks"], got["time"], got["bubble"]) == (3, 6.0, 0.5)
    one = sc.stats(sc.build("seq1f1b", 1, 1, 1))
    assert (one["ticks"], one["time"], one["bubble"]) == (1, 3.0, 0.0)
    s = sc.build("seq1f1b", 4, 8, 4)
    assert sc.stats(s, costs=[5, 5, 5, 5]) == sc.stats(s)
    # Costs normalise to mean 1: [0.5, 1.5]. Ticks: F0.0 (0.5), F0.1+B0.1 (1.5+3), B0.0 (1).
    weighted = sc.stats(sc.build("seq1f1b", 1, 1, 2), costs=[1, 3], lengths=[3, 1])
    assert (weighted["time"], weighted["bubble"]) == (6.0, 0.0)
    assert weighted["activation_fraction"] == [1.0]
    two = sc.stats(sc.build("seq1f1b", 1, 2, 2), lengths=[3, 1])
    assert two["activation_fraction"] == [1.5]  # (0,0) still stashed when (1,0) starts


# --------------------------------------------------------------------------- hand-made tables


def test_hand_made_tables():
    u = Unit(0, 0, 0)
    fb, f, b, none = make_cell(u, u), make_cell(u), make_cell(None, u), make_cell()
    ok = Schedule("1f1b", 1, 1, 1, 1, "full", ((fb,),))
    sc.validate(ok)
    early = Schedule("1f1b", 1, 1, 1, 1, "full", ((b,), (f,)))
    with pytest.raises(ScheduleError, match="before its forward"):
        sc.validate(early)
    same_tick = Schedule("1f1b", 2, 1, 1, 1, "full", ((f, fb), (b, none)))
    with pytest.raises(ScheduleError, match="input"):
        sc.validate(same_tick)
    not_last = Schedule("1f1b", 2, 1, 1, 1, "full", ((fb, none), (none, fb)))
    with pytest.raises(ScheduleError, match="before its forward"):
        sc.validate(not_last)
    out_of_range = Schedule("1f1b", 1, 1, 1, 1, "full", ((make_cell(Unit(0, 0, 1), u),),))
    with pytest.raises(ScheduleError, match="out of range"):
        sc.validate(out_of_range)
    short_row = Schedule("1f1b", 2, 1, 1, 1, "full", ((fb,),))
    with pytest.raises(ScheduleError, match="one per stage"):
        sc.validate(short_row)


def test_operations_in_a_cell():
    u, v = Unit(0, 0, 0), Unit(0, 1, 0)
    cell = make_cell(u, v)
    assert cell == (sc.Op(F, u), sc.Op(B, v))
    assert (cell_unit(cell, F), cell_unit(cell, B), cell_unit(cell, W)) == (u, v, None)
    assert make_cell() == () and make_cell(None, None, u) == (sc.Op(W, u),)
    assert [k.value for k in sc.KINDS] == ["F", "B", "W"]
    s = Schedule("1f1b", 1, 1, 1, 1, "full", (((sc.Op(B, u), sc.Op(F, u)),),))
    with pytest.raises(ScheduleError, match="at most one per kind"):
        sc.validate(s)  # out of order
    s = Schedule("1f1b", 1, 1, 1, 1, "full", (((sc.Op(F, u), sc.Op(F, u)),),))
    with pytest.raises(ScheduleError, match="at most one per kind"):
        sc.validate(s)
    s = Schedule("1f1b", 1, 1, 1, 1, "full", (((u, u),),))  # the old (forward, backward) pair
    with pytest.raises(ScheduleError, match="tuple of Op"):
        sc.validate(s)


def test_weight_operations():
    u, v = Unit(0, 0, 0), Unit(1, 0, 0)
    fb, w = make_cell(u, u), make_cell(None, None, u)
    split = Schedule("1f1b", 1, 1, 1, 1, "full", ((fb,), (w,)))
    sc.validate(split)
    sc.validate(Schedule("1f1b", 1, 1, 1, 1, "full", ((make_cell(u, u, u),),)))  # B then W
    early = Schedule("1f1b", 1, 1, 1, 1, "full", ((make_cell(u, None, u),), (make_cell(None, u),)))
    with pytest.raises(ScheduleError, match="weight .* runs before its backward"):
        sc.validate(early)
    twice = Schedule("1f1b", 1, 1, 1, 1, "full", ((fb,), (w,), (w,)))
    with pytest.raises(ScheduleError, match="weight .* runs twice"):
        sc.validate(twice)
    # One W in the table: every unit needs its W.
    half = Schedule("1f1b", 1, 2, 1, 1, "full", ((fb,), (make_cell(v, v, u),)))
    with pytest.raises(ScheduleError, match=r"weight Unit\(mb=1.* never runs"):
        sc.validate(half)
    # F = B = W = 1 with W in the table: F+B (2), then W (1); held until the W.
    got = sc.stats(split)
    assert (got["ticks"], got["time"], got["bubble"], got["inflight_peak"]) == (2, 3.0, 0.0, [1])
    assert (got["stash_slots"], got["weight_slots"]) == (1, [1])
    prog = sc.lower(split)  # B at tick 0 leaves slot 0 for the W at tick 1
    assert (prog.bwd_wgt[:, 0].tolist(), prog.wgt_in[:, 0].tolist()) == ([0, -1], [-1, 0])
    assert prog.wgt_mb[:, 0].tolist() == [-1, 0]
    assert "F0.0/B0.0" in render.to_text(split) and "W0.0" in render.to_text(split)
    assert render.to_json(split)["ticks"][1][0] == {
        "stage": 0,
        "forward": None,
        "backward": None,
        "weight": {"mb": 0, "seg": 0, "chunk": 0},
    }


@pytest.mark.parametrize("cfg", [("seq1f1b", 4, 8, 4), ("interleaved_1f1b", 2, 4, 1, 2)])
def test_a_backward_split_in_place_costs_the_same(cfg):
    s = sc.build(*cfg)
    ticks = tuple(
        tuple(make_cell(cell_unit(c, F), cell_unit(c, B), cell_unit(c, B)) for c in row)
        for row in s.ticks
    )
    split = dataclasses.replace(s, ticks=ticks)
    sc.validate(split)
    got, want = sc.stats(split), sc.stats(s)
    for key in ("ticks", "time", "bubble", "inflight_peak", "activation_fraction"):
        assert got[key] == want[key]


def test_registry():
    assert (
        sc.SCHEDULES
        == tuple(sc.GENERATORS)
        == (
            "gpipe",
            "1f1b",
            "seq1f1b",
            "interleaved_1f1b",
            "seq1f1b_interleaved",
            "zb_h1",
            "seq_zb_h1",
        )
    )
    assert [n for n, g in sc.GENERATORS.items() if g.split] == ["zb_h1", "seq_zb_h1"]
    assert sc.INTERLEAVED == ("interleaved_1f1b", "seq1f1b_interleaved")
    assert [n for n, g in sc.GENERATORS.items() if g.forwards_first] == ["gpipe"]
    assert [n for n, g in sc.GENERATORS.items() if g.granularity == "segment"] == [
        "seq1f1b",
        "seq1f1b_interleaved",
        "seq_zb_h1",
    ]
    assert all(g.granularity in ("microbatch", "segment") for g in sc.GENERATORS.values())
    with pytest.raises(ScheduleError, match="unknown schedule"):
        sc.generator("zero_bubble")
    from seqpipe.run import config

    assert config.SCHEDULES == ("none", *sc.SCHEDULES)


WEIGHT_ROWS = ("wgt_mb", "wgt_seg", "wgt_chunk", "bwd_wgt", "wgt_in", "num_wgt")


def _digest(p: sc.Program, skip=()) -> str:
    h = hashlib.sha256()
    for f in dataclasses.fields(p):
        if f.name in skip:
            continue
        v = getattr(p, f.name)
        h.update(f.name.encode())
        h.update(
            repr(v.shape).encode() + v.tobytes() if isinstance(v, np.ndarray) else repr(v).encode()
        )
    return h.hexdigest()[:16]


@pytest.mark.parametrize(
    "cfg, digest",
    [
        (("1f1b", 4, 8, 1, 1, "minimal"), "a3e9e6d3c8cae1b2"),
        (("seq1f1b", 4, 8, 4, 1, "full"), "371005d63faf848a"),
        (("gpipe", 3, 4, 2, 1, "full"), "a541b3b473cd6d48"),
        (("seq1f1b_interleaved", 4, 8, 2, 2, "full"), "564a39c5a2f3bbcd"),
        (("interleaved_1f1b", 2, 4, 1, 2, "minimal"), "b154058edcc63a1f"),
    ],
)
def test_lowering_is_pinned(cfg, digest):
    # Every Program array, as the (forward, backward) cells of 0952314 lowered them: the
    # executor reads these; a change here must be deliberate. Unsplit tables have no W.
    p = sc.lower(sc.build(*cfg))
    assert _digest(p, skip=WEIGHT_ROWS) == digest
    assert (p.wgt_mb < 0).all() and (p.bwd_wgt < 0).all() and not any(p.num_wgt)


def test_chunk_costs_by_hand():
    # S=2, M=2, 1F1B; the last stage's forward carries h more (its head). Ticks: F0 | F1,
    # F0+h+B0 | B0, F1+h+B1 | B1: time 1 + 2*(3+h) + 2; busy 6 and 6+2h.
    s = sc.build("1f1b", 2, 2)
    assert sc.stats(s, chunk_costs={}) == sc.stats(s) == sc.stats(s, chunk_costs={"F": [0, 0]})
    assert sc.stats(s)["bubble"] == pytest.approx(1 / 3, abs=1e-6)
    for h in (0.5, 1.0, 4.0):
        got = sc.stats(s, chunk_costs={F: [0, h]})
        assert got["time"] == pytest.approx(9 + 2 * h)
        assert got["bubble"] == pytest.approx((3 + h) / (9 + 2 * h), abs=1e-6)
    # Per-token work follows the tokens: segment lengths [3, 1] put 1.5h and 0.5h on them.
    one = sc.build("seq1f1b", 1, 1, 2)
    assert sc.stats(one, lengths=[3, 1], chunk_costs={"F": [2.0]})["time"] == 6.0 + 4.0
    with pytest.raises(ScheduleError, match="chunk_costs"):
        sc.stats(s, chunk_costs={"F": [1.0]})  # one number per global chunk (V*S)
    with pytest.raises(ScheduleError, match="chunk_costs"):
        sc.stats(s, chunk_costs={"X": [0, 1]})
    with pytest.raises(ScheduleError, match="costs"):
        sc.stats(sc.build("seq1f1b", 4, 8, 2), costs=[1.0])


def test_the_head_grows_the_bubble():
    shape = dict(d_model=64, num_heads=4, d_ff=256, vocab_size=512, num_layers=4)
    extra = partition.chunk_costs(4, 16, **shape)
    # Per token: a layer's forward 8*64*64 + 4*64*256 + (4*16 + 3)*4 * 16/2 = 100448; the
    # head's forward and backward 6*64*512; one layer per chunk.
    assert extra["F"] == (0, 0, 0, pytest.approx(6 * 64 * 512 / 100448))
    assert extra["B"] == (pytest.approx(64 / 100448), 0, 0, 0)
    s = sc.build("seq1f1b", 4, 8, 4)
    plain, head = sc.stats(s), sc.stats(s, chunk_costs=extra)
    assert round(plain["bubble"], 3) == 0.086  # the README's figure, unchanged by default
    assert head["bubble"] > plain["bubble"] + 0.05 and head["time"] > plain["time"]
    # With V = 2 the head sits on chunk 1 of the last stage only.
    s2 = sc.build("seq1f1b_interleaved", 2, 2, 1, 2)
    extra2 = partition.chunk_costs(4, 16, **shape)
    busy = sc.op_costs(s2, chunk_costs=extra2).sum(axis=(0, 2))
    assert busy[1] - busy[0] == pytest.approx(2 * extra2["F"][3] - 2 * extra2["B"][0])


@pytest.mark.parametrize(
    "args, match",
    [
        (("nope", 4, 8), "unknown schedule"),
        (("1f1b", 0, 8), "stages"),
        (("1f1b", 4, 0), "microbatches"),
        (("seq1f1b", 4, 8, 0), "segments"),
        (("seq1f1b", 4, 6, 2, 2), "virtual"),
        (("interleaved_1f1b", 4, 6, 1, 2), "multiple of"),
        (("seq1f1b", 4, 8, 2, 1, "deep"), "inflight"),
        (("seq1f1b", 4, 8, 4, 1, 2), "too small"),
    ],
)
def test_bad_arguments(args, match):
    with pytest.raises(ScheduleError, match=match):
        sc.build(*args)


def test_lowering_of_the_headline_schedule():
    p = sc.lower(sc.build("seq1f1b", 4, 8, 4))
    assert p.fwd_mb.shape == (len(sc.build("seq1f1b", 4, 8, 4).ticks), 4)
    assert p.fwd_mb.dtype.name == "int32"
    assert (p.num_stash, p.num_kv, p.num_recv_fwd, p.num_recv_bwd) == (10, 4, 1, 1)
    s = sc.build("seq1f1b_interleaved", 4, 8, 2, 2)
    simulate(s, sc.lower(s))


# --------------------------------------------------------------------------- CLI


def cli(*args):
    return run_python("-m", "seqpipe.schedule", *args)


def test_cli_text_and_json(tmp_path):
    res = cli("--schedule", "seq1f1b", "--stages", "4", "--microbatches", "8", "--segments", "4")
    assert res.returncode == 0, res.stderr
    assert "F0.0" in res.stdout and "F3.1/B" in res.stdout and "B7.0" in res.stdout
    assert "bubble: 0.0857" in res.stdout
    out = tmp_path / "s.json"
    res = cli(
        "--schedule",
        "seq1f1b_interleaved",
        "--stages",
        "2",
        "--microbatches",
        "4",
        "--segments",
        "2",
        "--virtual",
        "2",
        "--inflight",
        "minimal",
        "--format",
        "json",
        "--out",
        str(out),
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    assert [data[k] for k in ("schedule", "stages", "microbatches", "segments", "virtual")] == [
        "seq1f1b_interleaved",
        2,
        4,
        2,
        2,
    ]
    assert data["ticks"][0][0] == {
        "stage": 0,
        "forward": {"mb": 0, "seg": 0, "chunk": 0},
        "backward": None,
        "weight": None,
    }
    assert len(data["ticks"][0]) == 2 and "bubble" in data["stats"]


def test_cli_png(tmp_path):
    out = tmp_path / "s.png"
    res = cli("--schedule", "1f1b", "--stages", "2", "--microbatches", "3", "--format", "png")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    res = cli(
        "--schedule",
        "1f1b",
        "--stages",
        "2",
        "--microbatches",
        "3",
        "--format",
        "png",
        "--out",
        str(out),
    )
    assert res.returncode == 0, res.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_head():
    base = ["--schedule", "seq1f1b", "--stages", "4", "--microbatches", "8", "--segments", "4"]
    shape = ["--seq-len", "16", "--d-model", "64", "--num-heads", "4", "--d-ff", "256"]
    shape += ["--vocab-size", "512", "--num-layers", "4", "--format", "json"]
    plain, head = cli(*base, *shape), cli(*base, *shape, "--head")
    assert plain.returncode == head.returncode == 0, plain.stderr + head.stderr
    # What the CLI computes from the shape: FLOP-weighted segments plus the head.
    extra = partition.chunk_costs(
        4, 16, d_model=64, num_heads=4, d_ff=256, vocab_size=512, num_layers=4
    )
    costs = partition.segment_flops(
        (4, 4, 4, 4), d_model=64, num_heads=4, d_ff=256, vocab_size=512, num_layers=4
    )
    s = sc.build("seq1f1b", 4, 8, 4)
    want = sc.stats(s, costs, (4, 4, 4, 4), extra)
    assert json.loads(head.stdout)["stats"] == want
    assert want["bubble"] > json.loads(plain.stdout)["stats"]["bubble"]
    res = cli(*base, "--head")
    assert res.returncode == 2 and "--head needs" in res.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["--schedule", "seq1f1b", "--stages", "0", "--microbatches", "8"],
        ["--schedule", "zero_bubble", "--stages", "4", "--microbatches", "8"],
        ["--schedule", "seq1f1b", "--stages", "4", "--microbatches", "6", "--virtual", "2"],
        [
            "--schedule",
            "seq1f1b_interleaved",
            "--stages",
            "4",
            "--microbatches",
            "6",
            "--virtual",
            "2",
        ],
        [
            "--schedule",
            "seq1f1b",
            "--stages",
            "4",
            "--microbatches",
            "8",
            "--segments",
            "9",
            "--seq-len",
            "8",
        ],
        ["--schedule", "seq1f1b", "--stages", "4", "--microbatches", "8", "--inflight", "deep"],
        ["--schedule", "seq1f1b", "--stages", "four", "--microbatches", "8"],
        ["--stages", "4", "--microbatches", "8"],
    ],
)
def test_cli_bad_arguments_one_line_exit_2(args):
    res = cli(*args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_full_depth_bubble_over_the_whole_grid():
    for S in range(1, 9):
        for K in range(1, 9):
            for M in range(1, 17):
                for name in ("1f1b", "seq1f1b"):
                    got = sc.stats(sc.build(name, S, M, K))["bubble"]
                    assert got == pytest.approx((S - 1) / (M * K + S - 1), abs=5e-4)
                for V in (2, 3):
                    if M % S:
                        continue
                    for name in sc.INTERLEAVED:
                        s = sc.build(name, S, M, K, V)
                        got = sc.stats(s)["bubble"]
                        assert got == pytest.approx((S - 1) / (V * M * K + S - 1), abs=5e-4)


@pytest.mark.parametrize("plain, split", [("1f1b", "zb_h1"), ("seq1f1b", "seq_zb_h1")])
@pytest.mark.parametrize("S, M, K", [(4, 8, 4), (8, 16, 4), (4, 16, 1)])
def test_zero_bubble_shrinks_the_bubble_at_the_same_memory(plain, split, S, M, K):
    """Issue 16's goal: W filling the bubbles keeps stage 0's peak and at least halves
    the bubble (at the `full` depth; seq_zb_h1 at S=4, M=8, K=4: 0.030 against 0.086)."""
    for depth in sc.DEPTHS:
        a, b = (sc.stats(sc.build(n, S, M, K, inflight=depth)) for n in (plain, split))
        assert b["activation_fraction"][0] == a["activation_fraction"][0]
        assert max(b["activation_fraction"]) <= a["activation_fraction"][0]
        assert b["bubble"] < (0.5 if depth == "full" else 0.8) * a["bubble"]


ONE_F1B = ["--schedule", "1f1b", "--stages", "2", "--microbatches", "3", "--format", "json"]


def test_cli_out_writes_a_device_in_place_and_a_full_one_is_one_line(tmp_path):
    """--out to a link to /dev/full (as a copy of it made by mknod would be) is written
    in place: one "no space" line, and the link is still there; /dev/null takes it all."""
    full, null = tmp_path / "full", tmp_path / "null"
    full.symlink_to("/dev/full")
    null.symlink_to("/dev/null")
    res = cli(*ONE_F1B, "--out", str(full))
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("error: ") and "No space left on device" in line, line
    res = cli(*ONE_F1B, "--out", str(null))
    assert res.returncode == 0, res.stderr
    assert full.is_symlink() and null.is_symlink() and os.readlink(null) == "/dev/null"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "null"]  # no temporary


def test_cli_out_to_a_named_pipe_reaches_its_reader(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    try:
        res = cli(*ONE_F1B, "--out", str(fifo))
        read, _ = reader.communicate(timeout=60)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    assert res.returncode == 0, res.stderr
    assert json.loads(read)["stages"] == 2
    assert stat_kind(fifo) == "fifo" and not res.stdout


def test_cli_out_through_a_link_to_stdout_writes_stdout(tmp_path):
    link = tmp_path / "stdout"
    link.symlink_to("/proc/self/fd/1")  # what /dev/stdout is
    res = cli(*ONE_F1B, "--out", str(link))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["stages"] == 2
    assert link.is_symlink() and os.readlink(link) == "/proc/self/fd/1"


def stat_kind(path) -> str:
    import stat

    mode = os.lstat(path).st_mode
    return "fifo" if stat.S_ISFIFO(mode) else "regular" if stat.S_ISREG(mode) else "other"
