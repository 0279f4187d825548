"""Faults, for real: NaN steps, SIGKILL in the middle of a checkpoint save, a full disk."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import chex
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import (
    REPO,
    fill_disk,
    read_events,
    run_of,
    run_train,
    subprocess_env,
    tiny_args,
    tiny_config,
)

from seqpipe.parallel import sharding
from seqpipe.train import checkpoint, optim, trainer
from seqpipe.train import step as step_lib

# Step 3 is bad once; 6, 7, 8 are three in a row.
NAN = {"train.steps": "10", "train.inject_nan_at": "(3, 6, 7, 8)", "train.max_bad_steps": "3"}


def _applied_lrs(config, steps, bad) -> list[float]:
    """The rate each step's update uses: the schedule at the count of updates applied
    before it (a skipped step applies none; it does not move the schedule on)."""
    lr = optim.lr_schedule(config.train)
    return [float(lr(s - 1 - sum(b < s for b in bad))) for s in steps]


def _restore_step(workdir, config, step):
    """The train state of checkpoint `step`, on the 8 x 1 mesh."""
    tx = optim.make_optimizer(config.train)
    target = step_lib.abstract_state(run_of(config), sharding.make_mesh(8, 1), tx)
    manager = checkpoint.make_manager(workdir, config)
    try:
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target))
        return manager.restore(step, args=args)["state"]
    finally:
        manager.close()


def _same(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_nan_steps_are_skipped_counted_and_stop_the_run(tmp_path):
    # In process, a checkpoint after every step: the bad step 3 changes nothing but the step.
    every = tiny_config(**NAN, **{"train.stop_at": "4", "checkpoint.every": "1"})
    every.unlock()
    every.checkpoint.keep = 0
    records = trainer.run(every, str(tmp_path / "every"))
    by_step = {r["step"]: r for r in records}
    assert np.isnan(by_step[3]["loss"]) and np.isnan(by_step[3]["grad_norm"])
    assert [(r["bad_steps"], r["bad_steps_in_row"]) for r in records] == [
        (0, 0),
        (0, 0),
        (1, 1),
        (1, 0),
    ]
    assert np.isfinite(by_step[4]["loss"])
    # The rate logged is the one the optimizer applied: step 4 reuses step 3's.
    expected = _applied_lrs(every, range(1, 5), bad=[3])
    assert [r["learning_rate"] for r in records] == pytest.approx(expected, rel=1e-6)
    assert expected[2] == expected[3] != expected[1]
    s2, s3, s4 = (_restore_step(tmp_path / "every", every, s) for s in (2, 3, 4))
    assert int(s2["step"]) == 2 and int(s3["step"]) == 3
    chex.assert_trees_all_equal(s2["params"], s3["params"])
    chex.assert_trees_all_equal(s2["opt_state"], s3["opt_state"])
    assert not _same(s3["params"], s4["params"])  # and the good step 4 trained again
    chex.assert_tree_all_finite(s3)
    (events,) = (tmp_path / "every").glob("events.out.tfevents.*")
    assert read_events(events)["bad_steps"][-1] == (4, 1.0)

    # The real command line, checkpoints every 4 steps: 6, 7, 8 in a row stop it at 8.
    workdir = tmp_path / "cli"
    proc = run_train(workdir, **NAN)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: steps 6-8: 3 in a row with a non-finite loss"), line
    assert f"the last checkpoint, step 4 in {checkpoint.directory(workdir)}, is as it" in line
    logged = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, 9))
    assert [r["bad_steps_in_row"] for r in logged] == [0, 0, 1, 0, 0, 1, 2, 3]
    assert logged[-1]["bad_steps"] == 4
    expected = _applied_lrs(every, range(1, 9), bad=[3, 6, 7, 8])
    assert [r["learning_rate"] for r in logged] == pytest.approx(expected, rel=1e-6)
    assert "skipped 4 (3 in a row)" in proc.stdout.strip().splitlines()[-1]
    # Nothing saved at or after the bad run; the good checkpoint is the one made in process.
    assert sorted(p.name for p in checkpoint.directory(workdir).iterdir()) == ["4"]
    assert _same(_restore_step(workdir, every, 4), s4)


def _logged(workdir) -> dict[int, float]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x)["step"] for x in lines]
    assert steps == sorted(set(steps)), steps  # no step twice
    return {json.loads(x)["step"]: json.loads(x)["loss"] for x in lines}


def test_sigkill_during_a_checkpoint_save_resumes_from_the_previous_one(tmp_path):
    """A checkpoint after every step; the process is killed -9 while orbax writes one (its
    temporary directory is there), restarts from the previous complete step and ends with
    the losses of a run never interrupted, bit for bit."""
    overrides = {"train.steps": "12", "checkpoint.every": "1"}
    straight = trainer.run(tiny_config(**overrides), str(tmp_path / "straight"))
    workdir = tmp_path / "killed"
    ckpt = checkpoint.directory(workdir)
    cmd = [sys.executable, "train.py", "--workdir", str(workdir)] + tiny_args(**overrides)
    for _ in range(5):  # the kill can land just after a rename: then kill the next save
        proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=subprocess.DEVNULL)
        while proc.poll() is None:
            names = os.listdir(ckpt) if ckpt.is_dir() else []
            if any(n.isdigit() for n in names) and any(checkpoint.TMP_SUFFIX in n for n in names):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.001)
        assert proc.wait(timeout=60) == -signal.SIGKILL, "finished before a save was cut"
        partial = [n for n in os.listdir(ckpt) if checkpoint.TMP_SUFFIX in n]
        if partial:
            break
    (partial,) = partial
    complete = checkpoint.complete_steps(ckpt)[-1]
    assert int(partial.split(".")[0]) == complete + 1  # killed while saving the next step
    proc = run_train(workdir, **overrides)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"resumed from {ckpt}/{complete}\n"), proc.stdout
    assert checkpoint.complete_steps(ckpt) == [10, 11, 12]  # keep=3; the partial one is gone
    assert not [n for n in os.listdir(ckpt) if checkpoint.TMP_SUFFIX in n]
    assert _logged(workdir) == {r["step"]: r["loss"] for r in straight}


@pytest.mark.parametrize(
    "leave, reason",
    # Far too little is refused before orbax starts; a little less than the checkpoint's
    # blocks passes that check and fails in orbax's writes.
    [
        # Free space as the check reads it: the run's own logs take a few blocks first.
        pytest.param(64 * 1024, r" bytes needed, [\d,]+ free", marks=pytest.mark.slow),
        (600 * 1024, "no space left on device"),
    ],
)
def test_disk_full_during_a_save_keeps_the_previous_checkpoint(small_disk, leave, reason):
    workdir = small_disk / "w"
    overrides = {"train.steps": "8", "checkpoint.every": "4", "train.log_every": "4"}
    config = tiny_config(**overrides)
    trainer.run(tiny_config(**overrides, **{"train.stop_at": "4"}), str(workdir))
    before = _restore_step(workdir, config, 4)
    fill_disk(small_disk, leave)
    proc = run_train(workdir, **overrides)
    assert proc.returncode == 1
    # orbax logs its writers' errors itself; the last line is ours.
    last = proc.stderr.strip().splitlines()[-1]
    ckpt = checkpoint.directory(workdir)
    assert last.startswith(f"error: saving the checkpoint of step 8 in {ckpt} failed ("), (
        proc.stderr[-2500:]
    )
    tail = re.escape(
        "); step 4 is the newest complete one, intact; free space there (or lower "
        "checkpoint.keep) and run again to resume"
    )
    assert re.search(f"{reason}{tail}$", last), proc.stderr[-3000:]
    # Above it, orbax's errors one line each (their tracebacks are in train.log): it used to
    # be hundreds of lines of tracebacks.
    before_ours = proc.stderr.strip().splitlines()[:-1]
    assert all(x.startswith(("WARNING:", "ERROR:", "CRITICAL:")) for x in before_ours), proc.stderr[
        -3000:
    ]
    assert sorted(os.listdir(ckpt)) == ["4"]  # the partial save was removed
    assert _same(_restore_step(workdir, config, 4), before)
    # With space again, the same command resumes from step 4 and finishes.
    os.remove(small_disk / "filler")
    proc = run_train(workdir, **overrides)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"resumed from {ckpt}/4\n")
    assert checkpoint.complete_steps(ckpt) == [4, 8]


def test_metrics_write_failure_stops_cleanly_and_resumes(tmp_path):
    """metrics.jsonl on a full device (/dev/full: every write fails with ENOSPC): one line,
    exit 1, the checkpoint as it was; with the file back, the run resumes from it."""
    workdir = tmp_path / "w"
    overrides = {"train.steps": "4", "train.log_every": "1", "checkpoint.every": "2"}
    trainer.run(tiny_config(**overrides, **{"train.stop_at": "2"}), str(workdir))
    (workdir / "metrics.jsonl").unlink()
    (workdir / "metrics.jsonl").symlink_to("/dev/full")
    proc = run_train(workdir, **overrides)
    assert proc.returncode == 1, proc.stderr
    ckpt = checkpoint.directory(workdir)
    assert proc.stderr == (
        f"error: writing step 3 to {workdir}/metrics.jsonl failed (No space left on device); "
        f"stopped, step 2 in {ckpt} is the newest checkpoint; free space there and run again "
        "to resume\n"
    )
    assert checkpoint.complete_steps(ckpt) == [2]
    (workdir / "metrics.jsonl").unlink()
    resumed = trainer.run(tiny_config(**overrides), str(workdir))
    assert [r["step"] for r in resumed] == [3, 4]
