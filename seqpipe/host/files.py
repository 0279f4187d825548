"""Writing a file whole or not at all: an exclusive temporary in the target's directory,
renamed over the target.

A predictable temporary name (`<name>.tmp<pid>`) in a shared, world-writable directory
can be planted as a symlink by another user, and the write would follow it;
`tempfile.mkstemp` creates a new file with O_EXCL, which never follows one. The rename is
atomic, so a reader (another process) sees the old file or the new one, never half.

A target that exists and is not a regular file (a device such as /dev/null or /dev/full,
a named pipe, a terminal), or a link to one, is written in place instead: a rename would
put a regular file where the device, the pipe or the link was, and nothing would reach
the reader. So is a link into /proc (/dev/stdout, /dev/fd/N): a process's open file,
whatever it is.
"""

import os
import stat
import tempfile
from collections.abc import Callable
from typing import BinaryIO

# The temporaries being written now: a signal that ends the process at once
# (`seqpipe.host.signals`) removes them, so nothing is left half-written.
_temporaries: set[str] = set()


def remove_temporaries() -> None:
    for tmp in list(_temporaries):
        try:
            os.unlink(tmp)
        except OSError:
            pass


def umask() -> int:
    """The process's umask (read by setting it, then put back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def in_place(path: str | os.PathLike) -> bool:
    """Whether `path` is written in place: it exists and is not a regular file (or a link
    to one), or it is a link to a process's open file (/dev/stdout)."""
    try:
        mode = os.stat(path).st_mode  # through links
    except OSError:
        return False  # absent (or a dangling link): a new regular file
    proc = os.path.islink(path) and os.path.realpath(path).startswith("/proc/")
    return proc or not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Write `path` through `write(file)`, a binary file object; on any failure (a full
    disk, say) the temporary is removed and the error raised, and `path` is as it was. A
    device, pipe or link to one (`in_place`) is written in place, as it is."""
    path = os.fspath(path)
    if in_place(path):
        with open(path, "wb") as f:
            write(f)
        return
    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(dir=directory or ".", prefix=f".{name}.", suffix=".tmp")
    _temporaries.add(tmp)
    try:
        # mkstemp makes the file 0600; a cache shared between users needs what a plain
        # open() would have given.
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    finally:
        _temporaries.discard(tmp)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))
