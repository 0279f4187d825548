"""What many test modules share: the repository, the tiny model's overrides, the
environment of a trainer subprocess, the one helper that runs `train.py` as a process,
TensorBoard event readers, the oracle's leaf-wise error, and the release of cached
executables before a process runs out of memory maps."""

import gc
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

from seqpipe.run import config as config_lib

REPO = Path(__file__).resolve().parent.parent
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
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
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


# The oracle tests' tolerances in float32: the loss relative, each gradient leaf's largest
# difference relative to its largest magnitude (observed about 1e-6). `seqpipe.verify`
# judges against the float32 noise instead (`tests/test_noise.py`).
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5


def max_relative_error(actual, expected) -> tuple[str, float]:
    """The worst leaf and its max |actual - expected| / max |expected| (comparisons the
    oracle tests use; `seqpipe.verify` judges against the float32 noise instead)."""
    worst = ("", 0.0)
    for (path, a), e in zip(
        jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True
    ):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        scale = max(float(np.max(np.abs(e))), np.finfo(np.float32).tiny)
        err = float(np.max(np.abs(a - e))) / scale
        if err > worst[1] or not np.isfinite(err):
            worst = (jax.tree_util.keystr(path), err)
    return worst


def float64_reference(params, batch, cfg):
    """`noise.float64_reference`, for conftest's helper process to run (it imports this
    module; the test process's `noise.float64_reference` sends its calls here)."""
    from seqpipe.models import noise

    try:
        return noise.float64_reference(params, batch, cfg)
    finally:
        release_executables_if_crowded()


# Linux refuses a process more memory maps than vm.max_map_count (65,530 by default), and
# XLA:CPU maps each executable's code. A test worker keeping every executable it compiled
# (jax's caches hold them) heads for that limit in a full run, a pipeline test adding 500
# to 1,300 maps, and workers segfaulted inside XLA two-thirds through (2026-12-07).
MAPS_BEFORE_RELEASE = 20_000


def release_executables_if_crowded() -> None:
    """Drop jax's cached executables where this process holds many memory maps."""
    try:
        with open("/proc/self/maps") as maps:
            count = sum(1 for _ in maps)
    except OSError:  # not Linux
        return
    if count > MAPS_BEFORE_RELEASE:
        jax.clear_caches()
        gc.collect()
