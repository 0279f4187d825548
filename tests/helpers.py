"""What many test modules share: the repository, the tiny model's overrides, the
environment of a trainer subprocess, the one helper that runs `train.py` as a process,
TensorBoard event readers, the compilers for other chips, a disk to fill, and the release
of cached executables before a process runs out of memory maps."""

import errno
import json
import os
import platform
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import pytest

from seqpipe.run import config as config_lib
from seqpipe.tools import flops

REPO = Path(__file__).resolve().parent.parent
# The compilers for chips that are not here: libtpu, JAX's CUDA plugin (`make install`).
needs_libtpu = pytest.mark.skipif(
    not (sys.platform == "linux" and platform.machine() == "x86_64"),
    reason="libtpu exists for Linux x86-64 only",
)
needs_plugin = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"),
    reason="JAX's CUDA plugin exists for Linux only",
)
# Many tests here compile the same tiny step; a persistent compilation cache (shared with
# the subprocesses) turns every compile after the first into a lookup. Set while modules are
# collected, before anything compiles.
COMPILE_CACHE = Path(tempfile.gettempdir()) / f"seqpipe-test-jax-cache-{os.getuid()}"
jax.config.update("jax_compilation_cache_dir", str(COMPILE_CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
# A model small enough that a step is milliseconds: the tests are about the machinery.
TINY = {
    "data.tokenizer": "byte",
    "model.vocab_size": "256",
    "model.num_layers": "4",
    "model.d_model": "32",
    "model.num_heads": "2",
    "model.d_ff": "64",
    "train.seq_len": "16",
    "train.global_batch_size": "8",
    "train.steps": "8",
    "train.warmup_steps": "2",
    "train.log_every": "1",
    "train.eval_every": "0",
    "checkpoint.every": "4",
    "mesh.data": "8",
    "mesh.stage": "1",
    "pipeline.schedule": "none",
    "pipeline.microbatches": "1",
    "pipeline.segments": "1",
}
# The same model pipelined: 1F1B-style Seq1F1B on 2 x 4, two micro-batches of two segments.
PIPELINED = {
    "mesh.data": "2",
    "mesh.stage": "4",
    "pipeline.schedule": "seq1f1b",
    "pipeline.microbatches": "2",
    "pipeline.segments": "2",
}

# 1 x 8: process 0 holds stages 0-3 and process 1 stages 4-7, so each writes and reads only
# its own layers: damage in process 1's file is seen by process 1 alone.
ONE_BY_EIGHT = {
    **PIPELINED,
    "mesh.data": "1",
    "mesh.stage": "8",
    "model.num_layers": "8",
    "train.steps": "4",
    "checkpoint.every": "1",
    "checkpoint.keep": "0",
}


def tiny_config(**overrides):
    return config_lib.load("tiny", {**TINY, **overrides})


def run_of(config):
    """`config` resolved (`seqpipe.run.run_config`) for the first devices its mesh names (all
    of them where an axis is -1), `auto` picked without compiling."""
    from seqpipe.run import run_config

    m = config.mesh
    count = m.data * m.stage * m.context * m.tensor
    devices = jax.devices() if count < 1 else jax.devices()[:count]
    return run_config.resolve(config, devices)


def tiny_args(**overrides) -> list[str]:
    return ["--config", "tiny"] + [f"--config.{k}={v}" for k, v in {**TINY, **overrides}.items()]


def subprocess_env(devices: int = 8) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    count = "--xla_force_host_platform_device_count"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(count)]
    env["XLA_FLAGS"] = " ".join([*flags, f"{count}={devices}"])
    env["JAX_COMPILATION_CACHE_DIR"] = str(COMPILE_CACHE)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


FIELDS = {
    "step",
    "loss",
    "learning_rate",
    "grad_norm",
    "tokens_per_s",
    "step_time_s",
    "flops_per_token",
    "flops_per_s",
    "bubble",
    "bubble_head",
}


def read_event_protos(path: Path) -> list:
    """The Event protos of a TensorBoard event file (TFRecord framing)."""
    from tensorboardX.proto import event_pb2

    events, data, i = [], path.read_bytes(), 0
    while i < len(data):
        (length,) = struct.unpack("<Q", data[i : i + 8])
        events.append(event_pb2.Event.FromString(data[i + 12 : i + 12 + length]))
        i += 12 + length + 4
    return events


def read_events(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars of a TensorBoard event file: tag -> [(step, value)]."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for event in read_event_protos(path):
        for v in event.summary.value:
            scalars.setdefault(v.tag, []).append((event.step, v.simple_value))
    return scalars


def run_python(*argv: str, timeout: int = 300, env: dict | None = None, cwd=REPO):
    """`python *argv` in a subprocess, in the repository, with the tests' environment
    (`subprocess_env`) unless `env` is given; output captured as text."""
    return subprocess.run(
        [sys.executable, *argv],
        cwd=cwd,
        env=subprocess_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_train(
    workdir, *extra: str, timeout: int = 300, env: dict | None = None, **overrides
) -> subprocess.CompletedProcess:
    """train.py in a subprocess on the tiny model with `overrides` and the flags `extra`,
    as a user runs it."""
    return run_python(
        "train.py",
        "--workdir",
        str(workdir),
        *tiny_args(**overrides),
        *extra,
        timeout=timeout,
        env=env,
    )


# Linux refuses a process more memory maps than vm.max_map_count (65,530 by default), and
# XLA:CPU maps each executable's code pages: workers segfaulted inside XLA two-thirds through
# a full run (2026-12-07). The cause, measured (2026-12-08): jax keeps the executables of a
# long-lived function jitted with a static config (`jit(reference.loss_and_grads,
# static_argnums=2)`, one per config, 3 maps each) until `jax.clear_caches`, while a
# closure's go with it; `tools.flops` keeps its units until `flops.release`. The oracles now
# jit closures; what other tests keep is dropped when a worker passes 20,000 maps.
MAPS_BEFORE_RELEASE = 20_000


def release_executables_if_crowded() -> None:
    """Drop every cached executable (jax's and `tools.flops`'s) where this process holds
    many memory maps."""
    try:
        with open("/proc/self/maps") as maps:
            count = sum(1 for _ in maps)
    except OSError:  # not Linux
        return
    if count > MAPS_BEFORE_RELEASE:
        flops.release()


def wait_all(procs, timeout: int = 300) -> list[subprocess.CompletedProcess]:
    """Each of `procs` (text pipes) waited for, every one killed on a hang."""
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [
        subprocess.CompletedProcess(p.args, p.returncode, out, err)
        for p, (out, err) in zip(procs, outs, strict=True)
    ]


def logged_losses(workdir) -> dict[int, float]:
    """step -> loss, as the run logged them in its workdir's metrics.jsonl."""
    lines = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def fill_disk(disk, leave: int) -> None:
    """Fill the file system up, then give back `leave` bytes."""
    filler = disk / "filler"
    # Unbuffered: a buffered file keeps the bytes a short write left over and raises again
    # when closed, whenever the free space is not a multiple of the chunk.
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
    os.truncate(filler, os.path.getsize(filler) - leave)
