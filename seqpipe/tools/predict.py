"""Seq1F1B over 1F1B on 4 and 8 stages, from the costs of its units on one device.

    python -m seqpipe.tools.predict [--config gpt_1b] [--predict seq1f1b:4@none]
        [--topology h200] [--json FILE] [--config.key=value ...]

For `seq1f1b:K[@REMAT]` and 1F1B under the same remat, M = 8, data 1, on S = 4 and 8
stages (those that divide the layers): the benchmark's time model (`tick_model.predicted`: a
synchronous tick lasts as long as its busiest stage), each chunk's unit the sum of its
layers' one-layer units (`flops.chunk_terms`). The units' costs are

- timed on the device JAX sees (each compiled and run alone, `tick_model.UnitTimer`);
  `python -m seqpipe.bench --accelerator` runs this after its variants;
- or, with `--topology h200`, estimated for an H200 from this machine: each unit
  compiled for it (`seqpipe.targets.gpu_topology`) and costed by `step_cost`'s roofline fitted to
  the H200's measured steps. A Pallas kernel's own time is invisible to that estimate,
  so it stands for `blockwise` attention (`auto` on GPUs), not `pallas_gpu`.

Predicted MFU is the step's model FLOPs over the S devices' peak.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import time

from seqpipe.errors import TopologyError
from seqpipe.pipeline import remat
from seqpipe.run import cli
from seqpipe.targets import gpu_topology, xla_flags
from seqpipe.tools import step_cost, tick_model
from seqpipe.train.metrics import peak_flops

DEFAULT = "seq1f1b:4@none"  # `none`: what fits gpt_1b on 4 or 8 H200s with least recompute
SEGMENTS = (1, 2, 4, 8)
PAPER_SPEEDUP = 1.14  # Seq1F1B over 1F1B in the paper (../shared/seq1f1b.md)


def parse(name: str) -> tuple[int, str | None]:
    """(K, remat or None) of `seq1f1b:K[@REMAT]`; ValueError (one line) if it is not one."""
    base, _, policy = name.partition("@")
    k = base.removeprefix("seq1f1b:")
    if not base.startswith("seq1f1b:") or not k.isdigit() or int(k) not in SEGMENTS:
        choices = ", ".join(map(str, SEGMENTS))
        raise ValueError(f"{name}: name seq1f1b:K or seq1f1b:K@REMAT, K in {choices}")
    if "@" in name and policy not in remat.POLICIES:
        choices = ", ".join(remat.POLICIES)
        raise ValueError(f"{name}: unknown remat {policy!r}; choose from {choices}")
    return int(k), policy or None


def stages_for(layers: int) -> list[int]:
    return [s for s in tick_model.PREDICT_STAGES if layers % s == 0]


class EstimatedUnits(tick_model.UnitTimer):
    """One-layer units compiled for `device` (a compile-only GPU), each's seconds
    `step_cost`'s H200 roofline estimate of its compiled program."""

    def __init__(self, rows: int, device):
        super().__init__(rows, repeats=0)
        self.device = device

    def one_layer(self, spec, seg, first, last, backward, keep) -> float:
        import jax  # after main() sets the XLA flags

        from seqpipe.tools import flops  # jax: after main() sets the XLA flags

        key = flops.unit_key(spec, self.rows, seg, first, last, backward, keep)
        if key not in self.seconds:
            fn, args = flops.unit_program(spec, self.rows, seg, first, last, backward, keep)
            on = jax.sharding.SingleDeviceSharding(self.device)
            args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on), args)
            lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
            cost = step_cost.step_cost(lowered.compile().as_text(), 1, 1)
            self.seconds[key] = cost.seconds(*step_cost.H200)
        return self.seconds[key]

    def precompile(self, needed: list[tuple], workers: int) -> None:
        """Estimate `flops.needed_units` entries on `workers` threads (compiles release
        the GIL), each program once."""
        from seqpipe.tools import flops  # jax: after main() sets the XLA flags

        todo = flops.distinct_units(needed, self.seconds)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda u: self.one_layer(u[0], *u[2:]), todo))


