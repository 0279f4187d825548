"""Every schedule on one model and global batch, side by side, in one process.

    python -m seqpipe.bench [--config CONFIG] [--quick] [--json FILE] [--png FILE]
        [--config.key=value ...]
    python -m seqpipe.bench --accelerator ...   (`seqpipe.tools.accel`)

For gpipe, 1f1b, seq1f1b (K = 2, 4, 8; uniform and flops partitions) and the interleaved
variants, on the config's mesh: XLA's per-device peak temporary memory of the compiled
step (via `seqpipe.tools.memory`), executed over analytic FLOPs (`seqpipe.tools.flops`), the bubble
and step time the schedule table predicts under per-unit costs measured on this machine,
and the measured step time; then the un-pipelined reference step, the pipelined step on
a one-stage mesh against it (the machinery's overhead), and the predicted throughput of
Seq1F1B over 1F1B for S = 4 and 8 stages from the same unit timings.

Fake CPU devices share this machine's cores, so a measured pipelined step time is the
total work over the cores: it cannot show a bubble. The predicted times can: each unit
is timed alone, and a tick lasts as long as its slowest stage.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import time

import numpy as np

from seqpipe import schedule
from seqpipe.host import files
from seqpipe.pipeline import remat
from seqpipe.run import cli
from seqpipe.tools.tick_model import (
    PREDICT_MICROBATCHES,
    PREDICT_STAGES,
    QUICK_MODEL,
    UnitTimer,
    chunk_layers,
    label,
    median_seconds,
    predicted,
    prediction,
    unit_seconds,
    variant,
)

DEFAULT_CONFIG = "bench"
# (schedule, K, partition, V)
RUNS = (
    ("gpipe", 1, "uniform", 1),
    ("1f1b", 1, "uniform", 1),
    *(("seq1f1b", k, p, 1) for k in (2, 4, 8) for p in ("uniform", "flops")),
    ("interleaved_1f1b", 1, "uniform", 2),
    ("seq1f1b_interleaved", 2, "uniform", 2),
    ("seq1f1b_interleaved", 4, "uniform", 2),
    ("seq1f1b_interleaved", 4, "flops", 2),
    ("zb_h1", 1, "uniform", 1),
    ("seq_zb_h1", 4, "uniform", 1),
    ("seq_zb_h1", 4, "flops", 1),
)
QUICK_RUNS = (
    ("1f1b", 1, "uniform", 1),
    ("seq1f1b", 2, "uniform", 1),
    ("seq_zb_h1", 2, "uniform", 1),
)
# Every pipeline.remat policy is compiled for these (memory and FLOPs).
POLICY_RUNS = (
    ("1f1b", 1, "uniform", 1),
    ("seq1f1b", 4, "uniform", 1),
    ("seq_zb_h1", 4, "uniform", 1),
)
QUICK = QUICK_MODEL + (
    "--config.mesh.stage=2",
    "--config.pipeline.microbatches=2",
    "--config.pipeline.segments=2",
    "--config.train.global_batch_size=2",
    "--config.train.seq_len=32",
)
NOTE = (
    "Fake CPU devices share this machine's cores: a measured pipelined step time is the "
    "total work over the cores and cannot show a bubble. Predicted times can: every unit is "
    "timed alone and a synchronous tick lasts as long as its slowest stage."
)


def place_params(params, abstract):
    import jax  # after main() sets the XLA flags

    return jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), params, abstract)


def compile_step(config) -> dict:
    """The pipelined step compiled for `config`, from abstract inputs (`seqpipe.tools.memory`)."""
    from seqpipe.tools import memory  # jax: after main() sets the XLA flags

    spec, step, p_abs, t_abs = memory.abstract_step(config)
    start = time.perf_counter()
    compiled = step.lower(p_abs, t_abs).compile()
    return {
        "spec": spec,
        "compiled": compiled,
        "params": p_abs,
        "tokens": t_abs,
        "compile_s": time.perf_counter() - start,
    }


def run_one(config, step, params, tokens, timer, repeats: int, count_flops: bool = True) -> dict:
    """One schedule's memory, FLOPs, predicted (given a `timer`) and measured step time;
    `step` from `compile_step`."""
    import jax  # after main() sets the XLA flags

    from seqpipe.parallel import layout  # jax: after main() sets the XLA flags
    from seqpipe.pipeline import carry as carry_lib  # jax: after main() sets the XLA flags
    from seqpipe.tools import flops  # jax: after main() sets the XLA flags

    spec, compiled, p_abs, t_abs = step["spec"], step["compiled"], step["params"], step["tokens"]
    compile_s = step["compile_s"]
    rows = config.train.global_batch_size // (config.mesh.data * config.pipeline.microbatches)
    ma = compiled.memory_analysis()
    carry = carry_lib.breakdown(spec, rows)
    st = schedule.stats(spec.schedule, lengths=spec.lengths)
    nan = float("nan")
    fl = (
        flops.step_ratio(spec, rows, config.mesh.data)
        if count_flops
        else {"analytic": nan, "executed": nan, "ratio": nan, "padded_ratio": nan}
    )
    out = {
        "schedule": spec.schedule.name,
        "segments": spec.schedule.segments,
        "partition": config.pipeline.partition,
        "virtual": spec.virtual,
        "label": label(
            spec.schedule.name, spec.schedule.segments, config.pipeline.partition, spec.virtual
        ),
        "lengths": list(spec.lengths),
        "depth": str(spec.schedule.inflight),
        "ticks": st["ticks"],
        "bubble_units": st["bubble"],
        "stash_units": st["inflight_peak"][0],
        "stash_microbatches": st["activation_fraction"][0],
        "temp_bytes": int(ma.temp_size_in_bytes),
        "carry_bytes": int(carry["carry"]),
        "kv_bytes": int(carry["kv"] + carry["dkv"]),
        "weight_bytes": int(carry["weight"]),
        "analytic_flops": fl["analytic"],
        "executed_flops": fl["executed"],
        "flop_ratio": fl["ratio"],
        "padded_flop_ratio": fl["padded_ratio"],
        "compile_s": compile_s,
    }
    if timer is not None:
        pred = predicted(spec, timer.unit)
        out["predicted_s"], out["bubble_measured_costs"] = pred["time"], pred["bubble"]
        out["unit_s"] = unit_seconds(spec, timer)
    placed = place_params(layout.to_stage_order(params, spec.placement), p_abs)
    toks = jax.device_put(tokens, t_abs.sharding)
    out["measured_s"] = median_seconds(compiled, (placed, toks), repeats)
    return out


def reference_seconds(cfg, params, tokens, checkpoint: str | None, repeats: int) -> float:
    """Median step time of the un-pipelined reference on one device, each layer
    checkpointed with `checkpoint` (a `model.CHECKPOINT_POLICIES` key) or not at all."""
    import jax  # after main() sets the XLA flags

    from seqpipe.models import reference  # jax: after main() sets the XLA flags

    dev = jax.devices()[0]
    p, t = jax.device_put(params, dev), jax.device_put(tokens, dev)
    step = jax.jit(lambda p, t: reference.loss_and_grads(p, t, cfg, checkpoint))
    return median_seconds(step, (p, t), repeats)


def policy_rows(config, runs, rows_per_mb: int) -> list[dict]:
    """Every `pipeline.remat` policy for each of `runs`: XLA temp per device, what the
    carry keeps between a forward and its backward, and executed / analytic FLOPs."""
    from seqpipe.pipeline import carry as carry_lib  # jax: after main() sets the XLA flags
    from seqpipe.tools import flops  # jax: after main() sets the XLA flags

    out = []
    for run in runs:
        for policy in remat.POLICIES:
            c = variant(config, *run)
            with c.unlocked():
                c.pipeline.remat = policy
            spec, temp = _temp_bytes(c)
            carry = carry_lib.breakdown(spec, rows_per_mb)
            out.append(
                {
                    "label": label(*run),
                    "remat": policy,
                    "temp_bytes": temp,
                    "stash_bytes": int(carry["stash"] + carry["res"]),
                    "kv_bytes": int(carry["kv"] + carry["dkv"]),
                    "weight_bytes": int(carry["weight"]),
                    "flop_ratio": flops.step_ratio(spec, rows_per_mb, c.mesh.data)["ratio"],
                }
            )
        flops.release()  # this schedule's units (`flops.release`: memory mappings)
    return out


def _temp_bytes(config) -> tuple:
    """(spec, XLA temp bytes) of the compiled step; the executable is dropped on return."""
    step = compile_step(config)
    return step["spec"], int(step["compiled"].memory_analysis().temp_size_in_bytes)


def policy_table(rows: list[dict]) -> str:
    lines = [
        "| schedule | pipeline.remat | XLA temp MiB | temp / full | stash MiB (inputs or "
        "residuals) | KV+dKV MiB | B-to-W MiB | executed / analytic FLOPs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    full = {r["label"]: r for r in rows if r["remat"] == "full"}
    for r in rows:
        base = full.get(r["label"])
        ratio = f"{r['temp_bytes'] / base['temp_bytes']:.2f}" if base else "-"
        lines.append(
            f"| {r['label']} | {r['remat']} | {_mib(r['temp_bytes'])} | {ratio} | "
            f"{_mib(r['stash_bytes'])} | {_mib(r['kv_bytes'])} | {_mib(r['weight_bytes'])} | "
            f"{r['flop_ratio']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def prediction_specs(config, stages, variants) -> list[dict]:
    """1F1B and Seq1F1B ((K, partition) in `variants`) tables, and their zero-bubble forms
    (zb_h1, seq_zb_h1), for each S in `stages`, M = 8, at both depths; nothing is
    compiled for them (they are predicted only)."""
    from seqpipe.pipeline import executor  # jax: after main() sets the XLA flags

    out = []
    for S in stages:
        if config.model.num_layers % S:
            continue
        for depth in ("full", "minimal"):
            plain = [("1f1b", 1, "uniform"), ("zb_h1", 1, "uniform")]
            for name, k, part in plain + [
                (n, k, p) for n in ("seq1f1b", "seq_zb_h1") for k, p in variants
            ]:
                c = variant(config, name, k, part, 1, stage=S)
                with c.unlocked():
                    c.pipeline.microbatches = PREDICT_MICROBATCHES
                    c.pipeline.inflight = depth
                out.append(
                    {
                        "spec": executor.make_spec(c),
                        "depth": depth,
                        "label": label(name, k, part, 1),
                    }
                )
    return out


# The layer split's effect (`pipeline.layers_per_stage`): the head matters when it costs
# more than a layer's forward and backward. The benchmark's vocabulary (2048) makes it
# about one; at 4096 it is about two, as in gpt_1b (6 * 2048 * 50304 against 3 layers'
# 24 * 2048^2 per token), where even blocks make every tick wait for the last stage.
SPLIT_VOCAB = 4096
SPLIT_RUN = ("seq1f1b", 4, "uniform", 1)


def split_rows(config, rows_per_mb: int, repeats: int, log=print) -> list[dict]:
    """Seq1F1B K=4 with even and `flops` layer splits on the config's mesh (the
    vocabulary SPLIT_VOCAB): layers per stage, each stage's measured work per
    micro-batch (its units timed alone), predicted and measured step time, XLA temp."""
    import jax  # after main() sets the XLA flags

    from seqpipe.models import model  # jax: after main() sets the XLA flags
    from seqpipe.tools import flops  # jax: after main() sets the XLA flags

    timer = UnitTimer(rows_per_mb, repeats=5)
    out = []
    for split in ("even", "flops"):
        c = variant(config, *SPLIT_RUN)
        with c.unlocked():
            c.model.vocab_size = SPLIT_VOCAB
            c.pipeline.layers_per_stage = split
        step = compile_step(c)
        spec = step["spec"]
        params = model.init_params(spec.cfg, jax.random.key(0))
        batch, seq = c.train.global_batch_size, c.train.seq_len
        tokens = np.random.default_rng(0).integers(0, spec.cfg.vocab_size, (batch, seq + 1))
        row = run_one(c, step, params, tokens.astype(np.int32), timer, repeats, False)
        S, K, last = spec.stages, spec.segments, spec.stages - 1
        work = [
            sum(
                timer.unit(spec, k, r == 0, r == last, b, spec.layers_per_chunk[r])
                for k in range(K)
                for b in (0, 1)  # forward, backward (an unsplit table)
            )
            for r in range(S)
        ]
        out.append(
            {
                "split": split,
                "layers_per_stage": list(spec.layers_per_chunk),
                "stage_work_s": work,
                **{k: row[k] for k in ("predicted_s", "measured_s", "temp_bytes")},
                "bubble_measured_costs": row["bubble_measured_costs"],
            }
        )
        log(f"# layer split {split}: {out[-1]['layers_per_stage']}")
        del step  # the compiled step goes before the next one's (`flops.release`)
    flops.release()
    return out


def split_table(rows: list[dict]) -> str:
    lines = [
        "| pipeline.layers_per_stage | layers | stage work per micro-batch, ms (measured) | "
        "bubble | predicted ms | predicted / even | measured ms | XLA temp MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    even = rows[0]["predicted_s"]
    for r in rows:
        lines.append(
            f"| {r['split']} | {','.join(map(str, r['layers_per_stage']))} | "
            f"{' '.join(f'{1e3 * w:.0f}' for w in r['stage_work_s'])} | "
            f"{r['bubble_measured_costs']:.3f} | {1e3 * r['predicted_s']:.0f} | "
            f"{r['predicted_s'] / even:.3f} | {1e3 * r['measured_s']:.0f} | "
            f"{_mib(r['temp_bytes'])} |"
        )
    return "\n".join(lines) + "\n"


def _mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def table(rows: list[dict]) -> str:
    head = (
        "| schedule | segment lengths | bubble (unit model) | bubble (measured costs) | "
        "predicted ms | measured ms | stage-0 stash, units (micro-batches) | XLA temp MiB | "
        "temp / 1f1b | executed / analytic FLOPs | same with padded keys |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    base = next((r for r in rows if r["schedule"] == "1f1b"), None)
    for r in rows:
        ratio = f"{r['temp_bytes'] / base['temp_bytes']:.2f}" if base else "-"
        lines.append(
            f"| {r['label']} | {' '.join(map(str, r['lengths']))} | {r['bubble_units']:.3f} | "
            f"{r.get('bubble_measured_costs', float('nan')):.3f} | "
            f"{1e3 * r.get('predicted_s', float('nan')):.0f} | "
            f"{1e3 * r.get('measured_s', float('nan')):.0f} | "
            f"{r['stash_units']} ({r['stash_microbatches']:g}) | {_mib(r['temp_bytes'])} | "
            f"{ratio} | {r['flop_ratio']:.4f} | {r['padded_flop_ratio']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def unit_table(rows: list[dict]) -> str:
    """Each schedule's measured F, B, W per micro-batch on stage 1: the split's B + W
    against the unsplit backward is what the split costs in time."""
    lines = [
        "| schedule | F ms | B ms | W ms | (B + W) / F |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        u = r["unit_s"]
        lines.append(
            f"| {r['label']} | {1e3 * u['F']:.1f} | {1e3 * u['B']:.1f} | "
            f"{1e3 * u['W']:.1f} | {(u['B'] + u['W']) / u['F']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def prediction_table(rows: list[dict]) -> str:
    lines = [
        "| S | M | depth | schedule | predicted ms | bubble | throughput / 1f1b |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['stages']} | {r['microbatches']} | {r['depth']} | {r['label']} | "
            f"{1e3 * r['predicted_s']:.0f} | {r['bubble']:.3f} | {r['speedup_over_1f1b']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def chart(result: dict, path: str) -> None:
    import matplotlib  # here: only --png draws; the backend is set before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["label"] for r in rows]
    y = range(len(rows))
    fig, axes = plt.subplots(1, 4, figsize=(18, 0.45 * len(rows) + 2), sharey=True)
    axes[0].barh(y, [r["temp_bytes"] / 2**20 for r in rows], color="tab:blue")
    axes[0].set_title("XLA peak temp per device, MiB")
    axes[1].barh(
        [i - 0.2 for i in y], [1e3 * r["predicted_s"] for r in rows], 0.4, label="predicted"
    )
    axes[1].barh(
        [i + 0.2 for i in y],
        [1e3 * r["measured_s"] for r in rows],
        0.4,
        label="measured (shared cores)",
    )
    axes[1].axvline(
        1e3 * result["reference"]["seconds"],
        color="k",
        ls="--",
        label=f"reference ({result['reference']['checkpoint']} checkpoint)",
    )
    axes[1].set_title("step time, ms")
    axes[1].legend(fontsize=7)
    axes[2].barh(y, [r["bubble_measured_costs"] for r in rows], color="tab:orange")
    axes[2].set_title("bubble (measured unit costs)")
    axes[3].barh(y, [r["flop_ratio"] for r in rows], color="tab:green", label="executed")
    axes[3].barh(
        y,
        [r["padded_flop_ratio"] - r["flop_ratio"] for r in rows],
        left=[r["flop_ratio"] for r in rows],
        color="tab:red",
        alpha=0.4,
        label="if keys were padded",
    )
    axes[3].axvline(4 / 3, color="k", ls="--", label="4/3 (full remat)")
    axes[3].axvline(1.05, color="k", ls=":", label="1.05 (no recompute)")
    axes[3].set_xlim(1.0, None)
    axes[3].set_title("executed / analytic FLOPs")
    axes[3].legend(fontsize=7)
    axes[0].set_yticks(list(y), names)
    axes[0].invert_yaxis()
    m = result["model"]
    fig.suptitle(
        f"{m['num_layers']} layers, d_model {m['d_model']}, seq {result['seq_len']}, "
        f"batch {result['global_batch_size']}, mesh {result['mesh']}, "
        f"M={result['microbatches']}, {result['remat']} remat"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _header(config, batch: int, seq: int) -> dict:
    """The result's description of the run, before any row."""
    return {
        "command": "python -m seqpipe.bench " + " ".join(sys.argv[1:]),
        "model": config.model.to_dict(),
        "mesh": f"{config.mesh.data}x{config.mesh.stage}",
        "microbatches": config.pipeline.microbatches,
        "global_batch_size": batch,
        "seq_len": seq,
        "remat": config.pipeline.remat,
        "cpu_cores": os.cpu_count(),
        "note": NOTE,
        "rows": [],
    }


