"""What stops a run before its last step: a signal (`StopRequest`), or too many steps in
a row with a non-finite loss or gradient norm (`BadSteps`)."""

import dataclasses
import os
import signal
import threading

import jax

from seqpipe.errors import TrainingError
from seqpipe.host import runtime_log, signals


class StopRequest:
    """SIGTERM/SIGINT set a flag the loop checks after each step; a second SIGINT aborts.

    With several processes, all must stop at the same step: SIGTERM is left to JAX's
    preemption service (`reached_preemption_sync_point`), which agrees on a step across
    processes, and SIGINT is forwarded to it as a SIGTERM.
    """

    def __init__(self, kept: str = "run again to resume"):
        self.signal_name: str | None = None
        self.kept = kept  # what the second Ctrl-C's line says of the checkpoints
        self._previous = {}
        self._multi = jax.process_count() > 1

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self  # signals can only be caught on the main thread
        signals = (signal.SIGINT,) if self._multi else (signal.SIGTERM, signal.SIGINT)
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        # Past the loop the start-up handlers are back: a signal ends the process at once.
        signals.set_context("while finishing", self.kept)

    def _handle(self, signum, frame):
        # Two Ctrl-Cs during one long call into C (the first compilation) reach Python as
        # one call of this handler; the wakeup pipe counts each.
        sigints = signals.count_sigints()
        if signum == signal.SIGINT and (self.signal_name == "SIGINT" or sigints >= 2):
            # The second Ctrl-C: out now, in one line. An exception would unwind through
            # whatever runs (an orbax save, which logs it with a traceback); a save it cuts
            # is removed at the next start, and the kernel drops the workdir's lock.
            stopped = f"stopped by a second Ctrl-C, without saving; {self.kept}"
            runtime_log.exit_at_once(stopped, 130)
        self.signal_name = signal.Signals(signum).name
        if self._multi:
            os.kill(os.getpid(), signal.SIGTERM)  # to JAX's preemption notifier

    def requested(self, step: int) -> bool:
        if self._multi:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                self.signal_name = self.signal_name or "SIGTERM"
                return True
            return False
        return self.signal_name is not None


@dataclasses.dataclass
class BadSteps:
    """Steps skipped for a non-finite loss or gradient norm: in all, and the current run."""

    total: int = 0
    in_row: int = 0

    def count(self, skipped: bool) -> None:
        if skipped:
            self.total += 1
            self.in_row += 1
        else:
            self.in_row = 0

    def record(self) -> dict:
        return {"bad_steps": self.total, "bad_steps_in_row": self.in_row}

    def error(self, step: int, record: dict, limit: int, kept: str) -> TrainingError:
        """The line that stops the run at `step`, the last of `in_row` bad ones."""
        return TrainingError(
            f"steps {step - self.in_row + 1}-{step}: {self.in_row} in a row with a non-finite "
            f"loss or gradient norm (train.max_bad_steps={limit}; last loss "
            f"{record['loss']}, grad_norm {record['grad_norm']}); stopped without saving, "
            f"{kept}; lower train.learning_rate or check the data"
        )
