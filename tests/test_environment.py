"""Faults around a run, not in it: the token cache (a file, read-only, full, damaged,
planted symlinks), config files that are not configs, an unwritable `--out`, a check that
must write nothing (tests/test_cli.py, verify). Each is one line naming the path, or is
repaired."""

import os

import numpy as np
import pytest
from helpers import fill_disk
from hostile import read_only_later

from seqpipe.data import loader
from seqpipe.run import cli, config
from seqpipe.schedule import cli as schedule

TEXT = "def f(x):\n    return x + 1\n" * 2000  # 58 KB of text


def _config(tmp_path, cache):
    (tmp_path / "corpus.txt").write_text(TEXT)
    c = config.base_config()
    c.model.vocab_size = 256
    c.train.seq_len = 16
    c.data.update(
        source="text", path=str(tmp_path / "corpus.txt"), tokenizer="byte", cache_dir=str(cache)
    )
    return c


def _entries(cache) -> list[str]:
    return sorted(os.listdir(cache))


def test_a_cache_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "cache").write_text("mine")
    with pytest.raises(loader.DataError) as info:
        loader.load_tokens(_config(tmp_path, tmp_path / "cache"), "")
    assert str(info.value) == (
        f"data.cache_dir {tmp_path}/cache cannot be made (File exists); set data.cache_dir "
        "(or $SEQPIPE_CACHE) to a writable directory"
    )


def test_a_read_only_cache_is_refused_before_tokenizing_and_read_when_filled(tmp_path):
    cache = tmp_path / "ro"
    with read_only_later(cache) as make_read_only:
        make_read_only()
        with pytest.raises(loader.DataError, match=f"data.cache_dir {cache} is not writable and"):
            loader.load_tokens(_config(tmp_path, cache), "")
    with read_only_later(tmp_path / "ro2") as make_read_only:
        c = _config(tmp_path, tmp_path / "ro2")
        train = np.array(loader.load_tokens(c, "")[0])
        make_read_only()  # a shared cache, filled: read-only is fine
        np.testing.assert_array_equal(loader.load_tokens(c, "")[0], train)


def test_a_full_cache_disk_is_one_line_and_leaves_no_partial_file(small_disk):
    cache = small_disk / "cache"
    cache.mkdir()
    fill_disk(small_disk, leave=16 * 1024)  # the token array needs 116 KB
    with pytest.raises(loader.DataError) as info:
        loader.load_tokens(_config(small_disk.parent, cache), "")
    message = str(info.value)
    assert message.startswith(f"writing the cache entry {cache}/tokens-"), message
    assert message.endswith(
        f".npy failed (No space left on device); free space in {cache} or set data.cache_dir "
        "(or $SEQPIPE_CACHE) to another directory"
    ), message
    assert _entries(cache) == []


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_cache_entry_is_rebuilt(tmp_path, damage, capsys):
    c = _config(tmp_path, tmp_path / "cache")
    # Copies: the arrays map the entry's file, which is damaged next.
    train, held_out = (np.array(x) for x in loader.load_tokens(c, ""))
    (entry,) = _entries(tmp_path / "cache")
    path = tmp_path / "cache" / entry
    if damage == "truncated":
        os.truncate(path, path.stat().st_size // 2)
    else:
        path.write_bytes(b"not an array")
    again, held_out_again = loader.load_tokens(c, "")
    np.testing.assert_array_equal(again, train)
    np.testing.assert_array_equal(held_out_again, held_out)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"the cache entry {path} is damaged (") and line.endswith(
        "); rebuilding it"
    ), line
    assert _entries(tmp_path / "cache") == [entry]  # rebuilt, and no temporary left


def test_a_planted_symlink_at_the_old_temporary_name_is_not_followed(tmp_path):
    """The cache used to write `<entry>.tmp<pid>`: a symlink planted there (in a shared,
    world-writable cache) made it overwrite the file the link pointed to."""
    c = _config(tmp_path, tmp_path / "cache")
    loader.load_tokens(c, "")
    (entry,) = _entries(tmp_path / "cache")
    os.remove(tmp_path / "cache" / entry)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.symlink(victim, tmp_path / "cache" / f"{entry}.tmp{os.getpid()}")
    loader.load_tokens(c, "")
    assert victim.read_text() == "precious\n"
    assert (tmp_path / "cache" / entry).is_file() and not (tmp_path / "cache" / entry).is_symlink()


@pytest.mark.parametrize(
    "name, body, expected",
    [
        ("cfg.txt", "def get_config(): ...\n", "not a Python file; a config is a .py file"),
        ("quit.py", "import sys\nsys.exit(3)\n", "failed to load: it called sys.exit(3)"),
    ],
)
def test_a_config_file_that_is_not_a_config_is_one_line(tmp_path, capsys, name, body, expected):
    (tmp_path / name).write_text(body)
    with pytest.raises(SystemExit) as info:
        cli.load_or_exit(["--config", str(tmp_path / name)], "train.py")
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: --config {tmp_path / name}: {expected}"), line


SCHEDULE = ["--schedule", "seq1f1b", "--stages", "4", "--microbatches", "8", "--segments", "4"]


def _schedule_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        schedule.main(SCHEDULE + argv)
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line


def test_schedule_out_unwritable_and_flops_without_a_model_name_the_flag(tmp_path, capsys):
    with read_only_later(tmp_path / "ro") as make_read_only:
        make_read_only()
        line = _schedule_error(["--format", "png", "--out", str(tmp_path / "ro" / "s.png")], capsys)
        assert line == (
            f"error: --out {tmp_path}/ro/s.png: {tmp_path}/ro is not writable; make it writable "
            "or choose another --out"
        )
        assert os.listdir(tmp_path / "ro") == []
    line = _schedule_error(["--out", str(tmp_path / "no" / "s.txt")], capsys)
    assert line.startswith(f"error: --out {tmp_path}/no/s.txt: {tmp_path}/no is not a dir")
    line = _schedule_error(["--partition", "flops", "--seq-len", "64"], capsys)
    assert line == (
        "error: --partition flops needs the model shape: give --d-model --num-heads --d-ff "
        "--vocab-size"
    )
