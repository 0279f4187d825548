"""What a user meets around a run: the ETA without compilation, TensorBoard flushed with
every line and not opened for nothing, another data source refused on resume, a second
Ctrl-C in one line."""

import json
import math
import re
import signal
import subprocess
import sys
import time

import orbax.checkpoint as ocp
import pytest
from helpers import REPO, read_events, run_of, run_train, subprocess_env, tiny_args, tiny_config

from seqpipe.data import loader
from seqpipe.host import logs
from seqpipe.parallel import sharding
from seqpipe.run import config as config_lib
from seqpipe.run.config import ConfigError
from seqpipe.train import checkpoint, evaluation, metrics, optim, trainer
from seqpipe.train import step as step_lib


def test_the_eta_leaves_the_first_step_out(monkeypatch):
    """50 s of compilation in step 1, then a step a second: the ETA at step 3 of 10 is 7 s
    (it was (10 - 3) / (3 / 52 s) = 121 s)."""
    clock = iter([0.0, 50.0, 52.0])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    bar = metrics.Progress(10, 0, stream=open("/dev/null", "w"))
    bar.restart(1)  # as MetricsLog.restart_clock after the first step
    bar.step = 3
    assert bar.text().endswith("1.00 step/s  eta 0:00:07"), bar.text()


def test_the_trainer_restarts_the_eta_clock_after_each_runs_first_step(tmp_path, monkeypatch):
    """On a terminal the bar is there; its clock restarts once the first step (with the
    compilation) of each invocation is done, a resumed one too."""
    restarts = []
    monkeypatch.setattr(metrics, "_isatty", lambda: True)
    monkeypatch.setattr(metrics.Progress, "restart", lambda self, step: restarts.append(step))
    workdir = str(tmp_path / "w")
    trainer.run(tiny_config(**{"train.stop_at": "2", "checkpoint.every": "2"}), workdir)
    trainer.run(tiny_config(**{"train.stop_at": "4"}), workdir)
    assert restarts == [1, 3]


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
    trainer.run(one, str(workdir))
    assert trainer.run(one, str(workdir)) == []  # nothing to do
    assert len(list(workdir.glob("events.out.tfevents.*"))) == 1


