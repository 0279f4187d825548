"""What the planner prints: the ranked table, the rejected candidates, the comparison with
hand-picked settings, the winner's command, and the JSON of the last line."""

from __future__ import annotations

import json
import shlex

from seqpipe.plan import rank
from seqpipe.plan.space import Candidate

GiB = 2**30


def command(config_name: str, c: Candidate, seq_len: int, batch: int, extra: dict) -> str:
    """The `python train.py ...` line that runs the candidate."""
    keys = {**extra, "train.seq_len": seq_len, "train.global_batch_size": batch}
    keys.update(c.overrides())
    flags = [f"--config.{k}={v}" for k, v in keys.items()]
    return " ".join(["python", "train.py", "--config", shlex.quote(config_name), *flags])


def _mfu(row: dict) -> str:
    return "-" if row.get("mfu") is None else f"{100 * row['mfu']:.1f}%"


def table(rows: list[dict]) -> str:
    """The ranked rows as Markdown; `source` says which memory figure was compiled."""
    lines = [
        "| # | candidate (data x stage x tensor, C context, schedule, M, K, V, depth, remat) "
        "| step s "
        "| tokens/s | MFU causal | memory GiB | memory | bubble |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        lines.append(
            f"| {i} | {r['label']} | {r['step_s']:.4g} | {r['tokens_per_s']:,.0f} | "
            f"{_mfu(r)} | {r['memory_per_device_bytes'] / GiB:.2f} | {r['memory_source']} | "
            f"{r['bubble']:.3f} |"
        )
    return "\n".join(lines)


def rejected(rows: list[dict], best: dict | None, budget: int, limit: int) -> str:
    """The first `limit` rejected rows (compiled ones first, then the fastest), with the
    reason for each, and how many more."""
    # Compiled first, then estimated, then bounded only, then never estimated; fastest first.
    order = sorted(
        rows,
        key=lambda r: (
            r.get("memory_source") != "compiled",
            "invalid" in r,
            "pruned" in r,
            "unexplored" in r,
            r.get("step_s", r.get("pruned", r.get("unexplored", float("inf")))),
        ),
    )
    lines = [f"- {r['label']}: {rank.reason(r, best, budget)}" for r in order[:limit]]
    if len(order) > limit:
        counts = {}
        for r in order[limit:]:
            key = rank.reason(r, best, budget).split(":")[0].split(" by ")[0]
            key += " (bound)" if "pruned" in r else ""
            key = key.split(" GiB")[0] if "state_over" in r else key
            counts[key] = counts.get(key, 0) + 1
        more = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        lines.append(f"- and {len(order) - limit} more: {more}")
    return "\n".join(lines)


def comparison(items: list[dict]) -> str:
    lines = [
        "| setting | candidate | step s | memory | winner's speed-up | winner no worse |",
        "|---|---|---|---|---|---|",
    ]
    for it in items:
        if "invalid" in it:
            lines.append(
                f"| {it['setting']} | {it['label']} | - | invalid: {it['invalid']} | - | - |"
            )
            continue
        lines.append(
            f"| {it['setting']} | {it['label']} | {it['step_s']:.4g} | {it['verdict']} | "
            f"{it['winner_speedup']:.3f}x | {'yes' if it['winner_no_worse'] else 'NO'} |"
        )
    return "\n".join(lines)


def json_row(row: dict) -> dict:
    """A row's JSON: the candidate's keys and the figures, none of the config objects."""
    keep = ("label", "step_s", "tokens_per_s", "mfu", "bubble", "memory_per_device_bytes")
    out = {k: row[k] for k in keep if k in row}
    out["keys"] = row["candidate"].overrides()
    out["memory_source"] = row.get("memory_source")
    for k in ("verdict", "fits", "memory_estimate_bytes", "estimate_error", "compile_s"):
        if k in row:
            out[k] = row[k]
    return out


def last_line(best: dict, cmd: str, others: list[dict], extra: dict) -> str:
    """The `--json` line: `winner` (its row, `command`, `memory_per_device_bytes`) and
    `candidates` (the other rows), beside `extra`."""
    winner = json_row(best) | {"command": cmd}
    return json.dumps({**extra, "winner": winner, "candidates": [json_row(r) for r in others]})
