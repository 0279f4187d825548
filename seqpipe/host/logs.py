"""Third-party logs (orbax, absl, jax, grain, tensorboardX): warnings and above on the
console, one line each, everything from info up (tracebacks too) in `WORKDIR/train.log`
(`train.<process>.log` for the other processes of a multi-process run).

orbax logs a few lines per save and restore at info level, and a failed save (a full disk)
used to bury the one line that matters under two thousand. Python's `logging` carries all
of them (absl's logger included), so one capture on the root logger takes them all.

Python's warnings (jax's) are captured the same way, one line each; jax's "donated buffers
were not usable" goes to the file only.

An exception that ends a background thread (tensorboardX's writer on a full disk), or one
Python can only report as "Exception ignored" (orbax's asyncio callbacks on a closed event
loop after a failed save), is logged the same way: an error line on the console and its
traceback in the file, rather than printed whole by Python.

Records are held in memory until the run owns its workdir and has restored its checkpoint
(`open`): a refused run leaves the workdir as it was. The log file is appended to, a line
marking each run's start; a write that fails (a full disk) stops the file, silently: the
error that matters is reported by the run itself.
"""

import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path

_FORMAT = "%(asctime)s %(levelname)s %(name)s %(filename)s:%(lineno)d] %(message)s"


def log_path(workdir: str | os.PathLike, process_index: int = 0) -> Path:
    name = "train.log" if process_index == 0 else f"train.{process_index}.log"
    return Path(workdir) / name


class _Console(logging.Handler):
    """Warnings and above, one line each (a record's first line; its traceback and the rest
    go to the log file only), to whatever sys.stderr is when they come (pytest swaps it).
    One short write per record also keeps a background thread's record from splitting
    the run's own last line."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.log_file: Path | None = None  # named once open, for the rest of a record

    def emit(self, record):
        try:
            lines = record.getMessage().strip().splitlines() or [""]
            line = f"{record.levelname}:{record.name}:{lines[0][:300]}"
            cut = len(lines) > 1 or len(lines[0]) > 300 or record.exc_info or record.stack_info
            if cut and self.log_file is not None:
                line += f" (the rest in {self.log_file})"
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        except Exception:
            pass  # a console gone is no reason to stop training


class _File(logging.Handler):
    """Every record, buffered until `open`, then appended to the file line by line."""

    def __init__(self):
        super().__init__(logging.NOTSET)
        self.setFormatter(logging.Formatter(_FORMAT))
        self._buffer: list[logging.LogRecord] | None = []
        self._file = None

    def open(self, path: Path) -> None:
        try:
            self._file = open(path, "a")
            self._file.write(
                f"---- run started {time.strftime('%Y-%m-%d %H:%M:%S')}, pid {os.getpid()} "
                f"on host {socket.gethostname()}\n"
            )
        except OSError:
            self._file = None
        buffered, self._buffer = self._buffer or [], None
        for record in buffered:
            self.emit(record)

    def emit(self, record):
        if self._buffer is not None:
            self._buffer.append(record)
            return
        if self._file is None:
            return
        try:
            self._file.write(self.format(record) + "\n")
            self._file.flush()
        except Exception:
            self._drop_file()  # no traceback from logging: the run reports what failed

    def _drop_file(self):
        f, self._file = self._file, None
        try:
            f.close()
        except Exception:
            pass

    def close(self):
        self._buffer = None
        if self._file is not None:
            self._drop_file()
        super().close()


class Capture:
    """Routes third-party logs for one run: start at once (buffering), `open(workdir)` once
    the workdir is the run's, `close()` at the end (restores what it changed)."""

    def __init__(self):
        import absl.logging

        self._absl = absl.logging
        root = logging.getLogger()
        # The plain stderr handler absl's logging.basicConfig() put there gives way to ours
        # while the run lasts; other handlers (a user's, pytest's) stay as they are.
        self._removed = [h for h in root.handlers if type(h) is logging.StreamHandler]
        self._saved = (root.level, absl.logging.get_verbosity())
        self._console, self._file = _Console(), _File()
        for h in self._removed:
            root.removeHandler(h)
        root.addHandler(self._console)
        root.addHandler(self._file)
        root.setLevel(logging.INFO)
        absl.logging.set_verbosity(absl.logging.INFO)  # absl's logger filters on its own
        self._hooks = (threading.excepthook, sys.unraisablehook)
        threading.excepthook, sys.unraisablehook = _log_thread_exception, _log_unraisable
        # Python's warnings too (jax's are three lines each): one line on the console.
        logging.captureWarnings(True)
        logging.getLogger("py.warnings").addFilter(_donation_as_info)

    def open(self, workdir: str | os.PathLike, process_index: int = 0) -> None:
        path = log_path(workdir, process_index)
        self._file.open(path)
        self._console.log_file = path.absolute()

    def close(self) -> None:
        root = logging.getLogger()
        for h in (self._console, self._file):
            root.removeHandler(h)
            h.close()
        for h in self._removed:
            root.addHandler(h)
        level, verbosity = self._saved
        root.setLevel(level)
        self._absl.set_verbosity(verbosity)
        # orbax's asyncio callbacks may still find their loop closed as the process exits,
        # after the run said how it ended: their complaint stays off the console.
        threading.excepthook, sys.unraisablehook = (_unless_closed_loop(h) for h in self._hooks)
        logging.captureWarnings(False)
        logging.getLogger("py.warnings").removeFilter(_donation_as_info)


def _donation_as_info(record: logging.LogRecord) -> bool:
    """jax's "Some donated buffers were not usable", at info level: in the log file, off
    the console. It says XLA could not reuse an argument's memory for an output (another
    shape); the run is as right, and the one that did it (a restore) frees them itself."""
    if "donated buffers were not usable" in record.getMessage():
        record.levelno, record.levelname = logging.INFO, "INFO"
    return True


def _log_thread_exception(args) -> None:
    """threading.excepthook: a background thread's end by an exception, as a log record."""
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "a thread"
    logging.getLogger("threads").error(
        "%s stopped: %s: %s",
        name,
        args.exc_type.__name__,
        args.exc_value,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )


def _closed_loop(exc) -> bool:
    """asyncio's complaint that a callback found its event loop closed."""
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


def _unless_closed_loop(hook):
    """`hook` (threading's or sys.unraisablehook) for every exception but `_closed_loop`'s."""

    def quiet(args) -> None:
        if not _closed_loop(args.exc_value):
            hook(args)

    return quiet


def _log_unraisable(unraisable) -> None:
    """sys.unraisablehook: an exception Python cannot raise anywhere, as a log record. An
    asyncio callback that finds its event loop closed (orbax's, dozens of them after a
    failed save or restore, which the run reports itself) goes to the file only."""
    exc = unraisable.exc_value
    closed = _closed_loop(exc)
    logging.getLogger("unraisable").log(
        logging.INFO if closed else logging.ERROR,
        "%s %r: %s: %s",
        unraisable.err_msg or "Exception ignored in",
        unraisable.object,
        unraisable.exc_type.__name__,
        exc,
        exc_info=(unraisable.exc_type, exc, unraisable.exc_traceback),
    )
