"""Compiling the best candidates for the target: the compiled memory replaces the estimate."""

from __future__ import annotations

from seqpipe.plan import rank


def confirm(row: dict, devices, budget: int, compile_step) -> dict:
    """The row with its step compiled for `devices` by `compile_step` (`train.compile_config`,
    without the evaluation): compiled memory per device, whether it fits `budget`, the compile's
    seconds, and the estimate's error against it."""
    try:
        report = compile_step(row["config"], devices, with_evaluation=False)
    except Exception as e:  # the compiler (or the trace) refused it: a reason, not a crash
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return row | {"fits": False, "compile_error": f"{type(e).__name__}: {first}"}
    peak = int(report["peak_memory_per_device_bytes"])
    estimate = row["memory_per_device_bytes"]
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
    compiled; returns every row, the compiled ones replaced. `tick(label)` after each."""
    done: dict[int, dict] = {}
    for row in rank.ranked(rows)[:tries]:
        if sum(r["fits"] for r in done.values()) >= count:
            break
        done[id(row)] = confirm(
            row, devices, budget, compile_step
        )  # fits False where it did not compile
        tick(row["label"])
    return [done.get(id(r), r) for r in rows]
