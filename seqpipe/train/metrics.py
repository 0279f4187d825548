"""Training metrics: console, WORKDIR/metrics.jsonl and TensorBoard event files in WORKDIR.

FLOPs follow PaLM's convention (`model.flops_per_token`: 6N + 12 * layers * d_model *
seq_len per token, N the non-embedding matmul and head parameters). MFU is achieved model
FLOP/s over the devices' dense bf16 peak from `PEAK_FLOPS` (per chip, from the vendors'
data sheets); on a device kind not in the table (and on CPU) only the achieved FLOP/s are
reported.
"""

import json
import math
import sys
import time
from pathlib import Path

from seqpipe.host.files import atomic_write_bytes

# Dense (no sparsity) bf16 peak FLOP/s per device, keyed by a prefix of `device.device_kind`.
PEAK_FLOPS = {
    "TPU v2": 45e12,
    "TPU v3": 123e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,  # v6e (Trillium)
    "TPU v6e": 918e12,
    "NVIDIA A100": 312e12,
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100": 989e12,  # SXM
    "NVIDIA H200": 989e12,
    "NVIDIA H800": 989e12,
    "NVIDIA GH200": 989e12,
    "NVIDIA B200": 2250e12,
    "NVIDIA L4": 121e12,
    "NVIDIA A10G": 70e12,
    "NVIDIA L40S": 362e12,
}


def peak_flops(device_kind: str) -> float | None:
    """Peak dense bf16 FLOP/s of one device of this kind, or None if unknown (e.g. CPU)."""
    matches = [k for k in PEAK_FLOPS if device_kind.startswith(k)]
    return PEAK_FLOPS[max(matches, key=len)] if matches else None


def device_memory_peak(devices) -> int | None:
    """Largest `peak_bytes_in_use` over the devices, where the backend reports it."""
    peaks = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


class MetricsError(RuntimeError):
    """metrics.jsonl could not be written (a full disk, say)."""


class MetricsLog:
    """Writes logged steps to the console, metrics.jsonl and TensorBoard; only if enabled
    (the main process). On a terminal a progress bar with ETA sits below the lines."""

    def __init__(
        self, workdir: str | Path, total_steps: int, enabled: bool = True, start_step: int = 0
    ):
        self.enabled = enabled
        self.total_steps = total_steps
        self.path = Path(workdir) / "metrics.jsonl"
        self._file, self._tb, self._broken = None, None, False
        self._workdir, self._start_step = workdir, start_step
        if enabled:
            # A run resumed from step s drops what an earlier attempt logged after s
            # (a crash between checkpoints), here and in TensorBoard (purge_step).
            _drop_after(self.path, start_step)
            self._file = open(self.path, "a")
        self.progress = Progress(total_steps, start_step) if enabled and _isatty() else None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as e:
            self._broken = True  # what the buffer kept would fail again on close
            raise MetricsError(
                f"writing step {record['step']} to {self.path} failed ({e.strerror or e})"
            ) from None
        if self._tb is None:  # opened on the first record: a run with nothing to do opens none
            from tensorboardX import SummaryWriter

            purge = self._start_step + 1 if self._start_step else None
            # tensorboardX writes from a thread, and its flush() does not wait for that
            # thread's queue: a flush per line would promise what it cannot keep. Its own
            # flush every second bounds what a SIGKILL loses (metrics.jsonl loses nothing).
            self._tb = SummaryWriter(str(self._workdir), flush_secs=1, purge_step=purge)
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float) and math.isfinite(value):
                self._tb.add_scalar(key, value, record["step"])
        self.print(format_line(record, self.total_steps))

    def print(self, line: str) -> None:
        """A console line (main process only), drawn above the progress bar."""
        if not self.enabled:
            return
        if self.progress:
            self.progress.clear()
        print(line, flush=True)
        if self.progress:
            self.progress.draw()

    def step(self, step: int) -> None:
        if self.progress:
            self.progress.update(step)

    def restart_clock(self, step: int) -> None:
        """Measure the rate (and ETA) from `step` on: called after the first step, whose
        time is mostly compilation and says nothing of the steps to come."""
        if self.progress:
            self.progress.restart(step)

    def close(self) -> None:
        if self.progress:
            self.progress.clear()
        if self._tb:
            self._tb.close()
        if self._file:
            try:
                self._file.close()
            except OSError:
                if not self._broken:
                    raise


