"""The C++ runtime's stderr in a multi-process run: into the run's log file, and one
`error:` line on the console when the runtime aborts the process.

JAX's distributed runtime ends a survivor of a lost process with a C++ fatal error
(SIGABRT, exit 134): the coordination service in process 0 declares a process silent for
`peers.HEARTBEAT_S` dead and tells the others, and a process that loses process 0 loses
the service itself. Each printed 30-50 lines of C++ logs and stack, and Python gets no
hook to say anything after them (`seqpipe.host.peers`). A process that aborts cannot write its
own last line, so another one does.

`capture` points the trainer's file descriptor 2, where C++ writes, at a pipe read by a
small watcher process (`python -m seqpipe.host.runtime_log`), and keeps Python's `sys.stderr`
on the console. The watcher appends what arrives to the run's log file (once the workdir
exists: a refused run leaves no workdir behind) and, when the pipe closes because the
trainer is gone, writes the trainer's last console line if a fatal line came: the lost
process and the newest intact checkpoint (`peers.lost_message`).
"""

import os
import re
import sys
from pathlib import Path

from seqpipe.host import checkpoint_dir, peers

# absl's fatal severity ("F1205 12:34:56.789 ...") and what the runtime prints as it aborts.
_FATAL = re.compile(r"^F\d{4} \d\d:\d\d:\d\d|Terminating process because|Check failed")
_HELD_LINES = 2000  # kept in memory while the workdir does not exist yet


def capture(workdir: str, log: Path, process: int, processes: int) -> None:
    """Start the watcher and send fd 2 to it; Python's own lines keep the console."""
    # Here, not above: `seqpipe.host.signals` imports this module before its handlers are in.
    import subprocess

    console = os.dup(2)
    read, write = os.pipe()
    args = [str(workdir), str(log), str(checkpoint_dir.directory(workdir)), str(process)]
    subprocess.Popen(
        [sys.executable, "-m", "seqpipe.host.runtime_log", *args, str(processes)],
        stdin=read,
        stdout=subprocess.DEVNULL,
        stderr=console,
        start_new_session=True,  # a Ctrl-C to the terminal's group stops the trainer only
    )
    os.close(read)
    os.dup2(write, 2)
    os.close(write)
    sys.stderr.flush()
    sys.stderr = open(console, "w", buffering=1, errors="backslashreplace", closefd=False)


def console() -> int:
    """The console's file descriptor: `sys.stderr`'s (fd 2 goes to the watcher once
    `capture` ran), else 2. Safe in a signal handler."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return 2


def exit_at_once(message: str, code: int) -> None:
    """`error: message` as the last line on the console, and exit at once, without the
    interpreter's shutdown (which would wait for a lost process or orbax's threads): every
    later write to fd 2, from any thread or C++, is dropped."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    try:
        stream = console()
        ours = os.dup(stream)
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in {stream, 2}:
            os.dup2(devnull, fd)
        os.write(ours, f"error: {message}\n".encode())
    finally:
        os._exit(code)


def watch(stream, workdir: Path, log: Path, checkpoints: str, process: int, processes: int):
    """The watcher: copy `stream` to `log` until it closes; then the `error:` line on
    stderr if the runtime aborted."""
    held: list[str] = []
    fatal = None  # the first fatal line's message, without absl's prefix
    out = None
    for line in stream:
        if out is None and workdir.is_dir():
            out = open(log, "a", errors="backslashreplace")
            out.writelines(held)
            held.clear()
        if out is not None:
            out.write(line)
            out.flush()
        elif len(held) < _HELD_LINES:
            held.append(line)
        if fatal is None and _FATAL.search(line):
            fatal = line.split("] ", 1)[-1].strip()
    if fatal is None:
        return
    where = f"; the runtime's log is in {log}" if out is not None else ""
    if any(word in fatal for word in peers.PEER_WORDS):
        peers.watch(Path(checkpoints), process, processes)
        message = peers.lost_message(fatal)
    else:
        message = f"the JAX runtime aborted process {process} ({fatal[:200]})"
    sys.stderr.write(f"error: {message}{where}\n")


if __name__ == "__main__":
    import io

    workdir, log, checkpoints, process, processes = sys.argv[1:]
    # C++ may write bytes that are not UTF-8; the watcher must not fail on them.
    lines = io.TextIOWrapper(sys.stdin.buffer, errors="backslashreplace")
    watch(lines, Path(workdir), Path(log), checkpoints, int(process), int(processes))
