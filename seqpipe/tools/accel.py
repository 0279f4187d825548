"""The real train step on whatever device JAX sees: the reference against the pipeline.

    python -m seqpipe.bench --accelerator [--config gpt_1b] [--quick] [--json FILE]
        [--steps N] [--variants ref,1f1b,seq1f1b:4,ref@dots,seq1f1b:4@none,...]
        [--microbatches M] [--no_profile] [--config.key=value ...]

For the config and its overrides, on a one-device mesh: the un-pipelined reference step
(`schedule none`) and the pipelined step on one stage (1f1b, seq1f1b K=1, 2, 4, 8; M=8
micro-batches, or `--microbatches`); `NAME@POLICY` runs a variant with
`pipeline.remat=POLICY` (the default list adds the policies that recompute less and still
fit an H200, from `--compile_only --topology h200`).
Each is the jitted step `seqpipe.train.step.make_train_step` builds (optimizer included), on
random tokens. Per variant: compile time, step time, tokens/s, MFU, XLA's memory and the
device's peak, and a profile summary: one step traced with `jax.profiler`, the trace's
events matched to the compiled HLO's instructions and grouped (`GROUPS`) by what the
instruction's source is.

MFU is PaLM's (`model.flops_per_token`: 6N plus the full L x L attention, not halved for
causality) over the device's dense bf16 peak (`metrics.PEAK_FLOPS`); `mfu_causal` halves
the attention term. On CPU (no peak in the table) both are null.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

import numpy as np

from seqpipe.pipeline import remat
from seqpipe.run import cli
from seqpipe.run import config as config_lib
from seqpipe.targets import xla_flags
from seqpipe.tools import predict, step_cost
from seqpipe.tools.tick_model import PREDICT_STAGES, QUICK_MODEL
from seqpipe.train.metrics import device_memory_peak, peak_flops

DEFAULT_CONFIG = "gpt_1b"
# name: (schedule, segments)
VARIANTS = {
    "ref": ("none", 1),
    "1f1b": ("1f1b", 1),
    **{f"seq1f1b:{k}": ("seq1f1b", k) for k in (1, 2, 4, 8)},
}
# The pipelined variants' micro-batches (`--microbatches`): 8 at gpt_1b's 2048 x 32; a
# long-context batch (32768 x 2) has fewer rows than that.
MICROBATCHES = 8
QUICK = QUICK_MODEL + (
    "--config.model.dtype=float32",
    "--config.train.global_batch_size=8",
    "--config.train.seq_len=64",
)
# The default run, most wanted first (a device session's time limit may cut it): the
# default remat, then the ones that recompute less where gpt_1b fits an H200 (compiled for
# it here: reference `dots` 82 GiB, one-stage 1f1b and seq1f1b K=4 `none` 48 GiB; the
# reference's `none` needs 125 GiB), then the other segment counts.
DEFAULT_VARIANTS = (
    "ref,1f1b,seq1f1b:4,ref@dots,1f1b@none,seq1f1b:4@none,seq1f1b:1,seq1f1b:2,seq1f1b:8"
)
QUICK_VARIANTS = "ref,1f1b,seq1f1b:2"
# After the variants, Seq1F1B over 1F1B on 4 and 8 of these devices (`tools.predict`). A
# quick run's model has too few layers for four stages: it predicts only when asked.
QUICK_PREDICT = ""
GROUPS = (
    "matmuls",
    "attention",
    "cross-entropy",
    "optimizer",
    "pipeline buffers / grad accumulation",
    "layer loop",  # the scan over a stack's layers: weight slices in, gradients stacked out
    "copies",
    "other",
)
# seqpipe functions whose operations are the cross-entropy's (`model.head_loss_sum`).
XENT_FUNCTIONS = {
    "head_loss_sum",
    "chunked_xent",
    "_chunked_xent_fwd",
    "_chunked_xent_bwd",
    "_xent_scan",
    "_chunk_xent",
    "_chunks",
    "token_loss_sum",
    "logits",
    "head_loss",
    "head",
}
CONTAINERS = {"while", "conditional", "call", "async-start", "async-done"}
# seqpipe's attention implementations (a kernel's frames may stop short of attention.py).
ATTENTION_FILES = {"attention.py", "blockwise.py", "pallas_gpu.py", "splash.py"}


def unknown_variant(name: str) -> str | None:
    """What is wrong with a variant's name (`NAME` or `NAME@POLICY`), or None."""
    base, _, policy = name.partition("@")
    if base not in VARIANTS:
        return f"unknown {base}; choose from {', '.join(VARIANTS)}"
    if "@" in name and policy not in remat.POLICIES:
        return f"{name}: unknown remat {policy!r}; choose from {', '.join(remat.POLICIES)}"
    return None


