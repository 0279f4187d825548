"""Compiling the best candidates for the target: the compiled memory replaces the estimate."""

from __future__ import annotations

from seqpipe.plan import rank
from seqpipe.targets import topology


def confirm(row: dict, devices, budget: int, compile_step) -> dict:
    """The row with its step compiled for `devices` by `compile_step` (`train.compile_config`,
    without the evaluation): compiled memory per device, whether it fits `budget`, the compile's
    seconds, and the estimate's error against it."""
    estimate = row["memory_per_device_bytes"]
    try:
        report = compile_step(row["config"], devices, with_evaluation=False)
    except Exception as e:  # the compiler (or the trace) refused it: a reason, not a crash
        need = topology.refused_need(str(e))
        if need is not None:  # over a TPU's HBM: its need, a lower bound on the peak
            return row | {
                "memory_per_device_bytes": need,
                "memory_source": "compiled",
                "memory_estimate_bytes": estimate,
                "over_hbm": True,
                "fits": False,
            }
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return row | {"fits": False, "compile_error": f"{type(e).__name__}: {first}"}
    peak = int(report["peak_memory_per_device_bytes"])
    return row | {
        "memory_per_device_bytes": peak,
        "memory_source": "compiled",
        "memory_estimate_bytes": estimate,
        "estimate_error": estimate / peak - 1,
        "fits": peak <= budget,
        "compile_s": report["compile_s"],
    }


def confirm_best(
    rows: list[dict], devices, budget: int, count: int, tries: int, tick, compile_step
) -> list:
    """Compile the fastest runnable rows in order until `count` fit or `tries` were
    compiled; returns every row, the compiled ones replaced. `tick(label)` after each.

    A compile that needs more than its estimate says the model runs low for this target
    and problem: the rows after it are read at the largest such ratio seen, and a row over
    the budget at that ratio is passed over (left estimated, not rejected), so the tries
    go to candidates that may fit rather than to the next fastest of the same size.

    The tries left then go to the rows faster than the fastest that fit (`challenge`)."""
    done: dict[int, dict] = {}
    low_by = 1.0  # the largest compiled / estimated ratio seen
    for row in rank.ranked(rows):
        if len(done) >= tries or sum(r["fits"] for r in done.values()) >= count:
            break
        if row["memory_per_device_bytes"] * low_by > budget:
            continue
        out = done[id(row)] = confirm(row, devices, budget, compile_step)
        if "memory_estimate_bytes" in out:
            low_by = max(low_by, out["memory_per_device_bytes"] / out["memory_estimate_bytes"])
        tick(row["label"])
    challenge(rows, done, devices, budget, tries, tick, compile_step)
    return [done.get(id(r), r) for r in rows]


def challenge(rows, done: dict, devices, budget: int, tries: int, tick, compile_step) -> None:
    """Compile, leanest estimate first, the rows faster than the fastest compiled row that
    fits, while tries are left: rows estimated over the budget but within the model's
    error, which only a compile can rule out. One that fits becomes the one to beat."""
    fitting = [r["step_s"] for r in done.values() if r["fits"]]
    if not fitting:
        return
    best = min(fitting)
    faster = [r for r in rank.ranked(rows) if id(r) not in done and r["step_s"] < best]
    for row in sorted(faster, key=lambda r: (r["memory_per_device_bytes"], r["step_s"])):
        if len(done) >= tries:
            break
        if row["step_s"] >= best:
            continue
        out = done[id(row)] = confirm(row, devices, budget, compile_step)
        tick(row["label"])
        if out["fits"]:
            best = out["step_s"]


def unconfirmed(rows: list[dict], best: dict) -> list[dict]:
    """The runnable rows faster than the winner that no compile has checked."""
    return [
        r
        for r in rank.ranked(rows)
        if r["step_s"] < best["step_s"] and r.get("memory_source") != "compiled"
    ]
