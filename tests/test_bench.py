"""The benchmark: its synchronous-time model, and an end-to-end --quick run."""

import json
import math
import weakref

import pytest

from seqpipe import schedule
from seqpipe.pipeline import executor, remat
from seqpipe.run import config as config_lib
from seqpipe.tools import bench, flops, tick_model


def test_predicted_matches_schedule_stats_with_unit_costs():
    c = config_lib.base_config()
    c.model.update(num_layers=4)
    c.mesh.update(stage=4)
    c.pipeline.update(schedule="seq1f1b", microbatches=4, segments=2)
    spec = executor.make_spec(c)
    got = tick_model.predicted(spec, lambda sp, seg, first, last, kind, n: 2.0 if kind else 1.0)
    want = schedule.stats(spec.schedule)
    assert math.isclose(got["time"], want["time"])
    assert math.isclose(got["bubble"], want["bubble"], abs_tol=1e-6)
    # A split table: its B and W are costed apart (kind 1 and 2), F = B = W = 1 here.
    c.pipeline.update(schedule="seq_zb_h1")
    spec = executor.make_spec(c)
    got = tick_model.predicted(spec, lambda sp, seg, first, last, kind, n: [1.0, 1.0, 1.0][kind])
    want = schedule.stats(spec.schedule)
    assert math.isclose(got["time"], want["time"])
    assert math.isclose(got["bubble"], want["bubble"], abs_tol=1e-6)
    got = tick_model.predicted(spec, lambda sp, seg, first, last, kind, n: [1.0, 1.0, 0.0][kind])
    assert got["time"] < want["time"]  # W really costed


def test_release_frees_the_compiled_units():
    """`flops.release` drops the executables themselves (each holds mapped code pages;
    all of make bench's at once passed vm.max_map_count and crashed XLA)."""
    c = config_lib.base_config()
    c.model.update(vocab_size=64, num_layers=2, d_model=16, num_heads=2, d_ff=32)
    c.mesh.update(stage=2)
    c.pipeline.update(schedule="1f1b", microbatches=2)
    spec = executor.make_spec(c)
    compiled, _ = flops.compiled_unit(spec, 1, 0, False, False, 0)
    ref = weakref.ref(compiled)
    del compiled
    assert flops.release() >= 1
    assert ref() is None and not flops._COMPILED


def test_quick_end_to_end(tmp_path, capsys, monkeypatch):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    # Every step the rows compiled, and every unit, is gone before the remat policies
    # compile theirs (the full bench's executables together crashed XLA; `flops.release`).
    compiled, policy_rows = [], bench.policy_rows

    def compile_step(config):
        step = compile_step.original(config)
        compiled.append(weakref.ref(step["compiled"]))
        return step

    def policies_after_release(*args):
        assert compiled and all(r() is None for r in compiled), "a step outlived its phase"
        assert not flops._COMPILED, "units outlived their phase"
        return policy_rows(*args)

    compile_step.original = bench.compile_step
    monkeypatch.setattr(bench, "compile_step", compile_step)
    monkeypatch.setattr(bench, "policy_rows", policies_after_release)
    assert bench.main(["--quick", "--json", str(out), "--png", str(png)]) == 0
    assert not flops._COMPILED  # the policies' units freed too
    result = json.loads(out.read_text())
    labels = ["1f1b", "seq1f1b K2 uniform", "seq_zb_h1 K2 uniform"]
    assert [r["label"] for r in result["rows"]] == labels
    for r in result["rows"]:
        for key in ("temp_bytes", "flop_ratio", "predicted_s", "measured_s", "bubble_units"):
            assert math.isfinite(r[key]) and r[key] >= 0, (key, r[key])
        assert 1.0 <= r["flop_ratio"] < 1.1  # remat none: no forward recomputed
        assert r["unit_s"]["F"] > 0 and r["unit_s"]["B"] > 0
    # F, B and W measured apart: only the split table has a W of its own.
    assert [r["unit_s"]["W"] > 0 for r in result["rows"]] == [False, False, True]
    assert result["overhead"]["ratio"] > 0 and result["reference"]["seconds"] > 0
    policies = {(p["label"], p["remat"]): p for p in result["policies"]}
    assert len(policies) == 2 * len(remat.POLICIES)  # every policy; `auto` picks one of them
    for name in ("1f1b", "seq1f1b K2 uniform"):
        none, full = policies[name, "none"], policies[name, "full"]
        assert none["flop_ratio"] < full["flop_ratio"] and none["stash_bytes"] > full["stash_bytes"]
    assert {p["label"] for p in result["prediction"]} == {"zb_h1", *labels}
    assert png.stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "| seq1f1b K2 uniform |" in printed and "| W ms |" in printed


@pytest.mark.slow  # two steps compiled and run, and their units timed: about a minute
def test_split_rows_show_the_flops_split_shortening_the_predicted_step():
    """Eight layers on four stages, the head about two layers' work: the flops split moves
    a layer off the last stage, whose measured work per micro-batch was the largest, and
    the step predicted from the measured unit times gets shorter."""
    c = tick_model.variant(config_lib.load("bench"), "seq1f1b", 4, "uniform", 1)
    with c.unlocked():
        c.model.update(d_model=32, num_heads=2, d_ff=64)
        c.train.update(seq_len=64)
    even, flops = bench.split_rows(c, rows_per_mb=1, repeats=1, log=lambda m: None)
    assert even["layers_per_stage"] == [2, 2, 2, 2]
    assert flops["layers_per_stage"][-1] < 2 and sum(flops["layers_per_stage"]) == 8
    assert max(even["stage_work_s"]) == even["stage_work_s"][-1]
    assert flops["predicted_s"] < even["predicted_s"]
    assert "| flops |" in bench.split_table([even, flops])


@pytest.mark.parametrize("axis", ["tensor", "context"])
def test_a_stage_of_several_devices_is_refused_in_one_line(axis, capsys):
    """The bench times units alone on a device each: a stage split over tensor or context
    devices is refused before anything compiles."""
    with pytest.raises(SystemExit) as e:
        bench.main(["--quick", f"--config.mesh.{axis}=2"])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: python -m seqpipe.bench measures stages of one device each")
    assert f"mesh.{axis}=2 is not supported" in line


def test_a_run_that_dies_leaves_what_it_measured(tmp_path, monkeypatch):
    """The JSON is written after each section: a run killed later (XLA out of memory on a
    shared machine) keeps the rows it measured."""
    out = tmp_path / "bench.json"

    def dying(config, runs, repeats, log, quick, save):
        save({"rows": [{"label": "1f1b"}]})
        raise MemoryError("LLVM compilation error: Cannot allocate memory")

    monkeypatch.setattr(bench, "bench", dying)
    with pytest.raises(MemoryError):
        bench.main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text())["rows"] == [{"label": "1f1b"}]
