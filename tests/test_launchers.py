"""train.py under a cluster launcher, with no --coordinator flags: two real processes with the
environment SLURM's `srun` sets for a 2-task step on one node, and the one Open MPI's
`mpirun -np 2` (4.x, ORTE) sets, each with 4 fake CPU devices (gloo collectives, on
127.0.0.1), form one run and reach, step by step, one 8-device process's losses; a
single-task step of either stays one process (no distributed start-up); Open MPI 5's
environment without mpi4py ends in one line.

No srun or mpirun is needed: the variables are set as each launcher sets them, and JAX's own
cluster detection (`jax._src.clusters.slurm_cluster`, `ompi_cluster`) reads them. Neither
sets JAX_COORDINATOR_PORT: JAX derives the coordinator's port from the job id (SLURM) or the
job family of the HNP URI (Open MPI), 61440 + (id mod 4096); the tests pick an id whose port
is free, and the coordinator's host is the step's first node (SLURM) or the URI's first
address (Open MPI)."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from helpers import (
    PIPELINED,
    REPO,
    logged_losses,
    subprocess_env,
    tiny_args,
    tiny_config,
    wait_all,
)

from seqpipe.train import checkpoint, trainer

STEPS = 2
# test_multihost's default 4 x 2 case (data replicas across the processes), 2 steps.
OVERRIDES = {
    **PIPELINED,
    "mesh.data": "4",
    "mesh.stage": "2",
    "train.steps": str(STEPS),
    "checkpoint.every": str(STEPS),
}
# JAX's launcher-derived ports: [65535 - 2**12 + 1, 65535], above Linux's ephemeral range.
PORT_BASE = 65536 - 2**12
# Variables of a launcher that the test process may itself run under (a CI job started
# by srun or mpirun): none of them reaches the trainer processes but the ones set here.
LAUNCHER_PREFIXES = ("SLURM", "OMPI_", "PMI", "PMIX", "JAX_COORDINATOR", "JAX_PROCESS", "JAX_NUM")


def _port_is_free(port: int) -> bool:
    """Whether JAX's coordinator could bind [::]:port (and 0.0.0.0:port) now."""
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family) as s:
                s.bind((host, port))
        except OSError as e:
            if family == socket.AF_INET6 and e.errno in (97, 99):  # no IPv6 here
                continue
            return False
    return True


def _launcher_port() -> int:
    """A free port of the launchers' range (JAX derives the coordinator's port in it)."""
    rng = np.random.default_rng()
    for port in rng.permutation(np.arange(PORT_BASE, 65536)):
        if _port_is_free(int(port)):
            return int(port)
    raise RuntimeError("no free port in 61440-65535")


def slurm_env(task: int, tasks: int, port: int) -> dict:
    """What `srun --ntasks=<tasks>` sets for task `task` of a one-node step; the job id is
    one whose derived coordinator port is `port`."""
    job = str(4096 * 1000 + port - PORT_BASE)
    node = "localhost"
    return {
        "SLURM_JOB_ID": job,
        "SLURM_JOBID": job,
        "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0",
        "SLURM_JOB_NODELIST": node,
        "SLURM_NODELIST": node,
        "SLURM_STEP_NODELIST": node,
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NNODES": "1",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_NTASKS": str(tasks),
        "SLURM_NPROCS": str(tasks),
        "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_TASKS_PER_NODE": str(tasks),
        "SLURM_STEP_TASKS_PER_NODE": str(tasks),
        "SLURM_PROCID": str(task),
        "SLURM_LOCALID": str(task),
        "SLURM_NODEID": "0",
        "SLURM_GTIDS": ",".join(map(str, range(tasks))),
        "SLURMD_NODENAME": node,
        "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1",
    }


def openmpi_env(rank: int, size: int, port: int) -> dict:
    """What Open MPI 4's `mpirun -np <size>` sets for rank `rank` on one node. The HNP URI
    names mpirun's own daemon (its job family, its addresses and port); JAX takes the
    coordinator's host from its first address and the port from the job family."""
    family = (4096 * 100 + port - PORT_BASE) * 4096
    return {
        "OMPI_MCA_orte_hnp_uri": f"{family}.0;tcp://127.0.0.1,10.255.0.1:34911",
        "OMPI_MCA_orte_local_daemon_uri": f"{family}.0;tcp://127.0.0.1,10.255.0.1:34911",
        "OMPI_MCA_orte_ess_num_procs": str(size),
        "OMPI_MCA_orte_num_nodes": "1",
        "OMPI_MCA_ess": "^singleton",
        "OMPI_MCA_orte_ess_node_rank": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(size),
        "OMPI_COMM_WORLD_NODE_RANK": str(rank),
        "OMPI_UNIVERSE_SIZE": str(size),
        "OMPI_APP_CTX_NUM_PROCS": str(size),
        "OMPI_FIRST_RANKS": "0",
    }


LAUNCHERS = {"slurm": slurm_env, "openmpi": openmpi_env}


def _clean(env: dict) -> dict:
    return {k: v for k, v in env.items() if not k.startswith(LAUNCHER_PREFIXES)}