def variant_config(config, name: str, microbatches: int = MICROBATCHES):
    """`config` on one device (data 1, stage 1) with the variant's schedule (and remat),
    `microbatches` micro-batches if it pipelines."""
    base, _, policy = name.partition("@")
    schedule, segments = VARIANTS[base]
    c = config.copy_and_resolve_references()
    with c.unlocked():
        c.mesh.data, c.mesh.stage = 1, 1
        c.pipeline.schedule = schedule
        c.pipeline.microbatches = 1 if schedule == "none" else microbatches
        c.pipeline.segments = segments
        if policy:
            c.pipeline.remat = policy
    config_lib.validate(c)
    return c


# --------------------------------------------------------------------------- profile


def _base(function: str) -> str:
    """A frame's function without its enclosing ones ('layer.<locals>.mm' -> 'layer')."""
    return function.split(".<locals>")[0].split(".")[-1]


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\(")
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_SOURCE = re.compile(r'source_file="([^"]*)"(?:\s+source_line=(\d+))?')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_TABLE_ROW = re.compile(r"^(\d+)\s+(.*)$")
_FIELD = re.compile(r"(\w+)=(\d+)")


def _stack_tables(lines: list[str]) -> dict:
    """The module's FileNames, FunctionNames, FileLocations and StackFrames tables."""
    tables, current = collections.defaultdict(dict), None
    for raw in lines:
        if raw in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = raw
            continue
        m = _TABLE_ROW.match(raw) if current else None
        if not m:
            current = None
            continue
        value = m.group(2)
        tables[current][int(m.group(1))] = (
            value.strip('"') if value.startswith('"') else dict(_FIELD.findall(value))
        )
    return tables


def _stack(tables: dict, frame: int) -> list[tuple[str, str]]:
    """(file, function) of a stack frame and its callers, innermost first."""
    out, seen = [], set()
    frames, locs = tables.get("StackFrames", {}), tables.get("FileLocations", {})
    while frame in frames and frame not in seen:
        seen.add(frame)
        loc = locs.get(int(frames[frame]["file_location_id"]), {})
        out.append(
            (
                tables["FileNames"].get(int(loc.get("file_name_id", 0)), ""),
                tables["FunctionNames"].get(int(loc.get("function_name_id", 0)), ""),
            )
        )
        # XLA prints a parent as its id + 1 (0: none), the frames by their ids.
        frame = int(frames[frame].get("parent_frame_id", 0)) - 1
    return out


def hlo_instructions(text: str) -> dict[str, dict]:
    """name -> {opcode, stack [(file, function)] innermost first, computation, calls} of
    every instruction in an HLO module's text."""
    lines = text.splitlines()
    tables = _stack_tables(lines)
    out, comp = {}, ""
    for raw in lines:
        m = _COMP.match(raw)
        if m and "=" not in raw.split("{")[0]:
            comp = m.group(1)
            continue
        m = _INSTR.match(raw)
        if not m:
            continue
        frame, source = _FRAME_ID.search(raw), _SOURCE.search(raw)
        stack = _stack(tables, int(frame.group(1))) if frame else []
        if not stack and source:  # older XLA: the innermost frame's file only
            stack = [(source.group(1), "")]
        calls = _CALLS.search(raw)
        out[m.group(1)] = {
            "opcode": m.group(2),
            "stack": stack,
            "computation": comp,
            "calls": calls.group(1) if calls else None,
        }
    return out


def _computation_opcodes(instrs: dict) -> dict[str, set]:
    ops = collections.defaultdict(set)
    for ins in instrs.values():
        ops[ins["computation"]].add(ins["opcode"])
    return ops


def _by_source(stack: list[tuple[str, str]]) -> str | None:
    """The group an instruction's innermost telling frame gives, or None (the model's own
    compute, or no frames: the opcode decides)."""
    for path, function in stack:
        name = os.path.basename(path)
        if name in ATTENTION_FILES:
            return "attention"
        if name in ("model.py", "units.py", "remat_strategies.py"):
            if _base(function) in XENT_FUNCTIONS:
                return "cross-entropy"
            return "layer loop" if _base(function) == "layers" else None
        if "optax" in path or name in ("optim.py", "step.py"):
            return "optimizer"
        if name in ("executor.py", "carry.py"):
            return "pipeline buffers / grad accumulation"
    return None


def classify(ins: dict, called_ops: set) -> str:
    """The `GROUPS` entry of one HLO instruction, from its source first, then its opcode."""
    group = _by_source(ins["stack"])
    if group:
        return group
    ops = called_ops | {ins["opcode"]}
    if ops & {"dot", "convolution"} or any(o.startswith("__cublas") for o in ops):
        return "matmuls"
    if ins["opcode"] in {"copy", "copy-start", "copy-done", "transpose"}:
        return "copies"
    return "other"


def trace_events(log_dir: str) -> list[dict]:
    """The complete ('X') events of the newest trace under `log_dir`, each with its
    process's name ('pname'), from the Chrome-format JSON the profiler writes."""
    paths = sorted(glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True))
    paths = paths or sorted(
        glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    )
    if not paths:
        return []
    with gzip.open(paths[-1]) as fh:
        data = json.load(fh)
    events = data["traceEvents"] if isinstance(data, dict) else data
    pnames = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    return [dict(e, pname=pnames.get(e.get("pid"), "")) for e in events if e.get("ph") == "X"]


