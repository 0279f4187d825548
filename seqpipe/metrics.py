"""Training metrics: console lines and WORKDIR/metrics.jsonl (one JSON object per logged step)."""

import json
import sys
import time
from pathlib import Path


class MetricsLog:
    """Writes logged steps to the console and to metrics.jsonl; only the main process writes."""

    def __init__(self, workdir: str | Path, total_steps: int, enabled: bool = True):
        self.enabled = enabled
        self.total_steps = total_steps
        self.path = Path(workdir) / "metrics.jsonl"
        self._file = open(self.path, "a") if enabled else None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        print(format_line(record, self.total_steps), flush=True)

    def close(self) -> None:
        if self._file:
            self._file.close()


def format_line(record: dict, total_steps: int) -> str:
    parts = [f"step {record['step']:>{len(str(total_steps))}}/{total_steps}"]
    for key, fmt in (
        ("loss", "loss {:.4f}"),
        ("eval_loss", "eval_loss {:.4f}"),
        ("learning_rate", "lr {:.2e}"),
        ("grad_norm", "grad_norm {:.3f}"),
        ("tokens_per_s", "tok/s {:,.0f}"),
        ("step_time_s", "step {:.3f}s"),
    ):
        if key in record:
            parts.append(fmt.format(record[key]))
    return "  ".join(parts)


class Throughput:
    """Tokens per second between successive logged steps, measured on the host clock."""

    def __init__(self):
        self._time = time.perf_counter()
        self._step = 0

    def update(self, step: int, tokens_per_step: int) -> tuple[float, float]:
        now = time.perf_counter()
        steps = max(step - self._step, 1)
        elapsed = now - self._time
        self._time, self._step = now, step
        return tokens_per_step * steps / elapsed, elapsed / steps


def error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
