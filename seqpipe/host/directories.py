"""A new output directory, written whole or not at all, or refused in one line.

`check` runs before the work that fills the directory (an export reads a checkpoint
first), so an output that cannot be written is said at once. `write_new` fills a hidden
scratch directory and renames it into place: a reader never sees half an output, and on
any failure nothing is left behind, the parents it made included. An existing empty
directory (made for the output, or a mount point, which cannot be replaced) is filled
in place, keeping its own owner and mode.
"""

import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from seqpipe.host import files

_REASONS = {
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
}


class OutputError(ValueError):
    """The output directory cannot be written; the message is one line saying why."""


def _exists(path: Path) -> bool:
    try:
        return path.exists() or path.is_symlink()
    except OSError:
        return False


def check(path: str | os.PathLike, flag: str = "--out") -> None:
    """OutputError unless `path` is absent (and can be made) or an empty directory."""
    target = Path(path)
    if _exists(target):
        if not target.is_dir() or any(target.iterdir()):
            raise OutputError(f"{flag} {target} exists and is not empty; give a new directory")
        host = target
    else:
        host = target.parent
        while not _exists(host) and host != host.parent:
            host = host.parent
        if not host.is_dir():
            raise OutputError(f"{flag} {target}: {host} is a file, not a directory")
    where = "it" if host == target else str(host)
    if os.statvfs(host).f_flag & os.ST_RDONLY:
        raise OutputError(f"{flag} {target}: {where} is on a read-only file system")
    if not os.access(host, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {target}: no permission to write in {where}")


def write_new(
    path: str | os.PathLike,
    fill: Callable[[Path], None],
    flag: str = "--out",
    last: str | None = None,
) -> None:
    """`fill(scratch)` writes the files; they appear at `path` once all are written, with
    the modes a plain open() and mkdir() give (not tempfile's 0600 and 0700). An OSError
    on the way is an OutputError, with nothing left behind. `last`: the entry that appears
    last where the directory is filled in place (the one readers wait for)."""
    check(path, flag)
    target = Path(path)
    made = []
    try:
        for parent in reversed(target.parents):
            if not parent.exists():
                parent.mkdir()
                made.append(parent)
        if target.is_dir():
            _fill_in_place(target, fill, last)
        else:
            scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
            try:
                _filled(scratch, fill)
                os.rename(scratch, target)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    except BaseException as e:
        for parent in reversed(made):
            shutil.rmtree(parent, ignore_errors=True)
        if not isinstance(e, OSError):
            raise
        reason = _REASONS.get(e.errno, e.strerror or str(e))
        raise OutputError(f"{flag} {target}: {reason}") from None


def _filled(scratch: Path, fill: Callable[[Path], None]) -> None:
    fill(scratch)
    mask = files.umask()
    scratch.chmod(0o777 & ~mask)
    for p in scratch.iterdir():
        p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


def _fill_in_place(target: Path, fill: Callable[[Path], None], last: str | None) -> None:
    """Into an existing empty directory: a scratch inside it (the same file system), each
    entry renamed out of it, `last` last."""
    scratch = Path(tempfile.mkdtemp(prefix=".partial.", dir=target))
    try:
        _filled(scratch, fill)
        for p in sorted(scratch.iterdir(), key=lambda p: (p.name == last, p.name)):
            os.rename(p, target / p.name)
    except BaseException:
        for p in target.iterdir():  # it was empty: whatever is there now is ours
            if p != scratch:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
