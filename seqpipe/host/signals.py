"""SIGINT and SIGTERM outside the training loop: one line and an exit code, at once.

train.py installs these handlers on its first line, before anything is imported: a
Ctrl-C during the imports was a 30-line `KeyboardInterrupt` traceback, or was swallowed
by a callback that could not raise it ("Exception ignored in: _xla_gc_callback") and the
run trained on; a SIGTERM before any handler printed the C++ crash handler's stack dump.
The handler never raises: it removes the temporaries of the atomic writes in progress
(`seqpipe.host.files`), so nothing is left half-written, writes one line and ends the process
(exit 130 for SIGINT, 143 for SIGTERM), whatever the main thread is doing. The training
loop (`seqpipe.train.stops.StopRequest`) takes the signals over while it runs: there a signal
finishes the step and saves.

`count_sigints` tells the loop how many SIGINTs arrived since it last asked: Python runs a
handler once for any number of the same signal that came during one long call into C (a
compilation), and two Ctrl-Cs then looked like one.
"""

import os
import signal

# Imported now: an import inside the handler could find the module half done.
from seqpipe.host import files, runtime_log

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
# What the line says of the run's state; train.py names the checkpoints once it knows them.
_context = {"when": "while starting", "kept": "nothing was trained or saved"}
_wakeup = {"read": None}


def install() -> None:
    """Make SIGINT and SIGTERM end the process at once with one line; main thread only."""
    for sig in EXIT_CODES:
        signal.signal(sig, _stop)
    _count_from_now()


def set_context(when: str, kept: str) -> None:
    """What the line says: when the signal came ("before training") and what is kept."""
    _context.update(when=when, kept=kept)


def _stop(signum, frame) -> None:
    try:
        files.remove_temporaries()  # a cache entry or tokenizer.json being written
        line = f"error: stopped by {NAMES[signum]} {_context['when']}; {_context['kept']}\n"
        os.write(runtime_log.console(), line.encode())
    finally:
        os._exit(EXIT_CODES[signum])


def _count_from_now() -> None:
    """Every signal's number written to a pipe as it arrives (`signal.set_wakeup_fd`)."""
    if _wakeup["read"] is not None:
        return
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    _wakeup["read"] = read


def count_sigints() -> int:
    """SIGINTs delivered since the last call (0 if `install` was never called)."""
    if _wakeup["read"] is None:
        return 0
    count = 0
    while True:
        try:
            got = os.read(_wakeup["read"], 512)
        except BlockingIOError:
            return count
        if not got:
            return count
        count += got.count(signal.SIGINT)
