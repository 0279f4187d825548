"""The watcher of a multi-process run's C++ output (`seqpipe.host.runtime_log`), as a process:
what reaches the log file and the one line it writes when the runtime aborts. The real
abort, a killed peer, is `test_multihost.py`'s slow lost-peer test."""

import subprocess
import sys

from helpers import REPO

# What JAX's runtime printed as it aborted a survivor (jax 0.10.2, abridged), and a line
# of bytes that are not UTF-8.
ABORT = (
    b"W1205 23:37:12.000000 8196 gloo.cc:1] a warning\n"
    b"\xff\xfe not text\n"
    b"F1205 23:37:12.770345 8207 client.h:80] Terminating process because the JAX "
    b"distributed service detected fatal errors. absl::Status: UNAVAILABLE: The following "
    b"tasks are unhealthy (stopped sending heartbeats):\n1\n*** Check failure stack trace: ***\n"
)


def _watch(tmp_path, stdin: bytes, workdir_exists: bool = True):
    workdir = tmp_path / "w"
    if workdir_exists:
        (workdir / "checkpoints" / "2").mkdir(parents=True)
    log = workdir / "train.1.log"
    args = [str(workdir), str(log), str(workdir / "checkpoints"), "1", "2"]
    proc = subprocess.run(
        [sys.executable, "-m", "seqpipe.host.runtime_log", *args],
        cwd=REPO,
        input=stdin,
        capture_output=True,
        timeout=60,
    )
    return proc, log


def test_an_abort_is_one_line_naming_the_lost_process_and_the_newest_checkpoint(tmp_path):
    proc, log = _watch(tmp_path, ABORT)
    assert proc.returncode == 0
    (line,) = proc.stderr.decode().splitlines()
    assert line.startswith("error: lost process 0 of the run (Terminating process because"), line
    assert f"the newest intact checkpoint is step 2 in {log.parent}/checkpoints" in line, line
    assert line.endswith(f"; the runtime's log is in {log}"), line
    assert log.read_bytes().startswith(b"W1205") and b"\\xff\\xfe not text" in log.read_bytes()


def test_a_run_that_ends_well_leaves_the_console_alone(tmp_path):
    proc, log = _watch(tmp_path, ABORT.split(b"F1205")[0])
    assert proc.returncode == 0 and proc.stderr == b""
    assert b"a warning" in log.read_bytes()


def test_nothing_is_written_where_the_workdir_does_not_exist(tmp_path):
    """A run refused before its workdir exists leaves none behind, not even a log."""
    proc, log = _watch(tmp_path, ABORT, workdir_exists=False)
    assert "error: lost process 0 of the run" in proc.stderr.decode()
    assert not (tmp_path / "w").exists()
