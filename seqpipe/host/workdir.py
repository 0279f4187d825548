"""The workdir: checked before any work, then owned by one run at a time.

Ownership is an `fcntl.flock` on `WORKDIR/lock.<process index>`, held for the whole run
on an open file. The kernel drops it when the process ends, however it ends (SIGKILL, a
crash, a lost host), so a killed run never blocks the next start and there is no stale
lock to judge. The file also holds the owner's pid and host, for the message that refuses
a second run: written once the run has restored its checkpoint (`record_owner`), so a run
refused until then (another model's checkpoint, say) leaves the workdir as it was, file
times included; until then the file names the previous owner.

With several processes every process locks its own file (`lock.0`, `lock.1`, ...): a
second run on the same workdir is refused by each process whose index the first run
holds, process 0 always, before any of them writes. Across hosts this needs a file system
whose locks are seen by every host (a local disk, NFSv4); object-store mounts (gcsfuse)
have no locks, and there nothing stops a second run.
"""

import errno
import fcntl
import os
import socket
from pathlib import Path


class WorkdirError(RuntimeError):
    """The workdir cannot be used; the message is one line naming it and what to do."""


def check(workdir: str | os.PathLike) -> Path:
    """Refuse a workdir that is a file, lies under a file, or cannot be written, before
    anything is read or written; creates nothing."""
    path = Path(workdir).absolute()
    if path.exists() and not path.is_dir():
        raise WorkdirError(f"--workdir {path} is a file, not a directory; choose another path")
    existing = path
    while not existing.exists():  # the nearest part of the path that is there
        existing = existing.parent
    if not existing.is_dir():
        raise WorkdirError(
            f"--workdir {path}: {existing} is a file, so no directory can be made under it; "
            "choose another path"
        )
    # access() says no for a read-only mount even to root, and for permissions to others.
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "--workdir" if existing == path else f"--workdir {path}: its parent"
        raise WorkdirError(
            f"{what} {existing} is not writable; make it writable or choose another --workdir"
        )
    return path


class Lock:
    """This process's hold on a workdir; `release()` (or the process's end) lets it go."""

    def __init__(self, workdir: str | os.PathLike, process_index: int = 0):
        self.path = Path(workdir) / f"lock.{process_index}"
        self._file = None
        try:
            Path(workdir).mkdir(parents=True, exist_ok=True)
            # Not truncated on open: a refused run must not wipe the owner's pid and host.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise WorkdirError(
                f"cannot create {self.path} ({e.strerror}); make --workdir writable or choose "
                "another"
            ) from None
        f = os.fdopen(fd, "r+")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            owner = f.read().strip() or "a run starting up"
            f.close()
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise WorkdirError(f"cannot lock {self.path} ({e.strerror})") from None
            raise WorkdirError(
                f"--workdir {Path(workdir).absolute()} is in use by another run ({owner}); "
                "wait for it to end or choose another --workdir"
            ) from None
        self._file = f

    def record_owner(self) -> None:
        """Write this process's pid and host into the lock file, for a refused run to name."""
        self._file.seek(0)
        self._file.truncate(0)
        self._file.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
        self._file.flush()

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the last descriptor drops the flock
            self._file = None
