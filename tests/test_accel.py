"""The accelerator benchmark on CPU: end to end on a tiny model, and its HLO grouping."""

import json

import pytest

from seqpipe import bench
from seqpipe.tools import accel


def test_quick_end_to_end_through_bench_accelerator(tmp_path, capsys):
    out = tmp_path / "accel.json"
    argv = ["--accelerator", "--quick", "--variants", "1f1b,ref@dots", "--steps", "1"]
    assert bench.main(argv + ["--microbatches", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["1f1b", "ref@dots"]
    assert (result["attention"], result["microbatches"]) == ("blockwise", 4)  # `auto` on CPU
    assert (rows["ref@dots"]["microbatches"], rows["1f1b"]["microbatches"]) == (1, 4)
    # The reference with a remat policy, run second, is still what each row is over.
    ref = rows["ref@dots"]
    assert ref["vs_ref"] == 1.0
    assert rows["1f1b"]["vs_ref"] == pytest.approx(rows["1f1b"]["step_s"] / ref["step_s"])
    for r in rows.values():
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["compile_s"] > 0
        assert r["mfu"] is None and r["xla_temp_bytes"] > 0  # CPU: no peak in the table
        prof = r["profile"]
        assert prof["events_from"] == "host" and prof["matched_s"] > 0
        assert prof["ops"] > 0
        assert prof["mean_op_s"] == pytest.approx(prof["matched_s"] / prof["ops"])
        assert 0 < prof["busy_fraction"] == prof["matched_s"] / r["step_s"]
        assert abs(sum(prof["groups_fraction"].values()) - 1) < 1e-9
        # The trace's ops were matched to their sources, not all left in "other".
        assert prof["groups_s"]["matmuls"] > 0 and prof["groups_s"]["attention"] > 0
        assert prof["groups_s"]["optimizer"] > 0
    assert rows["1f1b"]["profile"]["groups_s"]["pipeline buffers / grad accumulation"] > 0
    # Four micro-batches run each layer's operations four times.
    assert rows["1f1b"]["profile"]["ops"] > 2 * rows["ref@dots"]["profile"]["ops"]
    # And the compiled step says so too (`step_cost`), with an estimate for an H200.
    assert rows["1f1b"]["hlo_kernels"] > 2 * rows["ref@dots"]["hlo_kernels"] > 0
    for r in rows.values():
        assert r["hlo_bytes"] > 0 and r["h200_estimate_s"] > 0
    printed = capsys.readouterr().out
    assert "| 1f1b |" in printed and "blockwise attention, 4 micro-batches" in printed


def test_seq1f1b_over_1f1b_is_predicted_from_units_timed_here(tmp_path, capsys):
    out = tmp_path / "accel.json"
    argv = ["--accelerator", "--quick", "--variants=", "--predict", "seq1f1b:2@none"]
    argv += ["--config.model.num_layers=4", "--json", str(out)]  # S = 4 divides it, 8 not
    assert bench.main(argv) == 0
    pred = json.loads(out.read_text())["prediction"]
    assert (pred["remat"], pred["microbatches"], pred["stages_skipped"]) == ("none", 8, [8])
    one, seq = pred["rows"]
    assert [(r["stages"], r["label"]) for r in pred["rows"]] == [
        (4, "1f1b"),
        (4, "seq1f1b K2 uniform"),
    ]
    assert one["speedup_over_1f1b"] == 1.0
    assert seq["speedup_over_1f1b"] == pytest.approx(one["predicted_s"] / seq["predicted_s"])
    for r in (one, seq):
        units = r["unit_s"]  # one micro-batch's units on a middle stage
        assert units["F"] > 0 and units["B"] > 0 and units["W"] == 0
        # A synchronous pipeline takes at least a middle stage's own work, and idles some.
        assert r["predicted_s"] > 8 * (units["F"] + units["B"])
        assert 0 < r["bubble"] < 1 and r["mfu"] is None  # CPU: no peak
    printed = capsys.readouterr().out
    assert "| 4 | seq1f1b K2 uniform |" in printed and "(S = 8: does not divide" in printed
    assert "| variant |" not in printed  # no step variants were asked for


def test_classify_by_innermost_telling_frame():
    def ins(opcode, *stack, calls=()):
        return accel.classify({"opcode": opcode, "stack": list(stack)}, set(calls))

    model, attn = (
        ("/x/seqpipe/models/model.py", "layer"),
        ("/x/seqpipe/kernels/attention.py", "_probs"),
    )
    xent = ("/x/seqpipe/models/model.py", "_chunk_xent")
    pipe = ("/x/seqpipe/pipeline/executor.py", "write_slot")
    assert ins("fusion", model, pipe, calls={"dot"}) == "matmuls"
    assert ins("fusion", attn, model, pipe, calls={"dot"}) == "attention"
    kernel = ("/x/seqpipe/kernels/pallas_gpu.py", "_forward")
    assert (
        ins("custom-call", kernel, ("/x/seqpipe/pipeline/units.py", "SegmentUnit.body"))
        == "attention"
    )
    assert ins("dot", xent, ("/x/seqpipe/pipeline/units.py", "SegmentUnit.head")) == "cross-entropy"
    assert ins("fusion", ("/site/optax/_src/transform.py", "update_fn")) == "optimizer"
    assert ins("dynamic-update-slice", pipe) == "pipeline buffers / grad accumulation"
    assert ins("copy") == "copies" and ins("add", model) == "other"


def test_bad_variant_is_one_line(capsys):
    for variants, message in (
        ("ref,gpipe", "unknown gpipe; choose from ref, 1f1b, seq1f1b:1, seq1f1b:2, seq1f1b:4, "),
        ("ref@fast", "ref@fast: unknown remat 'fast'; choose from full, full_layer, layer, dots"),
    ):
        with pytest.raises(SystemExit) as e:
            accel.main(["--quick", "--variants", variants])
        assert e.value.code == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: --variants: {message}"), line
    for extra, message in (
        (["--predict", "1f1b"], "1f1b: name seq1f1b:K or seq1f1b:K@REMAT, K in 1, 2, 4, 8;"),
        (["--predict", "seq1f1b:3"], "seq1f1b:3: name seq1f1b:K or seq1f1b:K@REMAT, K in 1,"),
        (["--predict", "seq1f1b:4@fast"], "seq1f1b:4@fast: unknown remat 'fast'; choose from"),
        (["--predict", "seq1f1b:2"], "model.num_layers=2 splits over none of 4 or 8 stages;"),
    ):
        with pytest.raises(SystemExit) as e:
            accel.main(["--quick", "--variants=", *extra])
        assert e.value.code == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: --predict: {message}"), line
    for m, message in (
        ("3", "train.global_batch_size=8 must be a positive multiple of mesh.data * "),
        ("0", "--microbatches=0 must be at least 1"),
    ):
        with pytest.raises(SystemExit) as e:
            accel.main(["--quick", "--variants", "ref,seq1f1b:2", "--microbatches", m])
        assert e.value.code == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: {message}"), line


def test_a_variant_with_a_remat_policy_sets_it_and_keeps_its_schedule():
    from seqpipe.run import cli

    config, _ = cli.load_or_exit(["--config", "gpt_1b", *accel.QUICK], "x")
    c = accel.variant_config(config, "seq1f1b:4@none")
    assert (c.pipeline.schedule, c.pipeline.segments, c.pipeline.remat) == ("seq1f1b", 4, "none")
    assert accel.variant_config(config, "ref").pipeline.remat == config.pipeline.remat
    # Eight micro-batches unless told (a long-context batch has fewer rows); the reference one.
    assert c.pipeline.microbatches == accel.MICROBATCHES == 8
    assert accel.variant_config(config, "seq1f1b:8", 2).pipeline.microbatches == 2
    assert accel.variant_config(config, "ref", 2).pipeline.microbatches == 1
    for name in accel.DEFAULT_VARIANTS.split(","):
        assert accel.unknown_variant(name) is None, name
