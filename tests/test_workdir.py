"""One run per workdir (a real second process), and workdirs that cannot be used: one
line, exit 2, nothing written."""

import os
import signal
import socket
import subprocess
import sys

from helpers import REPO, run_of, run_train, tiny_config
from hostile import SHORT, one_line_error, read_only_later, snapshot

from seqpipe.train import checkpoint
from seqpipe.train import trainer as trainer_lib


def test_a_second_run_on_a_workdir_in_use_is_refused_and_a_killed_owner_blocks_nothing(
    tmp_path,
):
    workdir = tmp_path / "w"
    trainer = trainer_lib.Trainer(run_of(tiny_config(**SHORT)), str(workdir))  # holds the workdir
    try:
        before = snapshot(workdir)
        line = one_line_error(run_train(workdir, **SHORT))
        assert line == (
            f"error: --workdir {workdir} is in use by another run (pid {os.getpid()} "
            f"on host {socket.gethostname()}); wait for it to end or choose another --workdir"
        )
        assert snapshot(workdir) == before
        trainer.train()
    finally:
        trainer.close()
    # An owner killed with SIGKILL holds nothing: the kernel dropped its lock.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from seqpipe.host import workdir; "
            f"lock = workdir.Lock({str(workdir)!r}); lock.record_owner(); "
            "print('held', flush=True); "
            "time.sleep(300)",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "held\n"
    assert "is in use by another run" in one_line_error(run_train(workdir, **SHORT))
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
    proc = run_train(workdir, **{**SHORT, "train.stop_at": "3"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"resumed from {checkpoint.directory(workdir)}/2\n")


def test_a_workdir_that_is_a_file_or_under_one_is_refused(tmp_path):
    (tmp_path / "file").write_text("mine\n")
    line = one_line_error(run_train(tmp_path / "file"))
    assert line == (
        f"error: --workdir {tmp_path}/file is a file, not a directory; choose another path"
    )
    line = one_line_error(run_train(tmp_path / "file" / "w"))
    assert line == (
        f"error: --workdir {tmp_path}/file/w: {tmp_path}/file is a file, so no directory can "
        "be made under it; choose another path"
    )
    assert (tmp_path / "file").read_text() == "mine\n"


def test_a_read_only_workdir_is_refused_also_to_resume(tmp_path):
    """A fresh run under a read-only directory, and a resume in a workdir made read-only
    after a run (which used to fail rewriting tokenizer.json)."""
    root = tmp_path / "ro"
    with read_only_later(root) as make_read_only:
        workdir = root / "w"
        trainer_lib.run(tiny_config(**SHORT), str(workdir))
        make_read_only()
        before = snapshot(root)
        line = one_line_error(run_train(workdir, **{**SHORT, "train.stop_at": "3"}))
        assert line == (
            f"error: --workdir {workdir} is not writable; make it writable or choose another "
            "--workdir"
        )
        line = one_line_error(run_train(root / "new" / "w"))
        assert line == (
            f"error: --workdir {root}/new/w: its parent {root} is not writable; make it "
            "writable or choose another --workdir"
        )
        assert snapshot(root) == before


def test_every_atomic_write_keeps_a_special_target_and_writes_it_in_place(tmp_path):
    """files.atomic_write, which every file the trainer writes goes through (cache
    entries, tokenizer.json, metrics.jsonl): a regular file is replaced whole, a named
    pipe or a link to a device is written in place and stays what it was."""
    import stat
    import threading

    from seqpipe.host import files

    regular = tmp_path / "regular"
    regular.write_bytes(b"old")
    files.atomic_write_bytes(regular, b"new")
    assert regular.read_bytes() == b"new"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    files.atomic_write_bytes(fifo, b"through the pipe")
    reader.join(30)
    assert got == [b"through the pipe"] and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    null = tmp_path / "null"
    null.symlink_to("/dev/null")
    files.atomic_write_bytes(null, b"gone")
    assert os.readlink(null) == "/dev/null"
    full = tmp_path / "full"
    full.symlink_to("/dev/full")
    try:
        files.atomic_write_bytes(full, b"x" * 10000)
        raise AssertionError("a full device took the write")
    except OSError as e:
        assert e.errno == 28  # ENOSPC, for the caller's one line
    assert os.readlink(full) == "/dev/full"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "full", "null", "regular"]
