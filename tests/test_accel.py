"""The accelerator benchmark on CPU: end to end on a tiny model, and its HLO grouping."""

import json

import pytest

from seqpipe.tools import accel, bench


def test_quick_end_to_end_through_bench_accelerator(tmp_path, capsys):
    out = tmp_path / "accel.json"
    argv = ["--accelerator", "--quick", "--variants", "ref,1f1b", "--steps", "1"]
    assert bench.main(argv + ["--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["ref", "1f1b"]
    assert rows["ref"]["vs_ref"] == 1.0 and rows["1f1b"]["vs_ref"] > 0
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
    # Eight micro-batches run each layer's operations eight times.
    assert rows["1f1b"]["profile"]["ops"] > 2 * rows["ref"]["profile"]["ops"]
    # And the compiled step says so too (`step_cost`), with an estimate for an H200.
    assert rows["1f1b"]["hlo_kernels"] > 2 * rows["ref"]["hlo_kernels"] > 0
    for r in rows.values():
        assert r["hlo_bytes"] > 0 and r["h200_estimate_s"] > 0
    assert "| 1f1b |" in capsys.readouterr().out


def test_classify_by_innermost_telling_frame():
    def ins(opcode, *stack, calls=()):
        return accel.classify({"opcode": opcode, "stack": list(stack)}, set(calls))

    model, attn = ("/x/seqpipe/model.py", "layer"), ("/x/seqpipe/attention.py", "_probs")
    xent = ("/x/seqpipe/model.py", "_chunk_xent")
    pipe = ("/x/seqpipe/pipeline.py", "write_slot")
    assert ins("fusion", model, pipe, calls={"dot"}) == "matmuls"
    assert ins("fusion", attn, model, pipe, calls={"dot"}) == "attention"
    assert ins("dot", xent, ("/x/seqpipe/units.py", "SegmentUnit.head")) == "cross-entropy"
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


def test_a_variant_with_a_remat_policy_sets_it_and_keeps_its_schedule():
    from seqpipe import cli

    config, _ = cli.load_or_exit(["--config", "gpt_1b", *accel.QUICK], "x")
    c = accel.variant_config(config, "seq1f1b:4@none")
    assert (c.pipeline.schedule, c.pipeline.segments, c.pipeline.remat) == ("seq1f1b", 4, "none")
    assert accel.variant_config(config, "ref").pipeline.remat == config.pipeline.remat
    for name in accel.DEFAULT_VARIANTS.split(","):
        assert accel.unknown_variant(name) is None, name
