"""Two real processes on 127.0.0.1, 4 fake CPU devices each (gloo collectives), train on
1 x 8, 2 x 4 and 4 x 2 meshes (data x stage), 1 x 4 x 2 (data x stage x tensor) and
1 x 1 x 4 x 2 (data x stage x context x tensor) and reach, step by step, the losses one
process with 8 devices reaches; both write checkpoints and only process 0 logs."""

import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import (
    ONE_BY_EIGHT,
    PIPELINED,
    REPO,
    logged_losses,
    subprocess_env,
    tiny_args,
    tiny_config,
    wait_all,
)

from seqpipe.train import checkpoint, trainer

STEPS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process_env() -> dict:
    """The environment of each of the two processes: 4 devices, no persistent compile cache.

    Only process 0 writes that cache and process 1's keys differ, so with it process 0 would
    reach the first collective a whole compile ahead of process 1, and gloo gives up on a
    peer after 30 s: on a loaded machine the run failed. Without it both compile at once.
    """
    return {**subprocess_env(devices=4), "JAX_ENABLE_COMPILATION_CACHE": "false"}


# 1 x 8: both processes hold every row (stages spread over hosts, as on a pod);
# 2 x 4: each holds one data replica; 4 x 2: each holds two; 1 x 4 x 2: stages over
# hosts, each tensor pair within one; 1 x 1 x 4 x 2 (data x stage x context x tensor): a
# context group across the hosts, each holding two of its devices' tensor pairs.
@pytest.mark.parametrize(
    "data_size, stages, tensor, context",
    # The default run takes 4 x 2 (data replicas across processes: the gradient reduction
    # and the checkpoint cross them); the others, each 90-260 s on 2 cores, run under
    # make test-all.
    [
        pytest.param(1, 8, 1, 1, marks=pytest.mark.slow),
        pytest.param(2, 4, 1, 1, marks=pytest.mark.slow),
        (4, 2, 1, 1),
        pytest.param(1, 4, 2, 1, marks=pytest.mark.slow),
        pytest.param(1, 1, 2, 4, marks=pytest.mark.slow),
    ],
    ids=["1x8", "2x4", "4x2", "1x4x2", "1x1x4x2"],
)
def test_two_processes_match_one(tmp_path, data_size, stages, tensor, context):
    overrides = {
        **PIPELINED,
        "mesh.data": str(data_size),
        "mesh.stage": str(stages),
        "mesh.tensor": str(tensor),
        "mesh.context": str(context),
        "train.seq_len": str(16 * context),  # 2 segments of 2 * context pieces each
        "model.num_layers": "8",  # one per stage on 1 x 8
        "train.steps": str(STEPS),
        "checkpoint.every": "2",
    }
    multi = tmp_path / "multi"
    done = _launch(multi, overrides)
    for r in done:
        assert r.returncode == 0, r.stderr[-3000:]
    # Only process 0 logs.
    assert "loss" in done[0].stdout and "loss" not in done[1].stdout
    # The same run in this process, on its 8 devices.
    single = {
        r["step"]: r["loss"]
        for r in trainer.run(tiny_config(**overrides), str(tmp_path / "single"))
    }
    multi_losses = logged_losses(multi)
    assert sorted(multi_losses) == sorted(single) == list(range(1, STEPS + 1))
    np.testing.assert_allclose(
        [multi_losses[s] for s in sorted(multi_losses)],
        [single[s] for s in sorted(multi_losses)],
        rtol=1e-6,
    )
    # Both processes wrote their shards of the checkpoints, every 2 steps.
    steps = sorted(int(p.name) for p in checkpoint.directory(multi).iterdir() if p.name.isdigit())
    assert steps == [2, 4]


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, target", [(signal.SIGTERM, 1), (signal.SIGINT, 0)], ids=["SIGTERM-to-1", "SIGINT-to-0"]
)
def test_a_signal_to_one_process_stops_both_at_the_same_step(tmp_path, sig, target):
    """JAX's preemption service agrees on the step; both save it and exit 0."""
    overrides = {**PIPELINED, "train.steps": "100000", "checkpoint.every": "0"}
    procs = _spawn(tmp_path, overrides)
    try:
        deadline = time.monotonic() + 240
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.2)
        procs[target].send_signal(sig)
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[target][1][-2000:]
    last = outs[0][0].strip().splitlines()[-1]
    assert last.startswith(f"stopped by {sig.name} at step ") or last.startswith(
        "stopped by SIGTERM at step "
    ), last
    stopped = int(last.split("at step ")[1].split(";")[0])
    steps = [int(p.name) for p in checkpoint.directory(tmp_path).iterdir() if p.name.isdigit()]
    assert steps == [stopped]
    assert logged_losses(tmp_path).keys() == set(range(1, stopped + 1))


def _spawn(workdir, overrides) -> list[subprocess.Popen]:
    """train.py started as two processes on one workdir (4 devices each, one coordinator)."""
    port = _free_port()
    return [
        subprocess.Popen(
            [sys.executable, "train.py", *tiny_args(**overrides), "--workdir", str(workdir)]
            + [
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num_processes",
                "2",
                "--process_id",
                str(i),
            ],
            cwd=REPO,
            env=_process_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]


def _launch(workdir, overrides) -> list[subprocess.CompletedProcess]:
    """`_spawn`, both waited for (killed on a hang)."""
    return wait_all(_spawn(workdir, overrides))


@pytest.fixture(scope="module")
def trained_two_processes(tmp_path_factory):
    """Checkpoints 1 and 2 of a two-process run, and its losses."""
    workdir = tmp_path_factory.mktemp("multi") / "w"
    procs = _launch(workdir, {**ONE_BY_EIGHT, "train.stop_at": "2"})
    for p in procs:
        assert p.returncode == 0, p.stderr[-3000:]
    return workdir, logged_losses(workdir)


def _process_1_data_file(step_dir):
    files = list((step_dir / "state").rglob("ocdbt.process_1/d/*"))
    assert files, sorted(str(p) for p in (step_dir / "state").rglob("*"))
    return max(files, key=lambda p: p.stat().st_size)


def _truncate(f):
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)


