"""Ranking rows and saying why the others lost: pure functions over `search.evaluate` rows."""

from __future__ import annotations

from seqpipe.plan.bounds import LOW

GiB = 2**30


def runnable(row: dict) -> bool:
    """Valid, not rejected by the analytic model, and not refused by a compile."""
    if any(k in row for k in ("invalid", "pruned", "unexplored", "state_over")):
        return False
    return row["verdict"] != "over" and row.get("fits", True)


def ranked(rows: list[dict]) -> list[dict]:
    """The runnable rows, fastest first (ties: compiled first, then less memory, then the
    label: an estimate that ties the winner does not rank above it)."""
    return sorted(
        (r for r in rows if runnable(r)),
        key=lambda r: (
            r["step_s"],
            r.get("memory_source") != "compiled",
            r["memory_per_device_bytes"],
            r["label"],
        ),
    )


def winner(rows: list[dict]) -> dict | None:
    """The fastest row whose memory a compile confirmed."""
    return next((r for r in ranked(rows) if r.get("memory_source") == "compiled"), None)


def reason(row: dict, best: dict | None, budget: int) -> str:
    """Why `row` is not the winner, one line."""
    if "invalid" in row:
        return f"not a valid setting: {row['invalid']}"
    if "state_over" in row:
        got = row["state_over"]
        return (
            f"does not fit (exact): its parameters and moments alone take {got / GiB:.2f} GiB "
            f"of {budget / GiB:.2f}"
        )
    if "unexplored" in row:
        return "not estimated: past the estimate cap (plan.LIMIT) in the lower bound's order"
    if "pruned" in row:
        if best is None:
            return "pruned: slower than the best by its bound"
        slower = row["pruned"] / best["step_s"] - 1
        return f"slower than the winner by at least {100 * slower:.1f}% (its bound, not estimated)"
    if "compile_error" in row:
        return f"does not compile for the target: {row['compile_error']}"
    if row.get("over_hbm"):
        got = row["memory_per_device_bytes"]
        return (
            f"does not fit (compiled): the TPU compiler refused it, its temporaries alone "
            f"{got / GiB:.2f} GiB of {budget / GiB:.2f}"
        )
    if row.get("fits") is False:
        got = row["memory_per_device_bytes"]
        return (
            f"does not fit (compiled): {got / GiB:.2f} GiB of {budget / GiB:.2f}, "
            f"over by {(got - budget) / GiB:.2f} GiB"
        )
    if row["verdict"] == "over":
        low = row["memory_per_device_bytes"] * LOW
        return (
            f"does not fit (estimated): at least {low / GiB:.2f} GiB of {budget / GiB:.2f}, "
            f"over by {(low - budget) / GiB:.2f} GiB"
        )
    if best is None:
        return "not compiled"
    slower = row["step_s"] / best["step_s"] - 1
    return f"slower than the winner by {100 * slower:.1f}%"


def smallest(rows: list[dict]) -> dict | None:
    """The valid row of least memory (for a model that fits nowhere)."""
    valid = [r for r in rows if "memory_per_device_bytes" in r or "state_over" in r]
    return min(valid, key=need, default=None)


def need(row: dict) -> int:
    """The least memory a row may take: compiled, estimated, or its exact state."""
    return row.get("memory_per_device_bytes", row.get("state_over", 0))


def comparison(best: dict, picks: list[tuple[str, dict]]) -> list[dict]:
    """The winner against hand-picked settings under the same model: each pick's step,
    whether it fits, and the winner's speed-up over it (None where a pick is invalid)."""
    out = []
    for name, row in picks:
        if "invalid" in row:
            out.append({"setting": name, "label": row["label"], "invalid": row["invalid"]})
            continue
        out.append(
            {
                "setting": name,
                "label": row["label"],
                "step_s": row["step_s"],
                "verdict": row["verdict"] if row.get("fits", True) else "over (compiled)",
                "winner_speedup": row["step_s"] / best["step_s"],
                "winner_no_worse": best["step_s"] <= row["step_s"],
            }
        )
    return out