def profile_summary(events: list[dict], hlo_text: str, top: int = 10) -> dict:
    """Trace time by `GROUPS` and the top instructions, matching events to the compiled
    HLO's instruction names (an event's name, or its `hlo_op` argument). Device events
    where there are any (GPU, TPU), else the host's (CPU: the thunks run there)."""
    instrs = hlo_instructions(hlo_text)
    called = _computation_opcodes(instrs)
    device = [e for e in events if e["pname"].startswith("/device:") and "CUSTOM" not in e["pname"]]
    source = "device" if device else "host"
    per_op = collections.Counter()
    launches = 0
    for e in device or events:
        name = (e.get("args") or {}).get("hlo_op") or e.get("name", "")
        ins = instrs.get(name)
        if ins is None or ins["opcode"] in CONTAINERS:
            continue
        per_op[name] += float(e.get("dur", 0.0)) * 1e-6
        launches += 1
    groups = dict.fromkeys(GROUPS, 0.0)
    rows = []
    for name, seconds in per_op.items():
        ins = instrs[name]
        group = classify(ins, called.get(ins["calls"], set()) if ins["calls"] else set())
        groups[group] += seconds
        rows.append((seconds, name, ins["opcode"], group))
    total = sum(groups.values())
    rows.sort(reverse=True)
    return {
        "events_from": source,
        "matched_s": total,
        # Operations run in the step (kernels on a device): a pipeline runs every layer's
        # kernels once per unit, so many small ones where the reference runs few large.
        "ops": launches,
        "mean_op_s": total / launches if launches else 0.0,
        "groups_s": groups,
        "groups_fraction": {k: (v / total if total else 0.0) for k, v in groups.items()},
        "top": [{"op": n, "opcode": o, "group": g, "s": s} for s, n, o, g in rows[:top]],
    }


