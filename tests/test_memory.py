"""The memory report: the analytic carry matches the executor, XLA's figures relate to it."""

import functools
import json
import math

import numpy as np
import pytest
from helpers import run_python

from seqpipe.pipeline import carry, executor, units
from seqpipe.run import config as config_lib
from seqpipe.tools import memory

TINY = dict(vocab_size=61, num_layers=2, d_model=16, num_heads=2, d_ff=24)


def tiny_config(schedule="seq1f1b", segments=4, inflight="full", seq_len=32, virtual=1):
    c = config_lib.base_config()
    c.model.update(TINY)
    c.model.num_layers = 2 * virtual
    c.mesh.update(data=1, stage=2)
    c.pipeline.update(
        schedule=schedule,
        microbatches=4,
        segments=segments,
        inflight=inflight,
        virtual_stages=virtual,
    )
    c.train.update(global_batch_size=8, seq_len=seq_len)
    config_lib.validate(c)
    return c


@functools.cache
def measured(schedule, segments, inflight):
    """step_memory of a tiny config, compiled once per module."""
    return memory.step_memory(tiny_config(schedule, segments, inflight), unit=False)


def nbytes(aval) -> int:
    return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize


@pytest.mark.parametrize(
    "schedule,segments,virtual",
    [("1f1b", 1, 1), ("seq1f1b", 4, 1), ("seq1f1b_interleaved", 2, 2), ("seq_zb_h1", 4, 1)],
)
def test_analytic_carry_is_the_executors_carry(schedule, segments, virtual):
    """Every byte of the scan carry in the step's jaxpr is accounted for, buffer by buffer."""
    config = tiny_config(schedule, segments, virtual=virtual)
    spec = executor.make_spec(config)
    prog, rows, cfg = spec.program, 2, spec.cfg
    got = carry.breakdown(spec, rows)
    avals = memory.carry_avals(config)
    assert sum(nbytes(a) for a in avals) == got["carry"]
    shapes = sorted(a.shape for a in avals)
    msg = (rows, max(spec.lengths), cfg.d_model)
    assert (max(prog.num_stash, 1),) + msg in shapes
    kv = (max(prog.num_kv, 1), 1, rows, spec.kv_len, cfg.num_heads, cfg.head_dim)
    dkv = (max(prog.num_dkv, 1),) + kv[1:]
    # kv_k, kv_v, dkv_k, dkv_v; with K = 1 they hold no positions and vanish from the loop.
    assert shapes.count(kv) + shapes.count(dkv) == (4 if spec.kv_len else 0)
    assert got["stash"] == max(prog.num_stash, 1) * math.prod(msg) * 4
    assert got["kv"] == 2 * math.prod(kv) * 4 and got["dkv"] == 2 * math.prod(dkv) * 4
    # A split table's B leaves its W, per segment and slot, the matmuls' inputs (3D + F)
    # and output cotangents (5D + F) of each layer's positions; an unsplit one nothing.
    per_position = 8 * cfg.d_model + 2 * cfg.d_ff
    want = sum(
        max(n, 1) * spec.chunk_layers * rows * length * per_position * 4
        for n, length in zip(prog.num_wgt, spec.lengths, strict=True)
    )
    assert got["weight"] == (want if spec.schedule.split else 0)


@pytest.mark.parametrize(
    "schedule,segments,virtual", [("1f1b", 1, 1), ("seq1f1b_interleaved", 3, 2)]
)
def test_analytic_carry_with_residual_stashes(schedule, segments, virtual):
    """remat=none: the carry holds, per segment, its slots of that unit's residuals."""
    config = tiny_config(schedule, segments, virtual=virtual)
    config.pipeline.remat = "none"
    spec = executor.make_spec(config)
    got = carry.breakdown(spec, 2)
    avals = memory.carry_avals(config)
    assert sum(nbytes(a) for a in avals) == got["carry"]
    assert got["stash"] == 0 and got["res"] > 0
    buffers = carry.of_spec(spec, 2)
    assert len(buffers.saved) == len(buffers.head_dy) == segments
    for k, (stash, n) in enumerate(zip(buffers.saved, spec.program.num_res, strict=True)):
        stored = units.SegmentUnit(spec, k).layer_layout(2).stored  # a layer's residuals
        lead = (max(n, 1), spec.chunk_layers)
        assert tuple(b.shape for b in stash) == tuple(lead + a.shape for a in stored)
    slots = [b for stash in buffers.saved for b in stash] + list(buffers.head_dy)
    for b in slots:
        assert any(a.shape == b.shape for a in avals), b


