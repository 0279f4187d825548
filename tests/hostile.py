"""Helpers for the tests that treat the trainer as a hostile user would: real processes,
real files damaged on disk, read-only and full file systems."""

import contextlib
import os
import subprocess
from pathlib import Path

# Steps 1-2, a checkpoint after each: a run that leaves something to resume or damage.
SHORT = {"train.steps": "4", "train.stop_at": "2", "checkpoint.every": "1", "checkpoint.keep": "0"}


def one_line_error(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """The single `error: ...` line a refused run prints; fails on a traceback or more."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


def snapshot(root: Path) -> list:
    """Every file under root with its size and modification time: what a refusal must keep."""
    files = sorted(p for p in Path(root).rglob("*") if p.is_file())
    return [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def _mount_tmpfs(path: Path, size: str) -> bool:
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    return os.geteuid() == 0 and subprocess.run(mount, capture_output=True).returncode == 0


@contextlib.contextmanager
def read_only_later(path: Path):
    """A directory to fill, then make read-only by calling the yielded function: a tmpfs
    remounted read-only as root (root writes through permissions), else chmod 0555."""
    import pytest

    path.mkdir(parents=True)
    mounted = _mount_tmpfs(path, "64m")
    if not mounted and os.geteuid() == 0:
        pytest.skip("root writes through permissions, and mounting a tmpfs failed")

    def make_read_only():
        if mounted:
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        else:
            for p in [path, *path.rglob("*")]:
                if p.is_dir():
                    p.chmod(0o555)

    try:
        yield make_read_only
    finally:
        if mounted:
            # Lazily: a memory map of a cache entry may still hold a file open.
            subprocess.run(["umount", "-l", str(path)], check=True)
        else:
            for p in [path, *path.rglob("*")]:
                if p.is_dir():
                    p.chmod(0o755)