def profile_step(compiled, state, tokens) -> tuple[dict, object]:
    """Run one step under `jax.profiler.trace`; (its summary, the new state)."""
    import jax  # after main() sets the XLA flags

    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            state, metrics = compiled(state, tokens)
            jax.block_until_ready(metrics)
        events = trace_events(log_dir)
    return profile_summary(events, compiled.as_text()), state


# --------------------------------------------------------------------------- measuring


def measure(
    config, name: str, steps: int, profile: bool, log=print, microbatches: int = MICROBATCHES
) -> dict:
    """One variant's compile time, step time, throughput, MFU, memory and profile."""
    import jax  # after main() sets the XLA flags

    from seqpipe.models import model
    from seqpipe.parallel import sharding
    from seqpipe.run import run_config
    from seqpipe.train import optim
    from seqpipe.train import step as step_lib

    c = variant_config(config, name, microbatches)
    t = c.train
    run = run_config.resolve(c, jax.devices()[:1])  # `auto` as the platform's own
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    tx = optim.make_optimizer(t)
    state = step_lib.init_state(run, mesh, tx)
    step = step_lib.make_train_step(
        step_lib.make_grad_fn(run, mesh), tx, optim.lr_schedule(t), mesh
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, c.model.vocab_size, (t.global_batch_size, t.seq_len + 1), np.int32)
    tokens = jax.device_put(tokens, sharding.batch_sharding(mesh))
    start = time.perf_counter()
    compiled = step.lower(state, tokens).compile()
    compile_s = time.perf_counter() - start
    ma = compiled.memory_analysis()
    state, metrics = compiled(state, tokens)  # warm-up
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, tokens)
    jax.block_until_ready(metrics)
    step_s = (time.perf_counter() - start) / steps
    cfg = run.model
    tokens_per_step = t.global_batch_size * t.seq_len
    fpt = model.flops_per_token(cfg, t.seq_len)
    fpt_causal = model.flops_per_token(cfg, t.seq_len, causal=True)
    peak = peak_flops(jax.devices()[0].device_kind)
    out = {
        "variant": name,
        "schedule": c.pipeline.schedule,
        "microbatches": c.pipeline.microbatches,
        "segments": c.pipeline.segments,
        "compile_s": compile_s,
        "step_s": step_s,
        "tokens_per_s": tokens_per_step / step_s,
        "mfu": fpt * tokens_per_step / step_s / peak if peak else None,
        "mfu_causal": fpt_causal * tokens_per_step / step_s / peak if peak else None,
        "loss": float(metrics["loss"]),
        "xla_temp_bytes": int(ma.temp_size_in_bytes),
        "xla_argument_bytes": int(ma.argument_size_in_bytes),
        # The process's running peak (memory_stats); None where the backend has none (CPU).
        "device_peak_bytes": device_memory_peak(jax.devices()[:1]),
    }
    # What the compiled step moves (`step_cost`), and the roofline fitted to the H200:
    # next to a measured step time, each device run checks the estimate.
    p = c.pipeline
    units = (1, 1) if p.schedule == "none" else (p.microbatches, p.segments)
    moved = step_cost.step_cost(compiled.as_text(), *units)
    out["hlo_kernels"] = round(moved.total("kernels"))
    out["hlo_bytes"] = moved.total("bytes")
    out["h200_estimate_s"] = moved.seconds(*step_cost.H200)
    if profile:
        out["profile"], state = profile_step(compiled, state, tokens)
        # The share of the step the device spent in operations; the rest is launch
        # latency, host round trips (a conditional's predicate) and idle waits.
        out["profile"]["busy_fraction"] = out["profile"]["matched_s"] / step_s
    log(f"{name}: {step_s:.4f} s/step, compile {compile_s:.1f} s")
    return out