@pytest.mark.parametrize(
    "schedule,segments,virtual", [("1f1b", 1, 1), ("seq1f1b", 4, 1), ("seq1f1b_interleaved", 2, 2)]
)
def test_head_keeps_only_its_dy_in_last_chunk_slots(schedule, segments, virtual):
    """The head's backward runs in its forward: a last-chunk unit keeps dy of its own
    positions ([b, L_k, D]), never the logits or the head's weight, in slots for the last
    chunk's units in flight, not for every unit of every stage."""
    config = tiny_config(schedule, segments, virtual=virtual)
    config.pipeline.remat = "none"
    spec = executor.make_spec(config)
    cfg, prog = spec.cfg, spec.program
    buffers = carry.of_spec(spec, 2)
    for stash in buffers.saved:
        assert not [a for a in stash if cfg.vocab_size in a.shape]  # no weight, no logits
    for k, (dy, n) in enumerate(zip(buffers.head_dy, prog.num_head, strict=True)):
        assert dy.shape == (max(n, 1), 2, spec.lengths[k], cfg.d_model) and dy.dtype == cfg.dtype
    assert (prog.fwd_head[:, : spec.stages - 1] < 0).all()  # only the last stage fills them
    last_chunk = (prog.fwd_mb[:, -1] >= 0) & (prog.fwd_chunk[:, -1] == virtual - 1)
    assert ((prog.fwd_head[:, -1] >= 0) == last_chunk).all()
    assert sum(prog.num_head) < sum(prog.num_res)


def test_keeping_residuals_costs_memory_and_seq1f1b_holds_a_fraction_of_it():
    """The issue's bound, on the benchmark's model (long enough sequences that activations
    dominate): with remat=none, Seq1F1B S=4 K=4 needs at most 0.6 of 1F1B's temp."""
    bench = config_lib.load("configs/bench.py")
    temps = {}
    for remat in ("full", "none"):
        for schedule, segments in (("1f1b", 1), ("seq1f1b", 4)):
            config = memory.with_schedule(bench, schedule, segments, "full")
            config.pipeline.remat = remat
            temps[remat, schedule] = memory.step_memory(config, unit=False)["temp"]
    assert temps["none", "1f1b"] > temps["full", "1f1b"]
    assert temps["none", "seq1f1b"] <= 0.6 * temps["none", "1f1b"], temps


@pytest.mark.parametrize("remat", ["full", "none"])
def test_no_gradient_sized_temporary_beside_the_carry(remat):
    """Gradients accumulate inside the head's and the backward's branches: were a
    parameter-sized cotangent tree returned from them (a vocabulary-sized head weight's
    here), XLA's temp would exceed carry plus the largest unit's working set."""
    config = tiny_config("1f1b", 1)
    config.model.vocab_size = 4096
    config.pipeline.remat = remat
    got = memory.step_memory(config, unit=True)
    assert got["temp"] <= got["carry"] + got["unit"], got


def test_residual_unit_working_set_is_smaller_than_recomputing():
    spec = {}
    for remat in ("full", "none"):
        config = tiny_config("seq1f1b", 2, seq_len=64)
        config.pipeline.remat = remat
        spec[remat] = executor.make_spec(config)
    assert memory.unit_temp_bytes(spec["none"], 2, 1) < memory.unit_temp_bytes(spec["full"], 2, 1)


def test_seq1f1b_holds_less_stash_than_1f1b_and_needs_less_kv_than_it_holds():
    for depth in ("full", "minimal"):
        one = carry.breakdown(executor.make_spec(tiny_config("1f1b", 1, depth)), 2)
        seq = carry.breakdown(executor.make_spec(tiny_config("seq1f1b", 4, depth)), 2)
        assert seq["stash"] < one["stash"]
        # No segment attends to the last segment's K/V: 1F1B needs no cache at all.
        # No segment attends to the last segment's K/V: 1F1B caches none, and Seq1F1B
        # caches only the prefix, with one dK/dV slot (backwards of a micro-batch's
        # segments run back to back).
        assert one["kv"] == one["kv_needed"] == one["dkv"] == one["dkv_needed"] == 0
        assert 0 < seq["kv_needed"] == seq["kv"]
        assert seq["dkv_needed"] == seq["dkv"] < seq["kv"]


