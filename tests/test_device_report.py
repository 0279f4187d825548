"""The device run's report, on a real accelerator-bench run here (CPU, tiny model)."""

import copy
import json

import pytest

from seqpipe import bench
from seqpipe.tools import device_report


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """What `scripts/device_accel.sh bench` leaves after its default-remat step, on CPU."""
    out = tmp_path_factory.mktemp("device")
    argv = ["--accelerator", "--quick", "--variants", "ref,1f1b", "--steps", "1"]
    assert bench.main(argv + ["--no_profile", "--json", str(out / "accel.json")]) == 0
    return out


def test_a_partial_run_is_reported_with_what_it_lacks(run_dir):
    text = device_report.report(run_dir)
    rows = json.loads((run_dir / "accel.json").read_text())["rows"]
    one = next(r for r in rows if r["variant"] == "1f1b")
    assert "| accel, 64 x 8, blockwise | ref | " in text
    assert "| accel, 64 x 8, blockwise | 1f1b | " in text
    verdict = "met" if one["vs_ref"] <= 1.10 else "not met"
    assert f"- 1f1b over the reference: {one['vs_ref']:.2f}x (accel, 64 x 8, blockwise) " in text
    assert f"(goal <= 1.10x: {verdict})" in text
    assert "- reference MFU: not measured" in text  # a CPU has no peak to measure against
    assert "- 32768 x 2: not measured" in text and "- 8192 x 8: not measured" in text
    assert "- pallas_gpu against xla on the GPU: not measured" in text
    missing = text.split("Not there")[1]
    assert "accel_pallas.json" in missing and "accel.json," not in missing


def test_each_goal_is_met_at_its_threshold_and_not_below(run_dir):
    measured = json.loads((run_dir / "accel.json").read_text())

    def with_rows(seq_len, batch, attention, **values):
        res = copy.deepcopy(measured)
        res.update(seq_len=seq_len, global_batch_size=batch, attention=attention)
        for r in res["rows"]:
            r.update(values)
        return res

    for mfu, ratio, verdict in ((0.5, 2.0, "met"), (0.499, 1.99, "not met")):
        results = {
            "accel_pallas.json": with_rows(2048, 32, "pallas_gpu", mfu=mfu),
            "accel_32k.json": with_rows(32768, 2, "pallas_gpu", mfu=mfu - 0.05),
            "accel_8k_pallas.json": with_rows(8192, 8, "pallas_gpu", step_s=1.0),
            "accel_8k_xla.json": with_rows(8192, 8, "xla", step_s=ratio),
        }
        lines = device_report.goals(results)
        assert lines[0].startswith(f"- reference MFU: {100 * mfu:.1f}% (ref, accel_pallas")
        assert lines[0].endswith(f"(goal 50%: {verdict})")
        (long,) = [x for x in lines if x.startswith("- 32768 x 2:")]
        assert long.endswith(f"(goal 45%: {verdict})")
        (fused,) = [x for x in lines if x.startswith("- 8192 x 8:")]
        assert f"step time {ratio:.2f}x" in fused and fused.endswith(f"(goal >= 2x: {verdict})")


def test_a_directory_that_is_not_there_is_one_line(tmp_path, capsys):
    assert device_report.main([str(tmp_path / "absent")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: name the directory a device run wrote")