def test_resuming_on_other_data_is_refused_unless_allowed(tmp_path, capsys):
    """Another data.source, or the same source with other content, is refused in one line;
    the same data moved elsewhere is not; data.allow_source_change=True goes on from the
    weights and reads the new data from its start."""
    workdir = str(tmp_path / "w")
    trainer.run(tiny_config(**{"train.stop_at": "1"}), workdir)
    (tmp_path / "a.txt").write_text("some text of my own\n" * 200)
    (tmp_path / "b.txt").write_text("other text, other windows\n" * 200)
    text = {"data.source": "text", "train.stop_at": "2"}
    a, b = ({**text, "data.path": str(tmp_path / n)} for n in ("a.txt", "b.txt"))
    with pytest.raises(ConfigError, match="trained on data.source=stdlib, not data.source=text"):
        trainer.run(tiny_config(**a), workdir)
    trainer.run(tiny_config(**a, **{"data.allow_source_change": "True"}), workdir)
    err = capsys.readouterr().err
    assert err == (
        f"note: the checkpoint at {checkpoint.directory(workdir)}/1 was trained on "
        "data.source=stdlib; going on from its weights and optimizer state on "
        "data.source=text, read from its start (data.allow_source_change=True)\n"
    ), err
    # Step 2 read the first batch of a.txt: the saved position is one batch into it.
    config = tiny_config(**a)
    tokens, _, _ = loader.read_corpus(config)
    fresh = loader.train_iterator(config, tokens, slice(0, config.train.global_batch_size))
    next(fresh)
    manager = checkpoint.make_manager(workdir, config)
    try:
        saved = manager.restore(2, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
    finally:
        manager.close()
    assert saved == fresh.get_state()
    # b.txt under the same source: other data, refused; a.txt moved: the same data.
    with pytest.raises(ConfigError, match=r"trained on other data \(\d+ tokens, digest "):
        trainer.run(tiny_config(**{**b, "train.stop_at": "3"}), workdir)
    (tmp_path / "a.txt").rename(tmp_path / "moved.txt")
    moved = {**a, "data.path": str(tmp_path / "moved.txt"), "train.stop_at": "3"}
    assert [r["step"] for r in trainer.run(tiny_config(**moved), workdir)] == [3]
    assert "note:" not in capsys.readouterr().err


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
    proc = run_train(tmp_path, **{"train.steps": str(newest + 1)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"resumed from {checkpoint.directory(tmp_path)}/{newest}\n")
    assert not [p for p in checkpoint.directory(tmp_path).iterdir() if "tmp" in p.name]


def test_third_party_logs_go_to_the_workdir_log_and_only_warnings_to_the_console(tmp_path):
    """orbax logs its saves and restores at info level: all of it in train.log, none of it
    on the console, where the run's own lines stay alone."""
    workdir = tmp_path / "w"
    for stop_at in ("1", "2"):  # a fresh run, then a resumed one (orbax restores)
        proc = run_train(workdir, **{"train.stop_at": stop_at, "checkpoint.every": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stderr == "", proc.stderr[-3000:]
        assert all(line.startswith(OWN_LINES) for line in proc.stdout.splitlines()), proc.stdout
    log = (workdir / "train.log").read_text().splitlines()
    orbax = [x for x in log if " INFO absl " in x and "orbax" in x.lower()]
    assert len(orbax) >= 4, log[:50]
    assert sum(x.startswith("---- run started ") for x in log) == 2
    assert any("Restoring" in x or "restor" in x for x in orbax), orbax


OWN_LINES = ("attention: ", "step ", "resumed from ")


def test_a_warning_reaches_the_console_and_the_log_holds_what_came_before_it_opened(
    tmp_path, capsys
):
    import absl.logging

    capture = logs.Capture()
    try:
        absl.logging.info("an info line while restoring")
        absl.logging.warning("a warning line")
        assert not list(tmp_path.iterdir())  # nothing written before open
        capture.open(tmp_path)
        absl.logging.info("an info line while training")
        try:
            raise ValueError("RESOURCE_EXHAUSTED: a long spec\n  on many lines\n")
        except ValueError:
            absl.logging.exception("a save failed")  # what orbax's threads log on a full disk
    finally:
        capture.close()
    absl.logging.info("after the run")
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "WARNING:absl:a warning line",
        f"ERROR:absl:a save failed (the rest in {tmp_path / 'train.log'})",
    ], err
    text = (tmp_path / "train.log").read_text()
    assert "an info line while restoring" in text and "a warning line" in text, text
    assert "an info line while training" in text and "after the run" not in text, text
    assert "Traceback" in text and "  on many lines" in text, text


def test_background_errors_are_one_console_line_each_and_their_tracebacks_in_the_log(
    tmp_path, capsys
):
    """tensorboardX's writer thread dies on a full disk, and orbax's asyncio callbacks raise
    where Python can only say "Exception ignored": it printed each whole traceback over
    the run's one error line (test_faults' disk-full test failed now and then)."""
    import gc
    import threading

    def writer():
        raise OSError(28, "No space left on device")

    class Pending:
        def __await__(self):
            yield

    def suspended(error):
        async def callback():
            try:
                await Pending()
            finally:
                raise error

        coroutine = callback()
        coroutine.send(None)
        return coroutine

    capture = logs.Capture()
    try:
        capture.open(tmp_path)
        thread = threading.Thread(target=writer, name="event-writer")
        thread.start()
        thread.join()
        for error in (ValueError("flush failed"), RuntimeError("Event loop is closed")):
            pending = suspended(error)
            del pending  # closed: its exception cannot be raised anywhere
            gc.collect()
    finally:
        capture.close()
    rest = f"(the rest in {tmp_path / 'train.log'})"
    first, second = capsys.readouterr().err.splitlines()
    assert first == (
        f"ERROR:threads:event-writer stopped: OSError: [Errno 28] No space left on device {rest}"
    )
    assert second.startswith("ERROR:unraisable:Exception ignored in <coroutine object ")
    assert second.endswith(f"ValueError: flush failed {rest}"), second
    # asyncio's complaint after a failed save or restore: in the file only.
    text = (tmp_path / "train.log").read_text()
    assert "in writer" in text and "in callback" in text, text
    assert "RuntimeError: Event loop is closed" in text, text
    # After the run (a refused one exits while orbax's callbacks still run): the same
    # complaint reaches neither the hooks the run found nor the console; others do.
    import types

    seen = []
    for hook in logs._unless_closed_loop(seen.append), sys.unraisablehook:
        hook(types.SimpleNamespace(exc_value=RuntimeError("Event loop is closed")))
    logs._unless_closed_loop(seen.append)(types.SimpleNamespace(exc_value=ValueError("x")))
    assert [str(a.exc_value) for a in seen] == ["x"]
    assert capsys.readouterr().err == ""


def test_python_warnings_are_one_line_and_a_donation_warning_goes_to_the_file_only(
    tmp_path, capsys
):
    import warnings

    capture = logs.Capture()
    try:
        capture.open(tmp_path)
        warnings.warn("Some donated buffers were not usable: float32[6,16].\nSee ...", stacklevel=1)
        warnings.warn("a warning of another kind\nwith a second line", stacklevel=1)
    finally:
        capture.close()
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("WARNING:py.warnings:") and "a warning of another kind" in line
    assert line.endswith(f"(the rest in {tmp_path / 'train.log'})"), line
    text = (tmp_path / "train.log").read_text()
    assert "INFO py.warnings" in text and "donated buffers were not usable" in text, text


# ---------------------------------------------------------------- evaluation


@pytest.mark.parametrize("layout", ["8x1", "2x4 pipelined"])
def test_an_evaluation_of_a_hundred_batches_finishes(tmp_path, layout):
    """train.eval_batches=100 on 8 fake CPU devices: every batch was dispatched at once,
    and XLA's CPU collectives stalled until it aborted the process (SIGABRT, exit 134,
    the steps since the last checkpoint lost). At most two are in flight now."""
    from helpers import PIPELINED

    overrides = {
        "train.steps": "2",
        "train.eval_every": "2",
        "train.eval_batches": "100",
        "checkpoint.every": "0",
        **(PIPELINED if layout != "8x1" else {}),
    }
    proc = run_train(tmp_path, timeout=600, **overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not proc.stderr.strip(), proc.stderr[-3000:]
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2 and math.isfinite(last["eval_loss"])
    # The mean over the 100 batches, as one would compute it by hand.
    config = tiny_config(**overrides)
    config = config_lib.resolve(config, 8)
    mesh = sharding.mesh_of(config)
    _, held_out, _ = loader.read_corpus(config)
    batches = loader.eval_batches(config, held_out, 100, slice(None))
    state = _restore_params(tmp_path, config, mesh)
    eval_fn = evaluation.make_eval_fn(run_of(config), mesh)
    losses = [float(eval_fn(state, loader.to_global(b["tokens"], mesh, 8))) for b in batches]
    assert last["eval_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)


def _restore_params(workdir, config, mesh):
    tx = optim.make_optimizer(config.train)
    manager = checkpoint.make_manager(workdir, config)
    try:
        step, state, _ = checkpoint.restore_latest(
            manager, step_lib.abstract_state(run_of(config), mesh, tx), config
        )
    finally:
        manager.close()
    assert step == 2  # saved before the evaluation, though checkpoint.every=0 saves at the end
    return state["params"]


@pytest.mark.slow
def test_a_run_killed_during_its_evaluation_loses_no_step(tmp_path):
    """Each evaluation comes after a save of its step: killed -9 in the middle of a long
    one (its step saved, its record not yet written), the run resumes from that step."""
    overrides = {
        "train.steps": "4",
        "train.eval_every": "2",
        "train.eval_batches": "3000",
        "checkpoint.every": "0",
    }
    cmd = [sys.executable, "train.py", "--workdir", str(tmp_path), *tiny_args(**overrides)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stderr=subprocess.PIPE)
    saved = checkpoint.directory(tmp_path) / "2"
    try:
        deadline = time.time() + 300
        while not saved.is_dir() and time.time() < deadline:  # renamed in whole
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            time.sleep(0.05)
        time.sleep(1)  # well into the 3000 batches
        assert proc.poll() is None, "the evaluation ended before the kill"
        logged = (tmp_path / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in logged] == [1]  # step 2 is being evaluated
    finally:
        proc.kill()
        proc.wait()
    proc = run_train(tmp_path, **{**overrides, "train.eval_batches": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {checkpoint.directory(tmp_path)}/2" in proc.stdout


# ---------------------------------------------------------------- signals at start-up


def _handles_sigterm(pid: int) -> bool:
    """Whether the process catches SIGTERM (train.py's first line makes it so)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(x for x in f if x.startswith("SigCgt:")).split()[1]
    except (OSError, StopIteration):
        return False
    return bool(int(caught, 16) & (1 << (signal.SIGTERM - 1)))


def _signal_at(workdir, delay: float, sigs: list, after_line: str | None = None, gap=0.07):
    """train.py (pipelined, endless, no compilation cache: the first compile takes
    seconds), sent `sigs` `gap` s apart, `delay` s after its handlers are in (or after
    it prints a line starting with `after_line`): (exit code, stdout, stderr)."""
    from helpers import PIPELINED

    env = {**subprocess_env(), "JAX_COMPILATION_CACHE_DIR": str(workdir) + ".jax-cache"}
    overrides = {"train.steps": "100000", "checkpoint.every": "1000", **PIPELINED}
    overrides["data.cache_dir"] = str(workdir) + ".cache"
    cmd = [sys.executable, "train.py", "--workdir", str(workdir), *tiny_args(**overrides)]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.time() + 2  # a fixed moment where no handler is put in
        while not _handles_sigterm(proc.pid) and time.time() < deadline:
            time.sleep(0.005)
        if after_line is not None:
            first = proc.stdout.readline()
            assert first.startswith(after_line), first + proc.stderr.read()[-3000:]
        time.sleep(delay)
        for sig in sigs:
            proc.send_signal(sig)
            time.sleep(gap)
        out, err = proc.communicate(timeout=120)  # an endless run that trains on: fails
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


def _stopped_at_once(workdir, code, out, err, signum) -> None:
    """One line, the documented exit code, nothing half-written, no step trained."""
    name = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}[signum]
    assert code == {signal.SIGINT: 130, signal.SIGTERM: 143}[signum], (code, err[-3000:])
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: stopped by {name} "), line
    assert not out.strip() or out.startswith("attention: "), out
    litter = [
        p
        for p in (list(workdir.parent.glob(workdir.name + ".cache/*")) + list(workdir.rglob("*")))
        if p.name.endswith(".tmp") or "tmp" in p.name
    ]
    assert not litter, litter
    assert not checkpoint.complete_steps(checkpoint.directory(workdir))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_the_imports_is_one_line(tmp_path, signum):
    """SIGINT while jax imports was a 30-line KeyboardInterrupt traceback (twice), SIGTERM
    the C++ crash handler's stack dump."""
    code, out, err = _signal_at(tmp_path / "w", 0.0, [signum])
    _stopped_at_once(tmp_path / "w", code, out, err, signum)


def test_two_ctrl_cs_during_the_first_compile_abort_at_once(tmp_path):
    """Both come while the main thread compiles the first step (in C): Python ran the
    handler once, the two counted as one, and the run trained, saved and exited 0."""
    code, out, err = _signal_at(
        tmp_path / "w", 0.3, [signal.SIGINT, signal.SIGINT], after_line="attention: "
    )
    assert code == 130, (code, out[-2000:], err[-3000:])
    (line,) = err.strip().splitlines()
    assert line.startswith("error: stopped by a second Ctrl-C, without saving"), line
    assert not checkpoint.complete_steps(checkpoint.directory(tmp_path / "w"))


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.1, 1.0, 2.5, 5.0, 8.0])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_at_any_moment_of_the_start_up_is_one_line(tmp_path, signum, delay):
    """Imports, the data, the workdir's lock and restore, the first compile: one line, the
    exit code, nothing half-written; a Ctrl-C once the loop runs stops it at the step in
    flight, saved (exit 0), and no later one."""
    workdir = tmp_path / "w"
    code, out, err = _signal_at(workdir, delay, [signum])
    if code == 0:  # the loop had it: the step in flight finished and saved, no later one
        name = signal.Signals(signum).name
        last = out.strip().splitlines()[-1]
        stopped = re.match(rf"stopped by {name} at step (\d+);", last)
        assert stopped, out
        steps = checkpoint.complete_steps(checkpoint.directory(workdir))
        assert steps == [int(stopped[1])], (steps, last)
        assert not err.strip(), err
    else:
        _stopped_at_once(workdir, code, out, err, signum)
