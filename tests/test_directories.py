"""A new output directory, whole or not at all (`seqpipe.host.directories`): every place it
cannot be written is one line, before any work and with nothing left behind, on real
file systems (a read-only tmpfs, a full one, a mount point)."""

import contextlib
import os
import subprocess
from pathlib import Path

import pytest

from seqpipe.host import directories


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A tmpfs mounted at `path` for the block (mounting needs root, as on the CI machine)."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def _files(scratch: Path, size: int = 10) -> None:
    (scratch / "model.safetensors").write_bytes(b"w" * size)
    (scratch / "config.json").write_text("{}")


def _refused(path: Path, message: str, size: int = 10) -> None:
    with pytest.raises(directories.OutputError) as e:
        directories.write_new(path, lambda d: _files(d, size))
    assert str(e.value) == message


def test_a_new_directory_appears_whole_with_plain_modes(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    directories.write_new(out, _files)
    mask = os.umask(0)
    os.umask(mask)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask
    assert [p.name for p in tmp_path.iterdir()] == ["a"]  # no scratch left beside it


def test_under_a_file_and_over_a_non_empty_directory(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    _refused(a_file / "sub", f"--out {a_file}/sub: {a_file} is a file, not a directory")
    _refused(a_file / "s" / "d", f"--out {a_file}/s/d: {a_file} is a file, not a directory")
    _refused(a_file, f"--out {a_file} exists and is not empty; give a new directory")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    _refused(
        tmp_path / "full", f"--out {tmp_path}/full exists and is not empty; give a new directory"
    )
    assert a_file.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["f", "full"]


def test_a_read_only_file_system(tmp_path):
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        _refused(ro / "out", f"--out {ro}/out: {ro} is on a read-only file system")
        _refused(ro, f"--out {ro}: it is on a read-only file system")


def test_a_mount_point_is_filled_in_place(tmp_path):
    """An empty mount point cannot be replaced (rmdir: device busy): it is filled in place,
    keeping its mode."""
    with tmpfs(tmp_path / "mnt", "size=1m,mode=0751") as mnt:
        directories.write_new(mnt, _files, last="config.json")
        assert sorted(p.name for p in mnt.iterdir()) == ["config.json", "model.safetensors"]
        assert mnt.stat().st_mode & 0o777 == 0o751


@pytest.mark.parametrize("where", ["new", "mount point"])
def test_a_disk_that_fills_up_leaves_nothing(tmp_path, where):
    with tmpfs(tmp_path / "small", "size=64k") as small:
        out = small / "a" / "out" if where == "new" else small
        _refused(out, f"--out {out}: no space left on device", size=1 << 20)
        assert list(small.iterdir()) == []


def test_a_fill_that_fails_leaves_nothing_not_even_the_parents_it_made(tmp_path):
    def fails(scratch: Path) -> None:
        _files(scratch)
        raise ValueError("the weights fit no format")

    with pytest.raises(ValueError, match="fit no format"):
        directories.write_new(tmp_path / "a" / "b" / "out", fails)
    assert list(tmp_path.iterdir()) == []
