"""Memory budgets (tests/memory_budgets.json, `seqpipe.tools.budgets`): no compiled step
needs more memory a device than its row allows, on CPU devices, a TPU slice and an H200.

The default rows are small steps that keep the shapes that matter (a real width, several
segments, tensor parallelism, the zero-bubble and interleaved tables); the paper rows,
the headline runs, are slow (`make budgets`, `make test-all`)."""

import json
import platform
import sys

import pytest

from seqpipe.tools import budgets

DATA = budgets.load()
GiB = 2**30

# Each row's compiler: libtpu (Linux x86-64) for a TPU slice, JAX's CUDA plugin (Linux)
# for a GPU system; both come with `make install`.
LINUX = sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")


# The default rows whose compiles take longest (40-90 s on 2 cores): under make test-all.
SLOW_ROWS = ("tpu-seq1f1b-whole-tiles", "tpu-seq1f1b-tensor")


def param(row: dict):
    slow = row["suite"] == "paper" or row["name"] in SLOW_ROWS
    marks = [pytest.mark.slow] if slow else []
    if row["target"] != "cpu":
        marks.append(pytest.mark.skipif(not LINUX, reason="TPU and GPU compilers: Linux only"))
    return pytest.param(row, id=row["name"], marks=marks)


@pytest.mark.parametrize("row", [param(r) for r in DATA["rows"]])
def test_the_compiled_step_needs_no_more_memory_than_its_budget(row):
    report = budgets.measure(row)
    state, line = budgets.verdict(row, report["peak_memory_per_device_bytes"], DATA["tolerance"])
    assert state in ("ok", "fell"), line


def test_the_default_rows_keep_the_shapes_that_matter():
    """Every target, tensor parallelism, several segments, the zero-bubble and the
    interleaved tables, at a width of at least 512."""
    rows = budgets.rows_of(DATA, "default")
    targets = {r["target"].split("-")[0] for r in rows}
    assert {"cpu", "v5p", "h200"} <= targets
    over = [r["overrides"] for r in rows]
    assert any(o.get("mesh.tensor", 1) > 1 for o in over)
    assert all(o["pipeline.segments"] >= 4 and o["model.d_model"] >= 512 for o in over)
    schedules = {o["pipeline.schedule"] for o in over}
    assert {"seq_zb_h1", "seq1f1b_interleaved"} <= schedules
    # K/V heads that fill whole TPU tiles (16 of 128, gpt_1b's), where the TPU's layouts
    # decide 19% of the step (docs/performance.md, TPU layouts)
    assert any(
        r["target"].startswith("v5p")
        and r["overrides"]["model.num_heads"] >= 16
        and r["overrides"]["model.d_model"] // r["overrides"]["model.num_heads"] == 128
        for r in rows
    )
    paper = {(r["config"], r["target"]) for r in budgets.rows_of(DATA, "paper")}
    assert {("gpt_30b", "v5p-128"), ("gpt_1b.py", "h200")} <= paper


def test_the_docs_quote_each_rows_peak():
    """Each line a row names (`quoted`: the README's headline table, the docs' tables) holds
    the row's peak, and every compile figure of the README's headline table is a row: a
    budget rewritten with `make budgets-update` shows which lines to rewrite."""
    wrong, quoting = [], []
    for row in DATA["rows"]:
        for file, fragment, decimals in row.get("quoted", []):
            figure = f"{row['peak_bytes'] / GiB:.{decimals}f}"
            lines = [ln for ln in (budgets.REPO / file).read_text().splitlines() if fragment in ln]
            assert lines, f"{row['name']}: {file} has no line with {fragment!r}"
            wrong += [
                f"{row['name']}: {file} quotes {ln!r}, not {figure}"
                for ln in lines
                if figure not in ln
            ]
            quoting += [ln for ln in lines if file == "README.md"]
    assert not wrong, "\n".join(wrong)
    readme = (budgets.REPO / "README.md").read_text().splitlines()
    unbudgeted = [ln for ln in readme if "**compile-only:**" in ln and ln not in quoting]
    assert not unbudgeted, f"README compile figures without a budget row: {unbudgeted}"


ROW = {"name": "r", "suite": "default", "target": "v5p-8", "config": "tiny", "overrides": {}}


def test_a_rise_past_the_tolerance_names_the_row_and_how_to_update():
    row = {**ROW, "peak_bytes": 100 * GiB // 100}
    state, line = budgets.verdict(row, int(1.44 * GiB), 0.02)
    assert state == "rose"
    assert line.startswith("r (v5p-8): peak 1.440 GiB a device, +44.0% against its budget of 1.000")
    assert "make budgets-update" in line and "tests/memory_budgets.json" in line
    assert budgets.verdict(row, int(1.01 * GiB), 0.02)[0] == "ok"
    assert budgets.verdict(row, int(0.9 * GiB), 0.02)[0] == "fell"


def test_update_rewrites_the_measured_rows_only(tmp_path):
    data = {"tolerance": 0.02, "rows": [{**ROW, "peak_bytes": 5}, {**ROW, "name": "s"}]}
    report = {
        "peak_memory_per_device_bytes": 3 * GiB,
        "memory_per_device_bytes": {"arguments": GiB, "temporaries": 2 * GiB},
        "device_kind": "TPU v5",
    }
    path = tmp_path / "b.json"
    budgets.write(budgets.updated(data, {"r": report}), path)
    rows = budgets.load(path)["rows"]
    assert rows[0]["peak_bytes"] == 3 * GiB and rows[0]["peak_gib"] == 3.0
    assert rows[0]["measured"].endswith(", TPU v5")
    assert rows[1] == {**ROW, "name": "s"}


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"tolerance": 0.02, "rows": [ROW]}))
    assert budgets.main(["--file", str(path), "--only", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no budget row named ['nope']; the rows are: r" in err
    path.write_text("{")
    assert budgets.main(["--file", str(path)]) == 2
    assert "cannot read the budgets file" in capsys.readouterr().err
