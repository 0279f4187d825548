"""The planner (`python -m seqpipe.plan`): its search space, its memory model against
compiled steps, its ranking, its output, and its one-line refusals."""

import dataclasses
import json
import types

import jax
import pytest
from helpers import run_of, run_python

from seqpipe.models import model, moe
from seqpipe.plan import bounds, memory, plan, rank, render, search, space, timing
from seqpipe.plan.space import Candidate, Problem
from seqpipe.run import config as config_lib
from seqpipe.train import aot

GPT_1B_ON_8 = Problem(
    num_layers=24, num_heads=16, num_kv_heads=16, devices=8, seq_len=8192, global_batch=32
)


def test_every_mesh_uses_every_device_and_splits_the_layers():
    meshes = space.meshes(GPT_1B_ON_8)  # (data, stage, context, tensor)
    assert (1, 8, 1, 1) in meshes and (2, 2, 1, 2) in meshes and (1, 2, 4, 1) in meshes
    for d, s, c, t in meshes:
        assert d * s * c * t == 8 and 24 % s == 0 and s >= 2 and 32 % d == 0 and 16 % t == 0


def test_context_sizes_are_candidates_whose_pieces_are_whole_blocks():
    """Context sizes 1, 2, 4, 8 dividing the devices the stages and tensor leave; each
    segment cut in 2C pieces of a multiple of the block, as the trainer requires."""
    cands = space.candidates(GPT_1B_ON_8)
    assert {c.context for c in cands} == {1, 2, 4}  # 8 would leave one stage
    split = [c for c in cands if c.context > 1]
    assert {c.schedule for c in split} == set(space.SCHEDULES)
    for c in split:
        length = 8192 // c.segments
        assert length // (2 * c.context) % space.BLOCK == 0, c.label  # a piece
        assert length // c.context % c.tensor == 0, c.label  # a device's, over tensor
        assert f" C={c.context} " in c.label and c.overrides()["mesh.context"] == c.context
    base = config_lib.load("gpt_1b", {})
    for c in split[:: max(1, len(split) // 20)]:  # a spread of them, each validated
        search.config_of(base, c, 8192, 32)


def test_segment_counts_split_the_sequence_into_equal_blocks():
    assert space.segment_counts(GPT_1B_ON_8, 1) == [2, 4, 8, 16, 32]
    odd = Problem(24, 16, 16, 8, 3 * 1024, 32)
    assert space.segment_counts(odd, 1) == [2, 4, 8]  # 3072 / (16 * 128) is not whole
    for k in space.segment_counts(odd, 2):
        assert odd.seq_len % (k * 128) == 0


def test_candidates_are_settings_the_trainer_accepts():
    base = config_lib.load("tiny", {})
    p = Problem(4, 4, 4, 4, 512, 16)
    cands = space.candidates(p)
    assert {c.schedule for c in cands} == set(space.SCHEDULES)
    for c in cands[:: max(1, len(cands) // 40)]:  # a spread of them, each validated
        search.config_of(base, c, 512, 16)


def test_a_sequence_no_segment_count_divides_is_refused():
    with pytest.raises(space.PlanError, match="--seq-len 1000: no segment count"):
        space.check(Problem(24, 16, 16, 8, 1000, 32))


def test_the_verdict_rejects_only_beyond_the_models_error():
    budget = 100
    assert bounds.verdict(int(budget / bounds.HIGH), budget) == "fits"
    assert bounds.verdict(budget, budget) == "boundary"
    assert bounds.verdict(int(budget / bounds.LOW) + 1, budget) == "over"
    assert bounds.verdict(int(budget / bounds.LOW) - 1, budget) == "boundary"


def _row(label, step, mem, verdict="fits", **extra):
    c = Candidate(1, 2, 1, "1f1b", 2, 1, 1, "full", "full")
    return {
        "candidate": c,
        "label": label,
        "step_s": step,
        "memory_per_device_bytes": mem,
        "memory_source": "estimated",
        "verdict": verdict,
        "bubble": 0.1,
        "tokens_per_s": 1 / step,
        "mfu": None,
        **extra,
    }


def test_ranking_and_reasons():
    rows = [
        _row("slow", 2.0, 10),
        _row("fast but over", 0.5, 10**12, verdict="over"),
        _row("fast compiled", 1.0, 20, memory_source="compiled", fits=True),
        _row("faster, did not fit", 0.8, 300, memory_source="compiled", fits=False),
        {"candidate": None, "label": "bad", "invalid": "no"},
        _row("as fast, leaner, estimated", 1.0, 10),
    ]
    assert [r["label"] for r in rank.ranked(rows)] == [
        "fast compiled",
        "as fast, leaner, estimated",
        "slow",
    ]
    best = rank.winner(rows)
    assert best["label"] == "fast compiled"
    assert rank.reason(rows[0], best, 100) == "slower than the winner by 100.0%"
    assert rank.reason(rows[1], best, 100).startswith("does not fit (estimated)")
    assert "over by" in rank.reason(rows[3], best, 100)
    assert rank.reason(rows[4], best, 100).startswith("not a valid setting")


def test_tries_spent_is_not_fits_nowhere():
    """Where the compile tries run out on candidates that did not fit, the planner says so
    and names the leanest candidate left, rather than that the model fits nowhere."""
    target = types.SimpleNamespace(name="h200-8")
    gib = 2**30
    rows = [
        _row("tried", 1.0, 80 * gib, memory_source="compiled", fits=False),
        _row("lean", 2.0, 60 * gib),
        _row("leaner", 3.0, 50 * gib, verdict="boundary"),
    ]
    line = plan.no_winner(rows, 100 * gib, target, 3)
    assert line.startswith("no candidate confirmed on h200-8 in 3 compiles"), line
    assert "need 80.0 GiB or more of 100.0" in line and "2 more are estimated to fit" in line
    assert "the leanest leaner at 50.0 GiB" in line and "--compile" in line
    assert plan.no_winner(rows[:1], 100 * gib, target, 3).startswith("the model fits nowhere")


def _tiny_rows(cands, rates):
    base = config_lib.load("tiny", {})
    return [search.evaluate(base, c, 512, 16, rates, 2**40, validate=True) for c in cands]


TINY = [
    Candidate(2, 2, 1, "1f1b", 2, 1, 1, "full", "full"),
    Candidate(1, 4, 1, "seq1f1b", 4, 4, 1, "full", "none"),
    Candidate(1, 2, 2, "seq_zb_h1", 4, 2, 1, "minimal", "dots"),
    Candidate(1, 2, 1, "seq1f1b_interleaved", 2, 2, 2, "full", "full_layer"),
    Candidate(1, 2, 1, "seq1f1b", 4, 2, 1, "full", "full", context=2),
]


def _sampled(candidates, default):
    """The candidates, those not in `default` under `make test-all` (each compile is
    seconds on 2 cores)."""
    return [
        c if i in default else pytest.param(c, marks=pytest.mark.slow)
        for i, c in enumerate(candidates)
    ]


def _id(c) -> str:
    return f"{c.schedule}-{c.data}x{c.stage}x{c.tensor}-C{c.context}-{c.remat}"


@pytest.mark.parametrize("c", _sampled(TINY, (2, 4)), ids=_id)
def test_memory_estimate_is_never_more_pessimistic_than_pruning_trusts(c):
    """The boundary check: the analytic model alone rejects a candidate only when LOW times
    its estimate exceeds the budget, so no compiled peak may fall below LOW times its
    estimate. Here on CPU, across schedules, remat policies and meshes; on the targets,
    scripts/plan_memory_agreement.py (docs/planner.md)."""
    from seqpipe.targets import gpu_topology

    rates = timing.rates_for(gpu_topology.parse("h200-8"))
    (row,) = _tiny_rows([c], rates)
    report = aot.compile_config(row["config"], jax.devices()[: c.devices], with_evaluation=False)
    ratio = report["peak_memory_per_device_bytes"] / row["memory_per_device_bytes"]
    assert ratio >= bounds.LOW, (row["label"], ratio)


MOE = {"model.mlp": "swiglu", "model.num_experts": "4", "model.expert_d_ff": "64"}
MOE_CANDIDATES = [
    Candidate(2, 2, 1, "1f1b", 2, 1, 1, "full", "full"),
    Candidate(2, 2, 1, "seq1f1b", 4, 4, 1, "full", "none"),
    Candidate(2, 2, 2, "seq_zb_h1", 4, 2, 1, "minimal", "dots"),
    Candidate(2, 2, 1, "seq1f1b", 4, 2, 1, "full", "full", context=2),
]


@pytest.mark.parametrize("c", _sampled(MOE_CANDIDATES, (2, 3)), ids=_id)
def test_a_mixtures_estimate_is_within_the_bounds_pruning_and_labels_trust(c):
    """A mixture (its experts over 2 data replicas): each compiled peak within [LOW, HIGH]
    times its estimate, so pruning drops none that fits and `fits` holds (CPU: 0.96 to
    1.58 on 2026-12-07)."""
    from seqpipe.targets import gpu_topology

    base = config_lib.load("tiny", MOE)
    rates = timing.rates_for(gpu_topology.parse("h200-8"))
    row = search.evaluate(base, c, 512, 16, rates, 2**40, validate=True)
    report = aot.compile_config(row["config"], jax.devices()[: c.devices], False)
    ratio = report["peak_memory_per_device_bytes"] / row["memory_per_device_bytes"]
    assert bounds.LOW <= ratio <= bounds.HIGH, (row["label"], ratio)


def test_a_candidates_spec_is_its_models():
    """The same candidate of two models (or sequences) gets each its own spec: a spec
    cached by the candidate alone priced a mixture as the dense model estimated before it
    (2.66x under its compiled peak)."""
    c = MOE_CANDIDATES[0]
    dense = search.spec_of(search.config_of(config_lib.load("tiny", {}), c, 512, 16), c)
    mixture = search.spec_of(search.config_of(config_lib.load("tiny", MOE), c, 512, 16), c)
    longer = search.spec_of(search.config_of(config_lib.load("tiny", {}), c, 1024, 16), c)
    assert (dense.cfg.num_experts, mixture.cfg.num_experts) == (0, 4)
    assert sum(longer.sequence_lengths) == 2 * sum(dense.sequence_lengths)


def test_a_mixtures_state_holds_its_share_of_the_experts():
    """The state a device holds: a replica's share of every expert and its moments, the
    other weights whole; and no mesh whose data replicas do not divide the experts."""
    cfg = run_of(config_lib.load("tiny", MOE)).model
    one, two = (memory.state_bytes(cfg, cfg.num_layers, d, False) for d in (1, 2))
    shapes = model.init_params(cfg, jax.random.key(0))
    expert_bytes = sum(shapes["layers"][k].size * 4 for k in moe.EXPERTS)
    assert one["params"] - two["params"] == expert_bytes // 2
    assert one["moments"] - two["moments"] == 2 * expert_bytes // 2
    dense, mixture = Problem(4, 4, 4, 16, 512, 16), Problem(4, 4, 4, 16, 512, 16, num_experts=2)
    assert {d for d, *_ in space.meshes(dense)} == {1, 2, 4, 8}
    assert {d for d, *_ in space.meshes(mixture)} == {1, 2}


def test_the_time_model_prices_the_experts_dispatch_over_data():
    """A unit's forward receives the experts' all-gather and reduce-scatter over the data
    link, its backward as much again per pass; over a step of qwen3_30b_a3b on 8 H200s
    (2 x 4, M = K = 8, full_layer) that is within 1.10x of the 94.3 GB its compiled HLO
    receives over `data`, and the all-to-all's the 515.4 GB it exchanges (docs/models.md)."""
    from seqpipe.targets import gpu_topology

    c = Candidate(2, 4, 1, "seq1f1b", 8, 8, 1, "full", "full_layer")
    config = search.config_of(config_lib.load("qwen3_30b_a3b", {}), c, 32768, 16, False)
    spec = dataclasses.replace(search.spec_of(config, c), remat="full_layer")
    alone = dataclasses.replace(spec, cfg=dataclasses.replace(spec.cfg, expert_parallel=1))
    rates = timing.rates_for(gpu_topology.parse("h200-8"))
    split, whole = timing.unit_cost(spec, 1, rates), timing.unit_cost(alone, 1, rates)
    ep = timing.expert_dispatch_bytes(spec.cfg, spec.chunk_layers, 32768 / 8, 2)
    assert split["F"] - whole["F"] == pytest.approx(ep / rates.data_link)
    assert split["B"] - whole["B"] == pytest.approx(3 * ep / rates.data_link)  # 2 recomputes
    assert 1.0 < 4 * ep * 8 * 8 / 94.3e9 < 1.11
    # By all-to-all, capacity 1.25: the 515.4 GB the compiled HLO exchanges over `data`.
    moe = dict(moe_capacity_factor=1.25, moe_dispatch="all_to_all")
    exchanged = dataclasses.replace(spec.cfg, **moe)
    ep = timing.expert_dispatch_bytes(exchanged, spec.chunk_layers, 32768 / 8, 2)
    assert 4 * ep * 8 * 8 / 515.4e9 == pytest.approx(1.0, abs=1e-3)


def _heavy_and_lean():
    """Two tiny seq1f1b candidates on 4 CPU devices, `remat=none` and `full`, each compiled
    (once, by the `compile_step` returned), and a budget between their compiled peaks."""
    from seqpipe.plan import confirm
    from seqpipe.targets import gpu_topology

    rates = timing.rates_for(gpu_topology.parse("h200-8"))
    heavy, lean = _tiny_rows(
        [
            Candidate(1, 4, 1, "seq1f1b", 4, 4, 1, "full", "none"),
            Candidate(1, 4, 1, "seq1f1b", 4, 4, 1, "full", "full"),
        ],
        rates,
    )
    devices, peaks = jax.devices()[:4], {}

    def compile_step(config, devices, with_evaluation):  # each config compiled once
        if id(config) not in peaks:
            peaks[id(config)] = aot.compile_config(config, devices, with_evaluation)
        return peaks[id(config)]

    big = confirm.confirm(heavy, devices, 2**40, compile_step)["memory_per_device_bytes"]
    small = confirm.confirm(lean, devices, 2**40, compile_step)["memory_per_device_bytes"]
    assert small < big, (small, big)
    return heavy, lean, devices, compile_step, big, (small + big) // 2


def _priced(base, label, step, estimate):
    """`base`'s row under another label, step time and memory estimate."""
    return base | {"label": label, "step_s": step, "memory_per_device_bytes": estimate}


def test_a_compile_over_its_estimate_steers_the_next_tries_to_leaner_candidates():
    """After a compile needs twice its estimate, a candidate over the budget at twice its
    estimate is passed over (left estimated), and the try goes to one that fits. The
    compiles are real (two tiny steps on 4 CPU devices), the estimates set by hand."""
    from seqpipe.plan import confirm

    heavy, lean, devices, compile_step, big, budget = _heavy_and_lean()

    rows = [
        _priced(heavy, "fastest, low by 2x", 1.0, big // 2),
        _priced(heavy, "next, over at 2x", 2.0, int(budget * 0.6)),
        _priced(lean, "lean", 3.0, budget // 4),
    ]
    out = confirm.confirm_best(rows, devices, budget, 1, 2, lambda label: None, compile_step)
    assert [r.get("memory_source") for r in out] == ["compiled", "estimated", "compiled"]
    assert [r.get("fits") for r in out] == [False, None, True]
    assert rank.winner(out)["label"] == "lean"


def test_json_last_line_holds_the_winner_and_the_others():
    from seqpipe.targets import gpu_topology

    rows = _tiny_rows(TINY[:3], timing.rates_for(gpu_topology.parse("h200-8")))
    best, others = rows[0] | {"memory_source": "compiled", "fits": True}, rows[1:]
    cmd = render.command("tiny", best["candidate"], 512, 16, {"model.attention": "xla"})
    out = json.loads(render.last_line(best, cmd, others, {"topology": "h200-8"}))
    assert out["winner"]["command"] == cmd and cmd.startswith("python train.py --config tiny")
    assert out["winner"]["memory_per_device_bytes"] == best["memory_per_device_bytes"]
    assert [r["label"] for r in out["candidates"]] == [r["label"] for r in others]
    assert "--config.model.attention=xla" in cmd and "--config.mesh.stage=2" in cmd


def test_a_sequence_too_long_for_one_device_picks_context_parallelism():
    """tiny (one K/V head: no tensor split) at 32768 tokens on 8 devices, with a budget
    under every context-1 candidate's estimate by more than the model's error: the search
    ranks a context-split candidate first, and it lowers its own estimate by splitting
    the positions (the parameters and moments stay whole). The space is cut to a few
    dozen candidates (1F1B and Seq1F1B, one depth, `full` remat) to stay fast."""
    import functools

    from seqpipe.targets import gpu_topology

    base = config_lib.load("tiny", {"model.num_kv_heads": "1"})
    p, rates = Problem(4, 4, 1, 8, 32768, 8), timing.rates_for(gpu_topology.parse("h200-8"))
    bar = types.SimpleNamespace(tick=lambda note="": None, done=lambda: None)
    cut = functools.partial(space.candidates, remats=("full",))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(space, "SCHEDULES", ("1f1b", "seq1f1b"))
        mp.setattr(space, "DEPTHS", ("minimal",))
        mp.setattr(space, "candidates", cut)
        everyone = plan.estimate_some(base, p, rates, 2**40, cut(p))
        least = {}
        for r in everyone:
            c = r["candidate"].context
            least[c] = min(least.get(c, 2**63), r["memory_per_device_bytes"])
        assert set(least) == {1, 2, 4} and least[4] < least[2] < least[1], least
        budget = int(least[1] * bounds.LOW) - 1  # every context-1 candidate is over
        rows = plan.estimate_all(base, p, rates, budget, lambda *a: bar, 3)
    ranked = rank.ranked(rows)
    assert ranked and all(r["candidate"].context > 1 for r in ranked)
    best = ranked[0]
    assert best["memory_per_device_bytes"] * bounds.LOW <= budget, best["label"]
    assert best["candidate"].overrides()["mesh.context"] == best["candidate"].context > 1


def test_a_context_candidate_is_confirmed_and_printed_with_its_mesh_context():
    """The confirmation compiles the candidate's config with its mesh.context (the
    compiled step all-gathers K/V), and the winner's command and --json carry it."""
    from seqpipe.plan import confirm
    from seqpipe.targets import gpu_topology

    (row,) = _tiny_rows(TINY[-1:], timing.rates_for(gpu_topology.parse("h200-8")))
    reports = []

    def compile_step(config, devices, with_evaluation):
        reports.append(aot.compile_config(config, devices, with_evaluation))
        return reports[-1]

    best = confirm.confirm(row, jax.devices()[:4], 2**40, compile_step)
    assert best["memory_source"] == "compiled" and best["fits"]
    assert reports[0]["collectives"]["all-gather"] > 0
    assert best["memory_per_device_bytes"] >= bounds.LOW * row["memory_per_device_bytes"]
    cmd = render.command("tiny", best["candidate"], 512, 16, {})
    assert "--config.mesh.context=2" in cmd and "--config.mesh.stage=2" in cmd
    out = json.loads(render.last_line(best, cmd, [], {"topology": "h200-8"}))
    assert out["winner"]["keys"]["mesh.context"] == 2 and " C=2 " in out["winner"]["label"]


def _plan(*args):
    return run_python("-m", "seqpipe.plan", *args, timeout=600)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config", "tiny", "--topology", "v9-8"], "is not a TPU slice or GPU system name"),
        (
            ["--config", "gpt_1b", "--topology", "h200-8", "--seq-len", "1000"],
            "--seq-len 1000: no segment count",
        ),
        (
            [
                "--config",
                "gpt_30b",
                "--topology",
                "v5e-4",
                "--seq-len",
                "65536",
                "--global-batch",
                "4",
            ],
            "fits nowhere on v5e-4",
        ),
        # 0 is refused with what was typed, not read as "the config's"
        (["--config", "tiny", "--topology", "v5p-8", "--global-batch", "0"], "--global-batch 0:"),
        (["--config", "tiny", "--topology", "v5p-8", "--seq-len", "0"], "--seq-len 0:"),
    ],
)
def test_bad_input_is_one_line(args, message):
    out = _plan(*args)
    assert out.returncode == 2 and out.stdout == ""
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], out.stderr[-2000:]


@pytest.mark.parametrize(
    "args",
    [
        ["--topology", "v9-8"],
        ["--topology", "v5p-8", "--seq-len", "0"],
        ["--topology", "v5p-8", "--no-such-flag"],
    ],
)
def test_a_json_run_that_fails_ends_with_its_error_as_json(args):
    out = _plan("--config", "tiny", "--json", *args)
    error = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert out.returncode == 2 and len(error) == 1, out.stderr[-2000:]
    assert out.stdout.splitlines() == [json.dumps({"error": error[0].removeprefix("error: ")})]


@pytest.mark.slow
def test_the_planner_end_to_end_on_a_small_slice():
    """tiny on a v5p-8 (4 chips): the table, the winner compiled and fitting, its command,
    and the JSON line (several minutes on 2 busy cores: the TPU compile)."""
    out = _plan(
        "--config", "tiny", "--topology", "v5p-8", "--seq-len", "512", "--compile", "1", "--json"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    winner = last["winner"]
    assert winner["memory_source"] == "compiled" and winner["fits"]
    assert winner["command"].startswith("python train.py --config tiny")
    assert winner["memory_per_device_bytes"] <= last["budget_bytes"]
    assert all(r["step_s"] >= winner["step_s"] for r in last["candidates"] if r.get("fits") is True)
    assert "time model: v5p's peak" in out.stdout and "not calibrated" in out.stdout
    assert [c["setting"] for c in last["comparison"]][0] == "README's recommended"


def test_the_planner_plans_a_mixture():
    """A mixture of 4 experts on a v5p-8: the winner compiles and fits, its data replicas
    divide the experts, and its command carries the model's keys."""
    moe_flags = [f"--config.{k}={v}" for k, v in MOE.items()]
    out = _plan(
        "--config", "tiny", *moe_flags, "--topology", "v5p-8", "--seq-len", "512",
        "--compile", "1", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    winner = json.loads(out.stdout.strip().splitlines()[-1])["winner"]
    assert winner["memory_source"] == "compiled" and winner["fits"]
    assert all(flag in winner["command"] for flag in moe_flags), winner["command"]
    assert 4 % int(winner["command"].split("--config.mesh.data=")[1].split()[0]) == 0


def test_the_lower_bound_is_below_every_estimate():
    """Pruning by the bound drops only candidates the time model would rank lower."""
    from seqpipe.targets import gpu_topology

    base, rates = config_lib.load("tiny", {}), timing.rates_for(gpu_topology.parse("h200-8"))
    cands = space.candidates(Problem(4, 4, 4, 8, 512, 16))
    for c in cands[:: max(1, len(cands) // 12)]:
        row = search.evaluate(base, c, 512, 16, rates, 2**40)
        if "invalid" not in row:
            assert search.lower_bound(base, c, 512, 16, rates) <= row["step_s"], c.label


def test_a_candidate_the_compiler_refuses_is_a_reason_not_a_crash():
    from seqpipe.plan import confirm

    row = {
        "candidate": None,
        "label": "x",
        "config": None,
        "memory_per_device_bytes": 1,
        "verdict": "fits",
        "step_s": 1.0,
    }
    out = confirm.confirm(row, jax.devices()[:1], 2**30, aot.compile_config)
    assert out["fits"] is False and rank.reason(out, None, 2**30).startswith(
        "does not compile for the target: "
    )


def test_a_candidates_estimate_does_not_depend_on_what_was_estimated_before():
    """Candidates that differ only in remat share one table, built under `full`; it was
    built from whichever policy came first, so every policy of that shape was priced as
    that one (llama3_1_8b on v5p-64: 4x2x4 interleaved_1f1b M=4 V=4 remat=none estimated
    at 83.6 GiB as `dots` was, compiled at 152.8)."""
    base = config_lib.load("tiny", {"model.num_layers": "4"})
    rates = timing.CPU

    def estimates(order):
        search._TABLES.clear()
        out = {}
        for remat in order:
            c = Candidate(1, 2, 1, "seq1f1b", 4, 2, 1, "full", remat)
            out[remat] = search.evaluate(base, c, 512, 8, rates, 2**40)["memory_per_device_bytes"]
        return out

    first_none, first_full = estimates(("none", "full")), estimates(("full", "none"))
    assert first_none == first_full
    assert first_none["none"] > first_none["full"]  # every residual kept, not the input


def test_mfu_at_a_tpus_peak_stays_below_one_where_attention_dominates():
    """The time model prices splash's causal half of the scores; MFU counted the full
    L x L score matrix (PaLM's), so the 8B at 65536 on a v5p-64 read 131%. Counted as
    the kernel computes it, MFU at the chip's peak is a ceiling below 100%."""
    from seqpipe.targets import topology

    base = config_lib.load("tiny", {})
    rates = timing.rates_for(topology.parse("v5p-8"))
    c = Candidate(1, 2, 1, "seq1f1b", 4, 4, 1, "full", "dots")
    row = search.evaluate(base, c, 8192, 4, rates, 2**40)
    assert 0.5 < row["mfu"] < 1.0, row["mfu"]


@pytest.mark.parametrize("attention", ["xla", "blockwise"])
def test_dots_keeps_no_attention_scores_and_the_residual_fit_is_exact(attention):
    """`dots` kept every matmul output, attention's score blocks inside `blockwise` too
    (its own backward never reads them): the 8B at 65536 on an H200 compiled at 2.7 TiB
    a GPU, estimated at 99 GiB by a model that traced one length and scaled it. A layer's
    residuals under `dots` and `layer` now do not grow with the K/V length, and the
    model's fit in the segment and K/V length predicts a third trace to the byte."""
    import dataclasses

    from seqpipe.models.model import GPTConfig
    from seqpipe.plan import memory

    tiny = config_lib.load("tiny", {})
    cfg = dataclasses.replace(GPTConfig.from_config(tiny.model), attention=attention)
    traced = memory._layer_residuals
    for remat in ("dots", "layer"):
        assert traced(cfg, remat, 128) == traced(cfg, remat, 384), remat
    for remat in ("none", "dots"):
        assert memory.residual_bytes(cfg, remat, 128, 1024) == traced(cfg, remat, 896), remat


def test_dots_keeps_a_fused_kernels_output_and_log_sum_exp_for_its_backward():
    """Under `dots`, `blockwise` keeps what its backward reads besides its inputs (the
    output, [b, L, H x E] in the compute dtype, and the float32 log-sum-exp, [b, H, L]),
    so the backward does not run its forward again; `xla` attention keeps neither."""
    import dataclasses

    from seqpipe.models.model import GPTConfig
    from seqpipe.plan import memory

    cfg = GPTConfig.from_config(config_lib.load("tiny", {}).model)
    kept = {
        a: memory._layer_residuals(dataclasses.replace(cfg, attention=a), "dots", 128)
        for a in ("xla", "blockwise")
    }
    act = 2 if cfg.dtype == "bfloat16" else 4
    out, lse = 128 * cfg.d_model * act, cfg.num_heads * 128 * 4
    assert kept["blockwise"] - kept["xla"] == out + lse


def test_the_tries_left_go_to_faster_candidates_estimated_over_the_budget():
    """A faster candidate estimated over the budget, within the model's error, is passed
    over until one fits; the tries left then compile the faster ones, leanest estimate
    first, and one that fits wins. The compiles are real (tiny steps on 4 CPU devices)."""
    from seqpipe.plan import confirm

    heavy, lean, devices, compile_step, big, budget = _heavy_and_lean()

    rows = [
        _priced(heavy, "fastest, does not fit", 0.5, int(budget * 1.3)),
        _priced(lean, "faster, fits", 1.0, int(budget * 1.2)),
        _priced(lean, "slow, fits", 3.0, budget // 4),
    ]
    out = confirm.confirm_best(rows, devices, budget, 1, 3, lambda label: None, compile_step)
    assert [r.get("fits") for r in out] == [False, True, True]
    best = rank.winner(out)
    assert best["label"] == "faster, fits" and confirm.unconfirmed(out, best) == []
    out = confirm.confirm_best(rows, devices, budget, 1, 2, lambda label: None, compile_step)
    assert [r.get("fits") for r in out] == [None, True, True]
    assert [r["label"] for r in confirm.unconfirmed(out, rank.winner(out))] == [rows[0]["label"]]


@pytest.mark.parametrize(
    "schedule, tensor, context",
    [("seq1f1b", 2, 1), ("seq_zb_h1", 1, 1), ("seq_zb_h1", 2, 1), ("seq1f1b", 1, 2)],
)
def test_the_models_residual_carry_is_the_executors(schedule, tensor, context):
    """Under a policy that keeps residuals, the model's carry is the executor's to the
    byte where segments are equal and attention keeps no scores (`blockwise`). A table
    that splits B from W keeps what W reads too: the 8B at 65536 under zb_h1 M=8 `dots`
    on an H200 was estimated at 997 GiB from the unsplit layer's residuals, compiled at
    1527. A layer's input and norms are whole on each tensor device: gpt_1b 1x2x4 zb_h1
    `dots` was estimated at 168 GiB with every residual split, compiled at 242. Under
    context parallelism `none` keeps each layer's local K/V prefix, out of the cache, so
    each segment has a pool of its own: within 0.01% (the first, with no prefix, keeps a
    few bytes less than the fit)."""
    import dataclasses

    from seqpipe.pipeline import carry
    from seqpipe.plan import memory

    base = config_lib.load("tiny", {"model.attention": "blockwise"})
    c = Candidate(1, 2, tensor, schedule, 4, 2, 1, "full", "full", context=context)
    full = search.spec_of(search.config_of(base, c, 512, 8, False), c)
    for remat in ("none", "dots", "layer"):
        exact = carry.breakdown(dataclasses.replace(full, remat=remat), 2)["carry"]
        got = memory.carry_bytes(full, 2, remat)
        assert got == pytest.approx(exact, rel=1e-4 if context > 1 else 0), remat


@pytest.mark.slow
def test_a_step_the_tpu_compiler_refuses_is_over_by_its_need():
    """libtpu raises on a step over HBM; the planner reads the need from the refusal (a
    lower bound on the peak), so the row does not fit by that much and the steering
    learns from it (3 minutes: tiny at 65536 tokens, `xla` attention, on a v5p-8)."""
    from seqpipe.plan import confirm
    from seqpipe.targets import topology

    target = topology.parse("v5p-8")
    target.prepare_env()
    base = config_lib.load("tiny", {"model.attention": "xla"})
    c = Candidate(1, 2, 1, "1f1b", 8, 1, 1, "full", "none")
    row = search.evaluate(base, c, 65536, 8, timing.rates_for(target), target.budget(), True)
    out = confirm.confirm(row, target.devices(), target.budget(), aot.compile_config)
    assert out["over_hbm"] and out["fits"] is False
    assert out["memory_per_device_bytes"] > target.budget()
    assert rank.reason(out, None, target.budget()).startswith(
        "does not fit (compiled): the TPU compiler refused it"
    )
