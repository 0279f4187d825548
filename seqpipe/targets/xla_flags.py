"""XLA flags the trainer sets for itself on GPUs, never overriding the user's XLA_FLAGS.

XLA reads XLA_FLAGS once, when the backend starts, so `apply` runs before anything asks
JAX for a device. Only on a GPU backend: a flag the user already names keeps the user's
value, and SEQPIPE_XLA_GPU_FLAGS=0 turns all of them off (to measure without them).
"""

import importlib.util
import os

# What NVIDIA's JAX containers set for training (JAX-Toolbox): the scheduler that overlaps
# collectives and copies with compute. Flags are jaxlib-version dependent: an unknown one
# stops XLA at start-up, so add one only after a device run shows that it helps.
GPU_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true",)
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda12")


def gpu_expected(env: dict) -> bool:
    """Whether JAX will start a GPU backend: JAX_PLATFORMS names one, or (unset) a CUDA
    plugin is installed."""
    platforms = env.get("JAX_PLATFORMS", "")
    if platforms:
        return any(p.strip() in ("cuda", "gpu", "rocm") for p in platforms.split(","))
    for name in CUDA_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def merged(user_flags: str, flags=GPU_FLAGS) -> str:
    """`user_flags` plus each of `flags` whose name the user has not set."""
    named = {f.split("=", 1)[0] for f in user_flags.split()}
    extra = [f for f in flags if f.split("=", 1)[0] not in named]
    return " ".join([user_flags.strip(), *extra]).strip()


def apply(env=os.environ, gpu: bool | None = None) -> list[str]:
    """Add GPU_FLAGS to env["XLA_FLAGS"] when the backend will be a GPU; returns the flags
    added."""
    if env.get("SEQPIPE_XLA_GPU_FLAGS", "1") == "0":
        return []
    if not (gpu_expected(env) if gpu is None else gpu):
        return []
    before = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = merged(before)
    return env["XLA_FLAGS"].split()[len(before.split()) :]
