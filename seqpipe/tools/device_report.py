"""What a run of scripts/device_accel.sh measured, against the goals of issues 13 and 14.

    python -m seqpipe.tools.device_report runs/device

Reads the JSON files the script's parts write (those there are; a missing one is named)
and prints, in Markdown:

- every measured step, file by file: step time, its ratio to the file's reference,
  tokens/s, MFU (PaLM, and with the attention halved), XLA's temporaries, the device's
  peak, compile time, and `step_cost`'s H200 estimate beside the measured time;
- the goals: the best reference's MFU at 2048 x 32 (50%), each pipelined step over the
  reference of its own run (1.10x), gpt_1b at 32768 x 2 (45% MFU), the fused kernel
  against `xla` at 8192 x 8 (2x);
- the pallas_gpu kernels' check against `xla`, the fastest exact tiling of the sweep, and
  the prediction of Seq1F1B over 1F1B on 4 and 8 GPUs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from seqpipe.tools import predict
from seqpipe.tools.accel import gib, pct

# The step files, in the order the script writes them (accel_noflags: without the XLA
# flags seqpipe sets on GPUs).
STEPS = (
    "accel_pallas.json",
    "accel.json",
    "accel_32k.json",
    "accel_8k_pallas.json",
    "accel_8k_xla.json",
    "accel_32k_blockwise.json",
    "accel_k.json",
    "accel_noflags.json",
)
TWO_K = ("accel_pallas.json", "accel.json", "accel_noflags.json")  # gpt_1b at 2048 x 32
OTHERS = ("accel_predict.json", "attention.json", "attention_sweep.json")
REFERENCE_MFU = 0.50  # issue 14: gpt_1b's reference at 2048 x 32
PIPELINE_OVER_REFERENCE = 1.10  # issue 14: 1f1b M=8 and seq1f1b M=8 K=4 on one stage
LONG_MFU = 0.45  # issue 13: gpt_1b at 32768 x 2
FUSED_OVER_XLA = 2.0  # issue 13: the reference at 8192 x 8


def load(directory: Path) -> dict[str, dict]:
    """Each of the script's JSON files in `directory` that is there and reads whole."""
    out = {}
    for name in (*STEPS, *OTHERS):
        try:
            out[name] = json.loads((directory / name).read_text())
        except (OSError, ValueError):
            continue
    return out