def _overwrite_8_bytes(f):
    with open(f, "r+b") as fh:
        fh.seek(f.stat().st_size // 2)
        fh.write(b"\xa5" * 8)


@pytest.mark.parametrize(
    "damage",
    [_truncate, pytest.param(_overwrite_8_bytes, marks=pytest.mark.slow)],
    ids=["truncated", "8-bytes"],
)
def test_a_damaged_checkpoint_makes_both_processes_fall_back_to_the_same_step(
    trained_two_processes, tmp_path, damage
):
    """Process 1's data file of checkpoint 2 damaged on disk: only process 1 reads it, yet
    both processes set checkpoint 2 aside, resume from step 1 and recompute step 2 exactly."""
    source, losses = trained_two_processes
    workdir = tmp_path / "w"
    shutil.copytree(source, workdir)
    ckpt = checkpoint.directory(workdir)
    damage(_process_1_data_file(ckpt / "2"))
    procs = _launch(workdir, {**ONE_BY_EIGHT, "train.stop_at": "3"})
    named = []
    for i, p in enumerate(procs):
        assert p.returncode == 0, (i, p.stderr[-3000:])
        (line,) = [x for x in p.stderr.splitlines() if "damaged" in x]
        assert line.startswith(f"warning: checkpoint {ckpt}/2 is damaged ("), (i, line)
        if damage is _truncate:
            # Process 0 may or may not touch the damaged file in its own reads (both
            # happen); if it does not, it says that another process could not read its part.
            own = "(array " in line and " cannot be read)" in line
            assert own or "(another process could not read its part)" in line, (i, line)
            named.append(own)
        assert line.endswith(f"; moved aside to {ckpt}/2.damaged; resuming from step 1"), line
    if damage is _truncate:  # the array, not TensorStore's spec, by the process that read it
        assert named[1], procs[1].stderr[-3000:]
    # gloo prints its connections on stdout, among the run's lines.
    assert f"resumed from {ckpt}/1" in procs[0].stdout.splitlines(), procs[0].stdout
    assert checkpoint.complete_steps(ckpt) == [1, 2, 3]
    assert (ckpt / "2.damaged").is_dir()
    again = logged_losses(workdir)
    assert sorted(again) == [1, 2, 3]
    assert again[2] == losses[2]  # the step recomputed from checkpoint 1, bit for bit


def test_a_checkpoint_one_process_cannot_read_is_set_aside_by_both(trained_two_processes, tmp_path):
    """Process 1 alone fails to read checkpoint 2 (as a file its host cannot read): process 0,
    which read its part, does not go on to the checksums without it (a collective process 1
    would never join); both move checkpoint 2 aside and restore step 1."""
    source, _ = trained_two_processes
    workdir = tmp_path / "w"
    shutil.copytree(source, workdir)
    ckpt = checkpoint.directory(workdir)
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "tests/two_process_restore.py", str(workdir), str(port), str(i)],
            cwd=REPO,
            env=_process_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    reasons = ["another process could not read its part", "OSError: [Errno 5] Input/output error"]
    for p, (out, err), reason in zip(procs, outs, reasons, strict=True):
        assert p.returncode == 0, err[-3000:]
        assert "restored step 1" in out.splitlines(), out
        assert f"warning: checkpoint {ckpt}/2 is damaged ({reason}); moved aside" in err, err
    assert checkpoint.complete_steps(ckpt) == [1]
    assert (ckpt / "2.damaged").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("lost", [1, 0])
def test_a_lost_peer_ends_the_survivor_within_a_minute_in_one_line(tmp_path, lost):
    """kill -9 of one process once a checkpoint is saved. The survivor of a lost process 1
    waited 60-87 s in a collective and ended in a traceback and SIGABRT; the survivor of a
    lost process 0 aborted with 38 lines of C++ fatal logs. Now each ends within a minute
    (`peers.HEARTBEAT_S`), its last line names the lost process and the newest intact
    checkpoint (`seqpipe.host.runtime_log`), the C++ logs are in its log file, and the
    checkpoint is whole."""
    workdir = tmp_path / "w"
    overrides = {**ONE_BY_EIGHT, "train.steps": "100000", "checkpoint.every": "2"}
    procs = _spawn(workdir, overrides)
    survivor = procs[1 - lost]
    try:
        deadline = time.time() + 400
        while not checkpoint.complete_steps(checkpoint.directory(workdir)):
            assert time.time() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.2)
        procs[lost].kill()
        killed = time.time()
        _, err = survivor.communicate(timeout=120)
        assert time.time() - killed < 60, time.time() - killed
        assert survivor.returncode != 0
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    print(
        survivor.returncode, err, [(p, p.read_text()[-3000:]) for p in workdir.glob("train*.log")]
    )
    last = err.strip().splitlines()[-1]
    newest = checkpoint.complete_steps(checkpoint.directory(workdir))[-1]
    assert last.startswith(f"error: lost process {lost} of the run ("), err[-3000:]
    assert f"the newest intact checkpoint is step {newest} in " in last, last
    assert len(err.strip().splitlines()) <= 3, err[-3000:]
    assert checkpoint.complete_steps(checkpoint.directory(workdir))[0] == 2