def run(
    config,
    names: list[str],
    steps: int,
    profile: bool,
    log=print,
    dump=None,
    microbatches: int = MICROBATCHES,
) -> dict:
    """Every variant in `names` (the pipelined ones with `microbatches`); each row's
    `vs_ref` is its step time over the first reference's (`ref` or `ref@POLICY`) in
    `names`. `dump(result)` after each variant keeps what was measured if a time limit
    cuts the run."""
    import jax  # after main() sets the XLA flags

    from seqpipe.models import model
    from seqpipe.models.model import GPTConfig  # jax: after main() sets the XLA flags
    from seqpipe.pipeline import spec  # jax: after main() sets the XLA flags

    dev = jax.devices()[0]
    cfg = GPTConfig.from_config(config.model)
    result = {
        "device_kind": dev.device_kind,
        "platform": dev.platform,
        "jax": jax.__version__,
        "peak_flops": peak_flops(dev.device_kind),
        "flops_per_token": model.flops_per_token(cfg, config.train.seq_len),
        "attention_halved": False,  # PaLM's count; mfu_causal halves it
        "global_batch_size": config.train.global_batch_size,
        "seq_len": config.train.seq_len,
        "attention": spec.attention_on(config.model.attention, dev.platform),
        "microbatches": microbatches,
        "steps": steps,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "rows": [],
    }
    rows = result["rows"]
    for name in names:
        try:
            rows.append(measure(config, name, steps, profile, log, microbatches))
        except Exception as e:  # out of memory, say: the row says so, the others run
            error = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"{name}: {error}")
            schedule = VARIANTS[name.partition("@")[0]][0]
            rows.append({"variant": name, "schedule": schedule, "error": error})
        jax.clear_caches()
        ref = next((r for r in rows if r["schedule"] == "none" and "step_s" in r), None)
        for r in rows:
            if "step_s" in r:
                r["vs_ref"] = r["step_s"] / ref["step_s"] if ref else None
        if dump:
            dump(result)
    return result


def pct(x) -> str:
    """A fraction as a percentage with one decimal, "-" for none."""
    return "-" if x is None else f"{100 * x:.1f}%"


def gib(nbytes, digits: int = 2) -> str:
    """Bytes in GiB with `digits` decimals, "-" for none."""
    return "-" if nbytes is None else f"{nbytes / 2**30:.{digits}f}"


def table(result: dict) -> str:
    """The console table: one row per variant, then each profiled variant's groups."""
    lines = [
        f"{result['device_kind']} ({result['platform']}), jax {result['jax']}, batch "
        f"{result['global_batch_size']} x seq {result['seq_len']}, {result['attention']} "
        f"attention, {result['microbatches']} micro-batches a pipelined step, "
        f"{result['steps']} timed steps; MFU: PaLM FLOPs (attention not halved; causal: "
        "halved) over "
        + (f"{result['peak_flops'] / 1e12:.0f} TFLOP/s" if result["peak_flops"] else "no peak"),
        "",
        "| variant | step s | vs ref | tokens/s | MFU | MFU causal | XLA temp GiB | "
        "device peak GiB | compile s | TB moved | H200 estimate s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['error'][:80]} |" + " |" * 9)
            continue
        vs = "-" if r["vs_ref"] is None else f"{r['vs_ref']:.2f}x"
        lines.append(
            f"| {r['variant']} | {r['step_s']:.4f} | {vs} | {r['tokens_per_s']:,.0f} | "
            f"{pct(r['mfu'])} | {pct(r['mfu_causal'])} | {gib(r['xla_temp_bytes'])} | "
            f"{gib(r['device_peak_bytes'])} | {r['compile_s']:.1f} | "
            f"{r['hlo_bytes'] / 1e12:.3f} | {r['h200_estimate_s']:.3f} |"
        )
    profiled = [r for r in result["rows"] if "profile" in r]
    if profiled:
        lines += [
            "",
            "Profile (one step): operations run, their mean time, the share of the step they "
            "fill (busy), and their time by group",
            "",
        ]
        head = "| variant | matched s | ops | mean op us | busy | "
        lines.append(head + " | ".join(GROUPS) + " |")
        lines.append("|---|---|---|---|---|" + "---|" * len(GROUPS))
        for r in profiled:
            p = r["profile"]
            shares = " | ".join(pct(p["groups_fraction"][g]) for g in GROUPS)
            lines.append(
                f"| {r['variant']} | {p['matched_s']:.4f} ({p['events_from']}) | {p['ops']:,} | "
                f"{p['mean_op_s'] * 1e6:.1f} | {pct(p['busy_fraction'])} | {shares} |"
            )
        for r in profiled:
            top = ", ".join(
                f"{t['op']} ({t['group']}) {t['s'] * 1e3:.1f} ms" for t in r["profile"]["top"][:5]
            )
            lines.append(f"\n{r['variant']} top ops: {top}")
    return "\n".join(lines) + "\n"