def _process_env() -> dict:
    """Each of the two processes: 4 devices, no persistent compile cache (as in
    test_multihost: with it, process 0 alone writes the cache and reaches the first
    collective a whole compile ahead of process 1, past gloo's 30 s)."""
    return _clean({**subprocess_env(devices=4), "JAX_ENABLE_COMPILATION_CACHE": "false"})


def _train(workdir, envs: list[dict], timeout: int = 300) -> list[subprocess.CompletedProcess]:
    """train.py started once for each environment, the same command for all (as a launcher
    starts it), all waited for; killed on a hang."""
    command = [sys.executable, "train.py", *tiny_args(**OVERRIDES), "--workdir", str(workdir)]
    procs = [
        subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for env in envs
    ]
    return wait_all(procs, timeout)


@pytest.fixture(scope="module")
def single_losses(tmp_path_factory) -> dict[int, float]:
    """The same run in this process, on its 8 devices."""
    workdir = tmp_path_factory.mktemp("single")
    losses = {r["step"]: r["loss"] for r in trainer.run(tiny_config(**OVERRIDES), str(workdir))}
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def _assert_losses(workdir, single):
    losses = logged_losses(workdir)
    assert sorted(losses) == sorted(single)
    np.testing.assert_allclose(
        [losses[s] for s in sorted(losses)], [single[s] for s in sorted(losses)], rtol=1e-6
    )


@pytest.mark.parametrize("launcher", ["slurm", "openmpi"])
def test_two_tasks_of_a_launcher_form_one_run(tmp_path, launcher, single_losses):
    """No --coordinator flags: each process finds its place in the launcher's variables.
    Each has 4 devices, so the 8-device mesh runs only if the two joined."""
    port = _launcher_port()
    envs = [{**_process_env(), **LAUNCHERS[launcher](i, 2, port)} for i in range(2)]
    done = _train(tmp_path, envs)
    for i, r in enumerate(done):
        assert r.returncode == 0, (i, r.stderr[-3000:])
    # One run: only process 0 prints and writes the metrics; process 1 keeps its own log.
    assert "loss" in done[0].stdout and "loss" not in done[1].stdout, done[1].stdout
    assert (tmp_path / "train.log").exists() and (tmp_path / "train.1.log").exists()
    _assert_losses(tmp_path, single_losses)
    # Both wrote their shards of the checkpoint and it was committed once.
    assert checkpoint.complete_steps(checkpoint.directory(tmp_path)) == [STEPS]


@pytest.mark.parametrize("launcher", ["slurm", "openmpi"])
def test_a_single_task_launcher_step_stays_one_process(tmp_path, launcher, single_losses):
    """SLURM_NTASKS=1 (or OMPI_COMM_WORLD_SIZE=1) with every other variable of the launcher
    set: no distributed start-up. The port JAX would derive is held by this test, so a
    coordinator started there would fail to bind (JAX's gRPC server then logs the bind
    error and the process dies of SIGSEGV: checked by hand, with JAX_COORDINATOR_ADDRESS
    forcing a start-up)."""
    port = _launcher_port()
    env = {**_clean(subprocess_env(devices=8)), **LAUNCHERS[launcher](0, 1, port)}
    with socket.socket(socket.AF_INET) as held:
        held.bind(("0.0.0.0", port))
        held.listen()
        (done,) = _train(tmp_path, [env])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loss" in done.stdout
    assert not (tmp_path / "train.1.log").exists()
    _assert_losses(tmp_path, single_losses)


def test_the_launcher_environments_here_are_the_ones_jax_detects(monkeypatch):
    """The variables above are what JAX's cluster detection reads: each picks its cluster
    and derives the coordinator, the process count and this process's id from them (the
    port test above relies on; no process started)."""
    from jax._src.clusters import ClusterEnv

    port = _launcher_port()
    for launcher, host in (("slurm", "localhost"), ("openmpi", "127.0.0.1")):
        for name in list(os.environ):
            if name.startswith(LAUNCHER_PREFIXES):
                monkeypatch.delenv(name)
        for name, value in LAUNCHERS[launcher](1, 2, port).items():
            monkeypatch.setenv(name, value)
        found = ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, 60)
        assert found == (f"{host}:{port}", 2, 1, [1]), (launcher, found)


def test_open_mpi_5_without_mpi4py_is_one_line(tmp_path):
    """Open MPI 5's mpirun (PRRTE) sets no HNP URI: JAX needs mpi4py to find the coordinator
    (jax 0.10 does not read Open MPI 5 at all). Without it, one line and exit 2, not JAX's
    traceback."""
    if subprocess.run([sys.executable, "-c", "import mpi4py"], capture_output=True).returncode == 0:
        pytest.skip("mpi4py is installed: JAX would find the coordinator through MPI")
    env = {**_process_env(), **openmpi_env(0, 2, _launcher_port()), "OMPI_VERSION": "5.0.3"}
    for name in ("OMPI_MCA_orte_hnp_uri", "OMPI_MCA_orte_local_daemon_uri"):
        del env[name]
    (done,) = _train(tmp_path, [env], timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: could not join the run this launcher's environment"), line
    assert line.endswith("give --coordinator, --num_processes and --process_id instead"), line