def _one_stage(config):
    """The one-stage mesh, for the machinery's overhead: one micro-batch and one segment."""
    one = variant(config, "1f1b", 1, "uniform", 1, stage=1)
    with one.unlocked():
        one.mesh.data = 1
        one.pipeline.microbatches = 1
    return one


def _log_row(log, r: dict, seconds: float) -> None:
    u = r["unit_s"]
    log(
        f"# {r['label']}: temp {_mib(r['temp_bytes'])} MiB, FLOPs x{r['flop_ratio']:.4f}, "
        f"bubble {r['bubble_measured_costs']:.3f}, predicted {1e3 * r['predicted_s']:.0f} "
        f"ms, measured {1e3 * r['measured_s']:.0f} ms, F/B/W "
        f"{1e3 * u['F']:.1f}/{1e3 * u['B']:.1f}/{1e3 * u['W']:.1f} ms ({seconds:.0f} s)"
    )


def _overhead(config, cfg, params, tokens, one, step, repeats: int) -> tuple[dict, dict]:
    """The machinery alone: the pipelined step on one stage against the reference that
    checkpoints its layers as the policy does (the same FLOPs), and against none."""
    matching = remat.POLICIES[config.pipeline.remat].reference
    reference = {
        "checkpoint": matching or "none",
        "seconds": reference_seconds(cfg, params, tokens, matching, repeats),
        "no_checkpoint_s": reference_seconds(cfg, params, tokens, None, repeats),
    }
    solo_s = run_one(one, step, params, tokens, None, repeats, count_flops=False)["measured_s"]
    overhead = {
        "pipelined_one_stage_s": solo_s,
        "reference_s": reference["seconds"],
        "ratio": solo_s / reference["seconds"],
        "ratio_vs_no_checkpoint": solo_s / reference["no_checkpoint_s"],
        "target": 1.15,
    }
    return reference, overhead