def parse(argv: list[str]):
    """(config, flags, variant names, the prediction or "") of a command line; bad input
    exits with one line, before anything is compiled."""

    def flags(parser):
        parser.add_argument("--quick", action="store_true", help="a tiny model (CPU, tests)")
        parser.add_argument("--json", default=None, help="write the results here")
        parser.add_argument("--steps", type=int, default=3, help="timed steps per variant")
        parser.add_argument(
            "--variants",
            default=None,
            help=f"of {', '.join(VARIANTS)}, each optionally @REMAT (ref@dots)",
        )
        parser.add_argument(
            "--microbatches",
            type=int,
            default=MICROBATCHES,
            help="micro-batches of the pipelined variants (32768 x 2: 2)",
        )
        parser.add_argument("--no_profile", action="store_true", help="skip the traced step")
        parser.add_argument(
            "--predict",
            default=None,
            help=f"seq1f1b:K[@REMAT] to predict against 1f1b on {PREDICT_STAGES} stages "
            f"from units timed here (default {predict.DEFAULT}, none with --quick; empty: none)",
        )

    argv = [a for a in argv if a != "--accelerator"]
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        argv = ["--config", DEFAULT_CONFIG] + argv
    if "--quick" in argv:  # the user's own overrides come later, so they win
        argv = list(QUICK) + argv
    config, args = cli.load_or_exit(argv, "python -m seqpipe.bench --accelerator", flags)
    cli.one_device_stages_or_exit(config, "python -m seqpipe.bench --accelerator")
    default = QUICK_VARIANTS if args.quick else DEFAULT_VARIANTS
    names = (default if args.variants is None else args.variants).split(",")
    names = [n for n in names if n]  # --variants= : the prediction alone
    for problem in filter(None, map(unknown_variant, names)):
        cli.fail(f"--variants: {problem}")
    default = QUICK_PREDICT if args.quick else predict.DEFAULT
    predicting = default if args.predict is None else args.predict
    if predicting and (problem := predict.problem(predicting, config.model.num_layers)):
        cli.fail(f"--predict: {problem}; --predict= skips it")
    if args.steps < 1:
        cli.fail(f"--steps={args.steps} must be at least 1")
    if args.microbatches < 1:
        cli.fail(f"--microbatches={args.microbatches} must be at least 1")
    for name in names:  # a micro-batch count the batch cannot split into, say
        cli.run_or_exit(lambda n=name: variant_config(config, n, args.microbatches))
    return config, args, names, predicting


def main(argv: list[str]) -> int:
    config, args, names, predicting = parse(argv)
    cli.quiet_libtpu()
    xla_flags.apply()  # as train.py does: GPU only, the user's XLA_FLAGS win

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    def dump(result):
        if not args.json:
            return
        if os.path.dirname(args.json):
            os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)

    result = run(config, names, args.steps, not args.no_profile, log, dump, args.microbatches)
    if names:
        sys.stdout.write(table(result))
    if predicting:
        result["prediction"] = predict.predict(config, predicting, log=log)
        dump(result)
        sys.stdout.write(("\n" if names else "") + predict.table(result["prediction"]))
    return 0
