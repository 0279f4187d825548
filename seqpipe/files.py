"""Writing a file whole or not at all: an exclusive temporary in the target's directory,
renamed over the target.

A predictable temporary name (`<name>.tmp<pid>`) in a shared, world-writable directory
can be planted as a symlink by another user, and the write would follow it;
`tempfile.mkstemp` creates a new file with O_EXCL, which never follows one. The rename is
atomic, so a reader (another process) sees the old file or the new one, never half.
"""

import os
import tempfile
from collections.abc import Callable
from typing import BinaryIO


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Write `path` through `write(file)`, a binary file object; on any failure (a full
    disk, say) the temporary is removed and the error raised, and `path` is as it was."""
    path = os.fspath(path)
    directory, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(dir=directory or ".", prefix=f".{name}.", suffix=".tmp")
    try:
        # mkstemp makes the file 0600; a cache shared between users needs what a plain
        # open() would have given.
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))
