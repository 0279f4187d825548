"""Two real processes on 127.0.0.1, 4 fake CPU devices each (gloo collectives), train on
1 x 8, 2 x 4 and 4 x 2 meshes (data x stage) and 1 x 4 x 2 (data x stage x tensor) and
reach, step by step, the losses one process with 8 devices reaches; both write
checkpoints and only process 0 logs."""

import json
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from test_train import PIPELINED, REPO, subprocess_env, tiny_args, tiny_config

from seqpipe import checkpoint, train

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


def _losses(workdir) -> dict[int, float]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


# 1 x 8: both processes hold every row (stages spread over hosts, as on a pod);
# 2 x 4: each holds one data replica; 4 x 2: each holds two; 1 x 4 x 2: stages over
# hosts, each tensor pair within one.
@pytest.mark.parametrize(
    "data_size, stages, tensor",
    [(1, 8, 1), (2, 4, 1), (4, 2, 1), (1, 4, 2)],
    ids=["1x8", "2x4", "4x2", "1x4x2"],
)
def test_two_processes_match_one(tmp_path, data_size, stages, tensor):
    overrides = {
        **PIPELINED,
        "mesh.data": str(data_size),
        "mesh.stage": str(stages),
        "mesh.tensor": str(tensor),
        "model.num_layers": "8",  # one per stage on 1 x 8
        "train.steps": str(STEPS),
        "checkpoint.every": "2",
    }
    args = [sys.executable, "train.py"] + tiny_args(**overrides)
    port = _free_port()
    multi = tmp_path / "multi"
    procs = [
        subprocess.Popen(
            args
            + [
                "--workdir",
                str(multi),
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
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    # Only process 0 logs.
    assert "loss" in outs[0][0] and "loss" not in outs[1][0]
    # The same run in this process, on its 8 devices.
    single = {
        r["step"]: r["loss"] for r in train.run(tiny_config(**overrides), str(tmp_path / "single"))
    }
    multi_losses = _losses(multi)
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
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "train.py",
                *tiny_args(**overrides),
                "--workdir",
                str(tmp_path),
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
    assert _losses(tmp_path).keys() == set(range(1, stopped + 1))
