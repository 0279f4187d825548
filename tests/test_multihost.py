"""Two real processes on 127.0.0.1, 4 fake CPU devices each (gloo collectives), train on a
2 x 4 mesh and reach the losses one process with 8 devices reaches; both write checkpoints
and only process 0 logs."""

import json
import socket
import subprocess
import sys

import numpy as np
from test_train import PIPELINED, REPO, subprocess_env, tiny_args

from seqpipe import checkpoint

STEPS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(workdir) -> dict[int, float]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def test_two_processes_match_one(tmp_path):
    overrides = {**PIPELINED, "train.steps": str(STEPS), "checkpoint.every": "2"}
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
            env=subprocess_env(devices=4),
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
    single = tmp_path / "single"
    proc = subprocess.run(
        args + ["--workdir", str(single)],
        cwd=REPO,
        env=subprocess_env(devices=8),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    multi_losses, single_losses = _losses(multi), _losses(single)
    assert sorted(multi_losses) == list(range(1, STEPS + 1))
    np.testing.assert_allclose(
        [multi_losses[s] for s in sorted(multi_losses)],
        [single_losses[s] for s in sorted(multi_losses)],
        rtol=1e-6,
    )
    # Both processes wrote their shards of the checkpoints, every 2 steps.
    steps = sorted(int(p.name) for p in checkpoint.directory(multi).iterdir() if p.name.isdigit())
    assert steps == [2, 4]
