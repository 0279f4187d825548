"""`tools.predict`: Seq1F1B over 1F1B on 4 and 8 stages from one-layer unit costs,
estimated for an H200 compiled for here (the timed path runs in test_accel)."""

import json
import os
from pathlib import Path

import pytest
from helpers import needs_plugin, run_python

from seqpipe.tools import accel, predict

REPO = Path(__file__).resolve().parent.parent
# The accelerator bench's tiny gpt_1b with 4 layers: S = 4 divides them, S = 8 does not.
TINY = [*accel.QUICK, "--config.model.num_layers=4"]


@needs_plugin
@pytest.mark.slow  # compiles every unit for an H200: 100 s on 2 cores
def test_units_estimated_for_an_h200_predict_each_table(tmp_path):
    out = tmp_path / "prediction.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    args = (*TINY, "--predict", "seq1f1b:2@none", "--topology", "h200", "--json", str(out))
    proc = run_python("-m", "seqpipe.tools.predict", *args, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pred = json.loads(out.read_text())
    assert pred["costs"] == "estimated for NVIDIA H200 (step_cost's H200 roofline)"
    assert (pred["remat"], pred["microbatches"], pred["stages_skipped"]) == ("none", 8, [8])
    one, seq = pred["rows"]
    assert [(r["stages"], r["label"]) for r in pred["rows"]] == [
        (4, "1f1b"),
        (4, "seq1f1b K2 uniform"),
    ]
    assert seq["speedup_over_1f1b"] == pytest.approx(one["predicted_s"] / seq["predicted_s"])
    for r in (one, seq):
        units = r["unit_s"]
        # A backward moves more than its forward; a tick waits for its busiest stage.
        assert 0 < units["F"] < units["B"] and units["W"] == 0
        assert r["predicted_s"] > 8 * (units["F"] + units["B"])
        assert 0 < r["bubble"] < 1 and 0 < r["mfu"] < 1  # over the H200's peak
    assert "| 4 | seq1f1b K2 uniform |" in proc.stdout


def test_a_prediction_names_a_seq1f1b_variant():
    assert predict.parse("seq1f1b:4@none") == (4, "none")
    assert predict.parse("seq1f1b:8") == (8, None)
    for name, message in (
        ("1f1b", "1f1b: name seq1f1b:K or seq1f1b:K@REMAT, K in 1, 2, 4, 8"),
        ("seq1f1b:3", "seq1f1b:3: name seq1f1b:K or seq1f1b:K@REMAT"),
        ("seq1f1b:x", "seq1f1b:x: name seq1f1b:K"),
        ("seq1f1b:4@fast", "seq1f1b:4@fast: unknown remat 'fast'; choose from full,"),
    ):
        with pytest.raises(ValueError) as e:
            predict.parse(name)
        assert str(e.value).startswith(message), e.value


@pytest.mark.parametrize(
    "args, message",
    [
        (["--topology", "h100-8"], "--topology h100-8: the estimate is fitted to one H200"),
        (["--predict", "seq1f1b:2", "--config.model.num_layers=3"], "--predict: model.num_"),
        (
            ["--config.mesh.context=2", "--config.pipeline.schedule=seq1f1b"],
            "python -m seqpipe.tools.predict measures stages of one device each; mesh.context=2",
        ),
    ],
)
def test_bad_input_is_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        predict.main([*TINY, *args])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {message}"), line
