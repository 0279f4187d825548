"""What a user meets around a run: the ETA without compilation, TensorBoard flushed with
every line and not opened for nothing, another data source refused on resume, a second
Ctrl-C in one line."""

import signal
import subprocess
import sys
import time

import pytest
from test_train import REPO, read_events, subprocess_env, tiny_args, tiny_config

from seqpipe import checkpoint, metrics, train
from seqpipe.config import ConfigError


def test_the_eta_leaves_the_first_step_out(monkeypatch):
    """50 s of compilation in step 1, then a step a second: the ETA at step 3 of 10 is 7 s
    (it was (10 - 3) / (3 / 52 s) = 121 s)."""
    clock = iter([0.0, 50.0, 52.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    bar = metrics.Progress(10, 0, stream=open("/dev/null", "w"))
    bar.restart(1)  # as MetricsLog.restart_clock after the first step
    bar.step = 3
    assert bar.text().endswith("1.00 step/s  eta 0:00:07"), bar.text()


def test_tensorboard_is_on_disk_within_seconds_and_nothing_to_do_opens_none(tmp_path):
    """Unclosed, as after a SIGKILL, a logged line is in the events file within a couple of
    seconds (tensorboardX flushes every second; it was every ten)."""
    log = metrics.MetricsLog(tmp_path, 10)
    log.write({"step": 1, "loss": 2.5})
    (events,) = tmp_path.glob("events.out.tfevents.*")
    deadline = time.time() + 4
    while "loss" not in read_events(events) and time.time() < deadline:
        time.sleep(0.1)
    assert read_events(events)["loss"] == [(1, 2.5)]
    log.close()
    workdir = tmp_path / "w"
    one = tiny_config(**{"train.stop_at": "1"})
    train.run(one, str(workdir))
    assert train.run(one, str(workdir)) == []  # nothing to do
    assert len(list(workdir.glob("events.out.tfevents.*"))) == 1


def test_resuming_on_another_data_source_is_refused(tmp_path):
    train.run(tiny_config(**{"train.stop_at": "1"}), str(tmp_path / "w"))
    (tmp_path / "t.txt").write_text("some text of my own\n" * 200)
    other = {"data.source": "text", "data.path": str(tmp_path / "t.txt"), "train.stop_at": "2"}
    with pytest.raises(ConfigError, match="trained on data.source=stdlib, not data.source=text"):
        train.run(tiny_config(**other), str(tmp_path / "w"))


def test_a_second_ctrl_c_is_one_line_and_the_next_start_resumes(tmp_path):
    args = [sys.executable, "train.py", "--workdir", str(tmp_path)]
    proc = subprocess.Popen(
        args + tiny_args(**{"train.steps": "100000", "checkpoint.every": "2"}),
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ckpt = checkpoint.directory(tmp_path)
    deadline = time.time() + 120
    while not checkpoint.complete_steps(ckpt) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    # Ctrl-C held down: two signals sent before the first is handled count as one (a
    # pending signal is a bit), so keep sending until the process ends; the first handled
    # one starts the stop (a step and a save, far longer than the 20 ms between them).
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.02)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert err == (
        "error: stopped by a second Ctrl-C, without saving; the newest complete checkpoint in "
        f"{checkpoint.directory(tmp_path)} is intact (a save it cut is removed at the next "
        "start); run again to resume\n"
    )
    newest = checkpoint.complete_steps(checkpoint.directory(tmp_path))[-1]
    proc = subprocess.run(
        args + tiny_args(**{"train.steps": str(newest + 1)}),
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"resumed from {checkpoint.directory(tmp_path)}/{newest}\n")
    assert not [p for p in checkpoint.directory(tmp_path).iterdir() if "tmp" in p.name]
