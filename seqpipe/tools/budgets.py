"""Memory budgets: per-device bytes of compiled steps, on each target, that a change may
not raise unseen.

    python -m seqpipe.tools.budgets [--suite default|paper|all] [--only NAME,...]
        [--update] [--file tests/memory_budgets.json]

Each row of the budgets file (`BUDGETS`) is a `train.py --compile_only` command: a config,
its overrides and a target (`cpu`: fake CPU devices; a Cloud TPU slice or a GPU system
for `--topology`). Its budget is the step's peak bytes a device, as that command reports
them (`peak_memory_per_device_bytes`: the train step's or the evaluation's, whichever is
larger). A row may rise at most `tolerance` (a fraction) above its budget: a larger rise
fails (`tests/test_budgets.py`, `make budgets`) until the file is rewritten (`--update`,
`make budgets-update`), so that the rise shows in review. A fall is reported; `--update`
tightens the row to it.

The `default` rows are small (a few layers at a real width, several segments, tensor
parallelism, the zero-bubble and interleaved tables) and run in the default test suite;
the `paper` rows are the headline runs (`make budgets`, `make test-all`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUDGETS = REPO / "tests" / "memory_budgets.json"
SUITES = ("default", "paper")
UPDATE = "make budgets-update (python -m seqpipe.tools.budgets --update)"
GiB = 2**30


class BudgetError(ValueError):
    """A budgets file that cannot be read; the message is one line."""


def load(path: Path = BUDGETS) -> dict:
    """The budgets file: {"tolerance": fraction, "rows": [row, ...]}."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BudgetError(f"cannot read the budgets file {path}: {e}") from None
    names = [row.get("name") for row in data.get("rows", [])]
    if len(set(names)) != len(names) or None in names:
        raise BudgetError(f"{path}: every row needs a name of its own; found {names}")
    return data


def rows_of(data: dict, suite: str = "all", only: tuple[str, ...] = ()) -> list[dict]:
    """The rows of `suite` ("all" for every one), or those named in `only`."""
    rows = [r for r in data["rows"] if suite == "all" or r["suite"] == suite]
    if only:
        unknown = set(only) - {r["name"] for r in data["rows"]}
        if unknown:
            names = ", ".join(r["name"] for r in data["rows"])
            raise BudgetError(f"no budget row named {sorted(unknown)}; the rows are: {names}")
        rows = [r for r in data["rows"] if r["name"] in only]
    return rows


def command(row: dict) -> list[str]:
    """The train.py arguments that compile `row`'s step."""
    args = ["train.py", "--config", row["config"], "--compile_only"]
    if row["target"] != "cpu":
        args += ["--topology", row["target"]]
    return args + [f"--config.{key}={value}" for key, value in row["overrides"].items()]


def measure(row: dict, timeout: float = 3600) -> dict:
    """`row`'s --compile_only report (its JSON), compiled in a process of its own: a
    target's compiler is chosen before jax starts, and the CPU device count from the mesh."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, *command(row)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = proc.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("{"):
        raise BudgetError(
            f"{row['name']}: the compile failed (exit {proc.returncode}): "
            f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}"
        )
    return json.loads(lines[-1])


def verdict(row: dict, peak: int, tolerance: float) -> tuple[str, str]:
    """("rose" | "fell" | "ok" | "new", one line) for `row` measured at `peak` bytes a
    device ("new": the row has no budget yet)."""
    if "peak_bytes" not in row:
        return "new", f"{row['name']} ({row['target']}): peak {peak / GiB:.3f} GiB a device"
    budget = row["peak_bytes"]
    change = peak / budget - 1
    text = (
        f"{row['name']} ({row['target']}): peak {peak / GiB:.3f} GiB a device, "
        f"{change:+.1%} against its budget of {budget / GiB:.3f} GiB "
        f"({peak - budget:+,} bytes; tolerance {tolerance:.0%})"
    )
    if change > tolerance:
        return "rose", (
            f"{text}: a rise must change the budgets file; if it is meant, run {UPDATE} "
            "and commit tests/memory_budgets.json with the change"
        )
    if change < -tolerance:
        return "fell", f"{text}: it may be tightened with {UPDATE}"
    return "ok", text


def updated(data: dict, peaks: dict[str, dict]) -> dict:
    """`data` with each measured row's budget set to its peak (and the parts of it)."""
    day = datetime.date.today().isoformat()
    rows = []
    for row in data["rows"]:
        report = peaks.get(row["name"])
        if report is not None:
            mem = report["memory_per_device_bytes"]
            row = {
                **row,
                "peak_bytes": report["peak_memory_per_device_bytes"],
                "peak_gib": round(report["peak_memory_per_device_bytes"] / GiB, 3),
                "arguments_gib": round(mem["arguments"] / GiB, 3),
                "temporaries_gib": round(mem["temporaries"] / GiB, 3),
                "measured": f"{day}, {report['device_kind']}",
            }
        rows.append(row)
    return {**data, "rows": rows}


def write(data: dict, path: Path = BUDGETS) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m seqpipe.tools.budgets")
    parser.add_argument("--suite", choices=(*SUITES, "all"), default="all")
    parser.add_argument("--only", default="", help="comma-separated row names")
    parser.add_argument("--update", action="store_true", help="rewrite the measured rows")
    parser.add_argument("--file", type=Path, default=BUDGETS)
    args = parser.parse_args(argv)
    try:
        data = load(args.file)
        only = tuple(n for n in args.only.split(",") if n)
        rows = rows_of(data, args.suite, only)
        peaks, rose = {}, False
        for row in rows:
            peaks[row["name"]] = report = measure(row)
            state, line = verdict(row, report["peak_memory_per_device_bytes"], data["tolerance"])
            rose |= state == "rose"
            print(f"{state:4}  {line}; compiled in {report['compile_s']} s", flush=True)
    except BudgetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.update:
        write(updated(data, peaks), args.file)
        print(f"wrote {len(peaks)} budgets to {args.file}")
        return 0
    return 1 if rose else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