def _drop_after(path: Path, step: int) -> None:
    if not path.is_file():  # absent, or a device or pipe a user pointed it at
        return
    lines = path.read_text().splitlines()
    keep = [x for x in lines if _step_of(x) is not None and _step_of(x) <= step]
    if len(keep) != len(lines):
        atomic_write_bytes(path, "".join(x + "\n" for x in keep).encode())


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # a line cut short by a crash


def _isatty() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def format_line(record: dict, total_steps: int) -> str:
    parts = [f"step {record['step']:>{len(str(total_steps))}}/{total_steps}"]
    for key, fmt in (
        ("loss", "loss {:.4f}"),
        ("eval_loss", "eval_loss {:.4f}"),
        ("aux_loss", "aux_loss {:.4f}"),
        ("z_loss", "z_loss {:.3f}"),
        ("dropped", "dropped {:.2%}"),
        ("learning_rate", "lr {:.2e}"),
        ("grad_norm", "grad_norm {:.3f}"),
        ("tokens_per_s", "tok/s {:,.0f}"),
        ("step_time_s", "step {:.3f}s"),
        ("first_step_s", "first step (with compilation) {:.1f}s"),
        ("mfu", "mfu {:.1%}"),
        ("flops_per_s", "{:.3g} FLOP/s"),
        ("peak_memory_bytes", "mem {}"),
    ):
        if key == "flops_per_s" and "mfu" in record:
            continue  # MFU says it where the peak is known
        if key == "dropped" and not record.get(key):
            continue  # a mixture's capacity dropped nothing (or it has none)
        if key in record:
            value = record[key]
            parts.append(fmt.format(_bytes(value) if key == "peak_memory_bytes" else value))
    if record.get("bad_steps"):  # said only once there is something to say
        in_row = record.get("bad_steps_in_row")
        parts.append(f"skipped {record['bad_steps']}" + (f" ({in_row} in a row)" if in_row else ""))
    return "  ".join(parts)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


class Progress:
    """A one-line bar with rate and ETA, redrawn in place on a terminal."""

    WIDTH = 30

    def __init__(self, total: int, start: int = 0, stream=None):
        self.total, self.start, self.step = total, start, start
        self.stream = stream or sys.stdout
        self._t0 = time.perf_counter()
        self._shown = False

    def update(self, step: int) -> None:
        self.step = step
        self.draw()

    def restart(self, step: int) -> None:
        self.start, self._t0 = step, time.perf_counter()

    def text(self) -> str:
        done = self.step - self.start  # since the clock was last restarted
        elapsed = time.perf_counter() - self._t0
        rate = done / elapsed if elapsed > 0 and done else 0.0
        eta = (self.total - self.step) / rate if rate else float("nan")
        filled = int(self.WIDTH * self.step / max(self.total, 1))
        bar = "#" * filled + "." * (self.WIDTH - filled)
        return f"[{bar}] {self.step}/{self.total}  {rate:.2f} step/s  eta {_duration(eta)}"

    def draw(self) -> None:
        self.stream.write("\r" + self.text() + "\x1b[K")
        self.stream.flush()
        self._shown = True

    def clear(self) -> None:
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "--:--"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Throughput:
    """Tokens per second between successive logged steps, measured on the host clock."""

    def __init__(self, start_step: int = 0):
        self._time = time.perf_counter()
        self._step = start_step

    def reset(self, step: int) -> None:
        """Start measuring afresh after `step` (e.g. once compilation is done)."""
        self._time, self._step = time.perf_counter(), step

    def update(self, step: int, tokens_per_step: int) -> tuple[float, float]:
        now = time.perf_counter()
        steps = max(step - self._step, 1)
        elapsed = now - self._time
        self._time, self._step = now, step
        return tokens_per_step * steps / elapsed, elapsed / steps