def steps_table(results: dict[str, dict]) -> list[str]:
    lines = [
        "| run | variant | step s | vs ref | tokens/s | MFU | MFU causal | XLA temp GiB | "
        "peak GiB | compile s | H200 estimate s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in STEPS:
        what = _run(name, results)
        for r in results.get(name, {}).get("rows", []):
            if "error" in r:
                lines.append(f"| {what} | {r['variant']} | {r['error'][:60]} |" + " |" * 8)
                continue
            vs = "-" if r.get("vs_ref") is None else f"{r['vs_ref']:.2f}x"
            lines.append(
                f"| {what} | {r['variant']} | {r['step_s']:.3f} | {vs} | "
                f"{r['tokens_per_s']:,.0f} | {pct(r['mfu'])} | {pct(r['mfu_causal'])} | "
                f"{gib(r['xla_temp_bytes'], 1)} | {gib(r['device_peak_bytes'], 1)} | "
                f"{r['compile_s']:.0f} | {r['h200_estimate_s']:.2f} |"
            )
    return lines


def _run(name: str, results: dict[str, dict]) -> str:
    """A step file's name, shape and attention: `accel_32k, 32768 x 2, pallas_gpu`."""
    res = results.get(name, {})
    shape = f"{res.get('seq_len')} x {res.get('global_batch_size')}"
    return f"{name.removesuffix('.json')}, {shape}, {res.get('attention')}"


def _rows(results, name):
    return [r for r in results.get(name, {}).get("rows", []) if "step_s" in r]


def _verdict(value, goal, met: bool) -> str:
    return f"{value} (goal {goal}: {'met' if met else 'not met'})"


def goals(results: dict[str, dict]) -> list[str]:
    """One line per goal: what was measured against it, or that nothing was."""
    lines = []
    refs = [(n, r) for n in TWO_K for r in _rows(results, n) if r["schedule"] == "none"]
    if any(r["mfu"] is not None for _, r in refs):
        name, best = max(refs, key=lambda nr: nr[1]["mfu"] or 0.0)
        value = f"{pct(best['mfu'])} ({best['variant']}, {_run(name, results)})"
        met = best["mfu"] >= REFERENCE_MFU
        lines.append("- reference MFU: " + _verdict(value, f"{REFERENCE_MFU:.0%}", met))
    else:  # none ran, or on a device whose peak seqpipe does not know (a CPU)
        lines.append("- reference MFU: not measured")
    for name in TWO_K[:2]:
        for r in _rows(results, name):
            if r["schedule"] != "none" and r["segments"] in (1, 4) and r.get("vs_ref"):
                met = r["vs_ref"] <= PIPELINE_OVER_REFERENCE
                value = f"{r['vs_ref']:.2f}x ({_run(name, results)})"
                goal = f"<= {PIPELINE_OVER_REFERENCE:.2f}x"
                lines.append(f"- {r['variant']} over the reference: " + _verdict(value, goal, met))
    long = [
        (n, r) for n in ("accel_32k.json", "accel_32k_blockwise.json") for r in _rows(results, n)
    ]
    if long and long[0][1]["mfu"] is not None:
        name, r = long[0]
        peak = gib(r["device_peak_bytes"], 1)
        value = (
            f"{pct(r['mfu'])}, {r['tokens_per_s']:,.0f} tokens/s, peak {peak} GiB "
            f"({r['variant']}, {_run(name, results)})"
        )
        lines.append("- 32768 x 2: " + _verdict(value, f"{LONG_MFU:.0%}", r["mfu"] >= LONG_MFU))
    else:
        lines.append("- 32768 x 2: not measured")
    fused, plain = _rows(results, "accel_8k_pallas.json"), _rows(results, "accel_8k_xla.json")
    if fused and plain:
        ratio = plain[0]["step_s"] / fused[0]["step_s"]
        value = f"xla / pallas_gpu step time {ratio:.2f}x"
        met = ratio >= FUSED_OVER_XLA
        lines.append("- 8192 x 8: " + _verdict(value, f">= {FUSED_OVER_XLA:.0f}x", met))
    else:
        lines.append("- 8192 x 8: not measured (needs both the pallas_gpu and the xla file)")
    return lines


def attention_lines(results: dict[str, dict]) -> list[str]:
    lines = []
    check = results.get("attention.json")
    if check is None:
        lines.append("- pallas_gpu against xla on the GPU: not measured")
    else:
        for key in ("exact", "cached"):
            c = check.get(key)
            lines.append(f"- pallas_gpu {key}: " + ("did not run" if c is None else json.dumps(c)))
        for row in check.get("timed", []):
            lines.append(
                f"- {row['impl']} P{row['prefix']} Q{row['q']}: {row['ms']} ms, "
                f"{row['tflops']} TFLOP/s"
            )
        lines += [f"- error: {e[:200]}" for e in check.get("errors", [])]
    sweep = results.get("attention_sweep.json")
    if sweep is not None:
        fastest = sweep.get("fastest")
        lines.append(
            "- fastest exact tiling: "
            + ("none" if fastest is None else f"{fastest['blocks']}, {fastest['ms']} ms")
        )
    return lines


def report(directory: Path) -> str:
    results = load(directory)
    missing = [n for n in (*STEPS, *OTHERS) if n not in results]
    kinds = {r.get("device_kind") for n, r in results.items() if n in STEPS}
    out = [
        f"# Device run in {directory} ({', '.join(sorted(map(str, kinds))) or 'no steps'})",
        "",
        "## Goals",
        "",
        *goals(results),
        "",
        "## Steps",
        "",
        *steps_table(results),
        "",
        "## Attention kernels",
        "",
        *attention_lines(results),
    ]
    prediction = results.get("accel_predict.json", {}).get("prediction")
    if prediction:
        out += ["", "## Seq1F1B over 1F1B on 4 and 8 GPUs", "", predict.table(prediction)]
    if missing:
        out += ["", f"Not there (a part not run, or cut by its time limit): {', '.join(missing)}"]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(
            "error: name the directory a device run wrote (OUT, runs/device by default): "
            "python -m seqpipe.tools.device_report DIR",
            file=sys.stderr,
        )
        return 2
    sys.stdout.write(report(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