def test_xla_temp_covers_the_carry_and_grows_with_the_stash():
    full, small = measured("1f1b", 1, "full"), measured("1f1b", 1, "minimal")
    assert full["num_stash"] > small["num_stash"]
    for r in (full, small):
        assert r["temp"] >= r["carry"]
        assert r["argument"] > 0 and r["output"] > 0
    assert full["temp"] - small["temp"] >= full["stash"] - small["stash"] > 0


def test_unit_working_set_shrinks_with_segments():
    """The backward of one segment recomputes a K-times shorter query block."""
    spec1 = executor.make_spec(tiny_config("1f1b", 1, seq_len=64))
    spec4 = executor.make_spec(tiny_config("seq1f1b", 4, seq_len=64))
    assert memory.unit_temp_bytes(spec4, 2, 3) < memory.unit_temp_bytes(spec1, 2, 0)


@pytest.mark.slow  # 70 s on 2 cores; test_context checks each device's share of residuals
def test_context_devices_keep_half_the_positions_and_the_whole_state():
    """With mesh.context=2 each device's carry holds half of every segment's positions
    (stash, messages, K/V; the jaxpr's carry is still the analytic one, byte for byte),
    the parameters' gradients whole; the unit compiles alone on the context devices, and
    `seq_len` is the sequence's."""
    c = tiny_config("seq1f1b", 2)
    c.mesh.context = 2
    config_lib.validate(c)
    spec, rows = executor.make_spec(c), 2
    assert sum(nbytes(a) for a in memory.carry_avals(c)) == carry.breakdown(spec, rows)["carry"]
    one, two = measured("seq1f1b", 2, "full"), memory.step_memory(c)
    assert (one["context"], two["context"]) == (1, 2) and two["seq_len"] == one["seq_len"] == 32
    for key in ("stash", "messages", "kv", "dkv"):
        assert 2 * two[key] == one[key] > 0, key
    assert two["grads"] == one["grads"] and two["unit"] > 0


TINY_ARGS = [f"--config.model.{k}={v}" for k, v in TINY.items()] + [
    "--config.mesh.data=1",
    "--config.mesh.stage=2",
    "--config.train.seq_len=32",
    "--config.pipeline.microbatches=4",
    "--config.train.global_batch_size=8",
    "--config.pipeline.schedule=1f1b",
]


def run_cli(*args):
    return run_python("-m", "seqpipe.tools.memory", "--config", "tiny", *args)


def test_cli_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "rows.json"
    r = run_cli(*TINY_ARGS, "--schedules", "1f1b", "--json", str(out), "--no-unit")
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if x.startswith("| ")]
    assert lines[0].startswith("| schedule | K | depth")
    assert lines[1].startswith("| 1f1b | 1 | full | 3 (3) | 1.00 |")
    rows = json.loads(out.read_text())
    assert [(x["schedule"], x["segments"]) for x in rows] == [("1f1b", 1)]
    assert all(x["temp"] > 0 and "unit" not in x for x in rows)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--schedules", "seq1f1b:x"], "K must be a positive integer"),
        (["--schedules", "nope"], "pipeline.schedule='nope' is not valid"),
        (["--config.train.seq_len=abc"], "expected a int"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(args, needle):
    r = run_cli(*TINY_ARGS, *args)
    assert r.returncode == 2
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr


def test_no_copies_of_the_carry_inside_the_tick_loop():
    assert measured("1f1b", 1, "full")["loop_copies"] == 0


@pytest.mark.parametrize(
    "attention, partition, shared",
    [("blockwise", "uniform", True), ("xla", "uniform", False), ("blockwise", "flops", False)],
)
def test_equal_residuals_share_one_stash(attention, partition, shared):
    """With every residual kept, segments whose residuals have one shape (equal segments,
    attention that keeps nothing prefix-shaped) share the schedule's stash slots, fewer
    than a pool per segment; otherwise each segment has its own."""
    c = tiny_config(segments=4)
    c.model.attention = attention
    c.pipeline.update(remat="none", partition=partition)
    spec = executor.make_spec(c)
    strategy = units.strategy(spec)
    assert strategy.shared is shared
    saved = carry.of_spec(spec, 2).saved
    assert len(saved) == (1 if shared else spec.segments)
    if shared:
        unit = sum(nbytes(a) for a in units.SegmentUnit(spec, 0).saved_avals(2))
        assert sum(nbytes(a) for a in saved[0]) == spec.program.num_stash * unit
        assert spec.program.num_stash < sum(spec.program.num_res)