def bench(config, runs, repeats: int, log=print, quick: bool = False, save=None) -> dict:
    """Every section of the report; `save(result)` after each, so a run that dies (a
    shared machine out of memory) leaves what it measured."""
    save = save or (lambda result: None)
    import jax  # after main() sets the XLA flags

    from seqpipe.models import model
    from seqpipe.pipeline import executor  # jax: after main() sets the XLA flags
    from seqpipe.tools import flops  # jax: after main() sets the XLA flags

    cfg = executor.make_spec(config).cfg
    params = model.init_params(cfg, jax.random.key(0))
    batch, seq = config.train.global_batch_size, config.train.seq_len
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq + 1), np.int32)
    rows_per_mb = batch // (config.mesh.data * config.pipeline.microbatches)
    timer = UnitTimer(rows_per_mb, repeats=5)
    result = _header(config, batch, seq)
    one = _one_stage(config)
    configs = [variant(config, *run) for run in runs]
    variants = [(k, p) for name, k, p, v in runs if name == "seq1f1b" and v == 1]
    stages = (config.mesh.stage,) if quick else PREDICT_STAGES
    predict = prediction_specs(config, stages, variants)
    # Compile each phase's steps and units first, on every core (XLA compiles release the
    # GIL), and free them once the phase has its numbers: every live executable keeps
    # its code mapped, and all of the bench's together pass vm.max_map_count
    # (`flops.release`).
    start = time.perf_counter()
    workers = max(1, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        steps = list(pool.map(compile_step, configs + [one]))
    units = [u for st in steps[:-1] for u in flops.needed_units(st["spec"], rows_per_mb)]
    layers = chunk_layers(steps[0]["spec"])
    flops.precompile(units, workers)
    log(f"# compiled {len(configs) + 1} steps and the units in {time.perf_counter() - start:.0f} s")
    for i, c in enumerate(configs):
        start = time.perf_counter()
        step, steps[i] = steps[i], None  # run_one's step is freed when the next replaces it
        result["rows"].append(run_one(c, step, params, tokens, timer, repeats))
        _log_row(log, result["rows"][-1], time.perf_counter() - start)
        save(result)
    result["reference"], result["overhead"] = _overhead(
        config, cfg, params, tokens, one, steps.pop(), repeats
    )
    del step, steps
    log(f"# freed {len(configs) + 1} steps and {flops.release()} units")
    log(f"# overhead: one-stage pipeline / reference = {result['overhead']['ratio']:.3f}")
    save(result)
    # The prediction's units not timed for the rows (other stage counts, kept outputs).
    units = [
        u
        for p in predict
        for u in flops.needed_units(p["spec"], rows_per_mb, chunk_layers(p["spec"]) != layers)
        if flops.unit_key(*u) not in timer.seconds
    ]
    start = time.perf_counter()
    flops.precompile(units, workers)
    result["prediction"] = prediction(predict, timer, layers)
    log(
        f"# prediction: {len(predict)} tables, {flops.release()} more units compiled and timed "
        f"({time.perf_counter() - start:.0f} s)"
    )
    save(result)
    policy_runs = runs[:2] if quick else POLICY_RUNS
    result["policies"] = policy_rows(config, policy_runs, rows_per_mb)
    log(f"# remat policies compiled for {len(policy_runs)} schedules")
    save(result)
    spec = executor.make_spec(variant(config, *runs[-1]))
    result["flop_breakdown"] = {
        "schedule": label(*runs[-1]),
        "fractions_of_analytic": flops.breakdown(spec, rows_per_mb, config.mesh.data),
    }
    if not quick:
        result["flop_breakdown"]["layer_scan_check"] = flops.check_layer_scan(spec, rows_per_mb)
        result["layer_split"] = split_rows(config, rows_per_mb, repeats, log)
    return result


def report(result: dict) -> str:
    ref, ov = result["reference"], result["overhead"]
    fb = result["flop_breakdown"]
    out = [
        f"model {result['model']['num_layers']} layers x d_model {result['model']['d_model']}, "
        f"vocab {result['model']['vocab_size']}; global batch {result['global_batch_size']} x "
        f"seq {result['seq_len']}; mesh {result['mesh']}; M={result['microbatches']}; "
        f"{result['remat']} remat; {result['cpu_cores']} CPU cores\n",
        table(result["rows"]),
        f"reference step (one device): {1e3 * ref['seconds']:.0f} ms with the policy's "
        f"per-layer checkpoint ({ref['checkpoint']}), "
        f"{1e3 * ref['no_checkpoint_s']:.0f} ms with no checkpoint",
        "machinery overhead: pipelined step on a one-stage mesh "
        f"{1e3 * ov['pipelined_one_stage_s']:.0f} ms = {ov['ratio']:.3f}x the reference with "
        f"the same checkpoints (target <= {ov['target']}), "
        f"{ov['ratio_vs_no_checkpoint']:.3f}x the one with none\n",
        "Measured unit times per micro-batch, stage 1 (all segments; an unsplit B is the "
        "whole backward):\n",
        unit_table(result["rows"]),
        "Predicted from measured unit times (M=8):\n",
        prediction_table(result["prediction"]),
        "Every pipeline.remat policy (full depth):\n",
        policy_table(result["policies"]),
        *(
            [
                f"Layer split, {label(*SPLIT_RUN)}, vocab {SPLIT_VOCAB}"
                " (the head about two layers' forward and backward, as in gpt_1b):\n",
                split_table(result["layer_split"]),
            ]
            if "layer_split" in result
            else []
        ),
        f"FLOPs by source for {fb['schedule']}, as fractions of the analytic total (jaxpr):",
        ", ".join(f"{k} {v:.4f}" for k, v in fb["fractions_of_analytic"].items()),
        "",
        NOTE,
    ]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    def flags(parser):
        parser.add_argument("--quick", action="store_true", help="a tiny model, three schedules")
        parser.add_argument("--json", default=None, help="write the results here")
        parser.add_argument("--png", default=None, help="draw the chart here")
        parser.add_argument("--repeats", type=int, default=3, help="timed steps per schedule")

    quick = "--quick" in argv
    argv = list(argv)
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        argv = ["--config", DEFAULT_CONFIG] + argv
    if quick:  # the user's own overrides come later, so they win
        argv = list(QUICK) + argv
    config, args = cli.load_or_exit(argv, "python -m seqpipe.bench", flags)
    cli.one_device_stages_or_exit(config, "python -m seqpipe.bench")
    cli.quiet_libtpu()
    config = cli.resolve_or_exit(config)  # a mesh axis at -1 gets its size
    runs = QUICK_RUNS if args.quick else RUNS

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    for path in (args.json, args.png):
        if path and os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)

    def save(result):
        if args.json:
            files.atomic_write_bytes(args.json, json.dumps(result, indent=1).encode())

    result = bench(config, runs, args.repeats if not args.quick else 1, log, args.quick, save)
    sys.stdout.write(report(result))
    save(result)
    if args.png:
        chart(result, args.png)
    return 0