def predict(config, name: str, device=None, log=print) -> dict:
    """The prediction for `name` (`parse`): units timed on this device, or with `device`
    (a compile-only H200) estimated for it."""
    import jax  # after main() sets the XLA flags

    from seqpipe.models import model
    from seqpipe.models.model import GPTConfig  # jax: after main() sets the XLA flags
    from seqpipe.pipeline import executor  # jax: after main() sets the XLA flags
    from seqpipe.tools import flops  # jax: after main() sets the XLA flags

    segments, policy = parse(name)
    c = config.copy_and_resolve_references()
    with c.unlocked():
        c.mesh.data = 1
        c.pipeline.microbatches = tick_model.PREDICT_MICROBATCHES
        c.pipeline.remat = policy or c.pipeline.remat
    t, stages = c.train, stages_for(c.model.num_layers)
    specs = [
        {
            "spec": executor.make_spec(tick_model.variant(c, sched, k, "uniform", 1, stage=S)),
            "depth": c.pipeline.inflight,
            "label": tick_model.label(sched, k, "uniform", 1),
        }
        for S in stages
        for sched, k in (("1f1b", 1), ("seq1f1b", segments))
    ]
    rows = t.global_batch_size // c.pipeline.microbatches
    start, workers = time.perf_counter(), os.cpu_count() or 1
    needed = [u for p in specs for u in flops.needed_units(p["spec"], rows)]
    if device is None:
        timer, kind = tick_model.UnitTimer(rows, repeats=5), jax.devices()[0].device_kind
        flops.precompile(needed, workers)
        costs = f"timed on {kind}"
    else:
        timer, kind = EstimatedUnits(rows, device), device.device_kind
        timer.precompile(needed, workers)
        costs = f"estimated for {kind} (step_cost's H200 roofline)"
    out = tick_model.prediction(specs, timer)
    tokens = t.global_batch_size * t.seq_len
    per_token = model.flops_per_token(GPTConfig.from_config(c.model), t.seq_len)
    peak = peak_flops(kind)
    for row, p in zip(out, specs, strict=True):
        row["tokens_per_s"] = tokens / row["predicted_s"]
        device_s = row["predicted_s"] * row["stages"]
        row["mfu"] = per_token * tokens / (device_s * peak) if peak else None
        row["unit_s"] = tick_model.unit_seconds(p["spec"], timer)  # one micro-batch, a middle stage
    seconds, units = time.perf_counter() - start, len(timer.seconds)
    flops.release()
    log(f"prediction: {len(specs)} tables, {units} units {costs} in {seconds:.0f} s")
    return {
        "seq1f1b": name,
        "costs": costs,
        "remat": c.pipeline.remat,
        "microbatches": c.pipeline.microbatches,
        "rows_per_microbatch": rows,
        "stages_skipped": [s for s in tick_model.PREDICT_STAGES if s not in stages],
        "paper_speedup": PAPER_SPEEDUP,
        "rows": out,
    }


def table(pred: dict) -> str:
    """The prediction's console table."""
    lines = [
        f"Predicted Seq1F1B over 1F1B ({pred['seq1f1b']}, remat {pred['remat']}, "
        f"M={pred['microbatches']}, {pred['rows_per_microbatch']} rows a micro-batch), unit "
        f"costs {pred['costs']}; the paper: {PAPER_SPEEDUP}x. F and B: one micro-batch's "
        "units on a middle stage.",
        "",
        "| S | schedule | predicted s | bubble | throughput / 1f1b | tokens/s | MFU | F ms "
        "| B ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in pred["rows"]:
        u, mfu = r["unit_s"], "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        lines.append(
            f"| {r['stages']} | {r['label']} | {r['predicted_s']:.4f} | {r['bubble']:.3f} | "
            f"{r['speedup_over_1f1b']:.3f} | {r['tokens_per_s']:,.0f} | {mfu} | "
            f"{1e3 * u['F']:.1f} | {1e3 * u['B']:.1f} |"
        )
    if pred["stages_skipped"]:
        skipped = ", ".join(map(str, pred["stages_skipped"]))
        lines.append(f"\n(S = {skipped}: does not divide the model's layers)")
    return "\n".join(lines) + "\n"


def problem(name: str, num_layers: int) -> str | None:
    """What is wrong with predicting `name` for a model of `num_layers`, or None."""
    try:
        parse(name)
    except ValueError as e:
        return str(e)
    if not stages_for(num_layers):
        stages = " or ".join(map(str, tick_model.PREDICT_STAGES))
        return f"model.num_layers={num_layers} splits over none of {stages} stages"
    return None


def main(argv: list[str]) -> int:
    def flags(parser):
        parser.add_argument("--predict", default=DEFAULT, help="seq1f1b:K[@REMAT]")
        parser.add_argument(
            "--topology",
            default=None,
            help="estimate the units for this GPU (h200) instead of timing them here",
        )
        parser.add_argument("--json", default=None, help="write the prediction here")

    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        argv = ["--config", "gpt_1b", *argv]
    config, args = cli.load_or_exit(argv, "python -m seqpipe.tools.predict", flags)
    cli.one_device_stages_or_exit(config, "python -m seqpipe.tools.predict")
    if bad := problem(args.predict, config.model.num_layers):
        cli.fail(f"--predict: {bad}")
    target = None
    if args.topology is not None:
        if args.topology.strip().lower() not in ("h200", "h200-1"):
            cli.fail(f"--topology {args.topology}: the estimate is fitted to one H200; use h200")
        target = gpu_topology.parse(args.topology)
        target.prepare_env()  # before jax is imported
        try:
            device = target.devices()[0]
        except TopologyError as e:
            cli.fail(str(e))
    else:
        xla_flags.apply()  # as train.py does: GPU only, the user's XLA_FLAGS win
        device = None

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    pred = cli.run_or_exit(lambda: predict(config, args.predict, device, log))
    if args.json:
        if os.path.dirname(args.json):
            os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(pred, fh, indent=1)
    sys.stdout.write(table(pred))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
