"""NVIDIA GPU systems (h100, h200-8, h200-16) as compile-only CUDA devices.

JAX's CUDA plugin compiles for a GPU it is told about, on a machine without one: the
devices are descriptions made from a target config (the GPU's properties XLA would read
from the driver), enough to build a mesh and ask XLA's GPU compiler for memory and for
the program it would run, Triton kernels lowered to PTX included. On one H200 the XLA
temporaries compiled this way came within 3.5% of those the device reported
(docs/compiling.md).

A name counts GPUs in hosts of eight (an HGX board): `h200` or `h200-1` is one GPU,
`h200-8` one host, `h200-16` two. The plugin (`jax-cuda13-plugin` and `jax-cuda13-pjrt`
of the installed jax's version, about 130 MB, no CUDA libraries needed) is looked for where
`make install` puts it, `<venv>/cuda-compiler` (outside site-packages, so that jax does not
look for a GPU at every start), then among the installed packages.
"""

import dataclasses
import os
import re
import sys

from seqpipe.errors import TopologyError
from seqpipe.targets import xla_flags

GPUS_PER_HOST = 8
# Where `make install` puts the plugin; SEQPIPE_CUDA_PLUGIN_DIR names another place.
PLUGIN_DIR = os.environ.get("SEQPIPE_CUDA_PLUGIN_DIR", os.path.join(sys.prefix, "cuda-compiler"))


@dataclasses.dataclass(frozen=True)
class Model:
    """What XLA's GPU compiler reads of a GPU, from XLA's own specs for it
    (xla/backends/gpu/target_config/specs)."""

    device_kind: str
    memory_bytes: int  # device memory, as the driver reports it
    memory_bandwidth: int  # bytes/s
    core_count: int = 132  # SMs
    clock_rate_ghz: float = 1.98
    l2_cache_size: int = 50 * 2**20


MODELS = {
    "h100": Model("NVIDIA H100 80GB HBM3", 84_942_979_072, 3_352_320_000_000),
    "h200": Model("NVIDIA H200", 151_397_597_184, 4_800_000_000_000),
}

# Hopper (compute capability 9.0): the same SM, shared memory and register limits on both.
_TARGET_CONFIG = """gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  core_count: {core_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {memory_bandwidth}
  l2_cache_size: {l2_cache_size}
  clock_rate_ghz: {clock_rate_ghz}
  device_memory_size: {memory_bytes}
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
runtime_version {{ major: 13 minor: 0 }}
device_description_str: "{device_kind}"
"""


@dataclasses.dataclass(frozen=True)
class System:
    name: str  # as the user gave it, e.g. "h200-8"
    model: str  # a key of MODELS
    chips: int  # GPUs
    unit = "GPU"  # what the --compile_only summary counts memory per

    @property
    def spec(self) -> Model:
        return MODELS[self.model]

    @property
    def hosts(self) -> int:
        return max(1, self.chips // GPUS_PER_HOST)

    @property
    def topology_name(self) -> str:
        """The plugin's topology: slices x hosts x GPUs per host."""
        return f"1x{self.hosts}x{self.chips // self.hosts}"

    def target_config(self) -> str:
        return _TARGET_CONFIG.format(**dataclasses.asdict(self.spec))

    def headline(self) -> str:
        hosts = "1 host" if self.hosts == 1 else f"{self.hosts} hosts"
        return (
            f"{self.name}: {self.chips} GPU{'s' if self.chips > 1 else ''} "
            f"({self.spec.device_kind}, {hosts} of {self.chips // self.hosts})"
        )

    def prepare_env(self) -> None:
        """Before jax is imported: jax stays on the CPU, the plugin registers without a
        driver to check its CUDA versions against, its directory is importable, and the
        XLA flags the trainer sets on GPUs are set, so the program compiled is the one a
        run on these GPUs would run."""
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
        if os.path.isdir(PLUGIN_DIR) and PLUGIN_DIR not in sys.path:
            sys.path.insert(0, PLUGIN_DIR)
        xla_flags.apply(gpu=True)

    def devices(self) -> list:
        """The system's GPUs as compile-only JAX devices (needs the CUDA plugin)."""
        import jax
        from jax.experimental import topologies

        try:
            # The plugin's own options, not get_topology_desc's topology_name.
            desc = topologies.get_topology_desc(
                platform="cuda", topology=self.topology_name, target_config=self.target_config()
            )
        except Exception as e:  # no plugin (jax says "not implemented for cuda"), or too old
            raise TopologyError(
                f"--topology {self.name}: cannot describe {self.topology_name} "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); install "
                f"JAX's CUDA plugin for jax {jax.__version__}: make install (or pip install "
                f"--no-deps --target {PLUGIN_DIR} jax-cuda13-plugin=={jax.__version__} "
                f"jax-cuda13-pjrt=={jax.__version__})"
            ) from None
        return list(desc.devices)

    def budget(self) -> int:
        """Bytes JAX's allocator will have of a GPU (`pipeline.remat=auto` fits it)."""
        return gpu_budget(self.spec.memory_bytes)

    def report(self, memory_total: int) -> dict:
        """The system's fields for the --compile_only JSON: what it is, and whether the
        step's memory per GPU fits the GPU's memory."""
        return {
            "slice": self.name,
            "chips": self.chips,
            "topology": self.topology_name,
            "hbm_per_chip_bytes": self.spec.memory_bytes,
            "hbm_fraction": round(memory_total / self.spec.memory_bytes, 4),
            "fits": memory_total <= self.spec.memory_bytes,
        }


# What JAX's GPU allocator takes of a GPU's memory unless told otherwise.
GPU_MEM_FRACTION = 0.75


def gpu_budget(memory_bytes: int) -> int:
    """What JAX's allocator will have of a GPU with `memory_bytes`."""
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEM_FRACTION))
    return int(fraction * memory_bytes)


def is_gpu_name(name: str) -> bool:
    return re.match(r"(h100|h200)\b", name.strip().lower()) is not None


def parse(name: str) -> System:
    """A system from its name; ValueError (one line: what is supported) if not."""
    match = re.fullmatch(r"(h100|h200)(?:-(\d+))?", name.strip().lower())
    if not match:
        raise ValueError(f"--topology {name!r}: GPU systems are h100-N or h200-N (N GPUs)")
    gpus = int(match[2] or 1)
    if not (gpus in (1, 2, 4) or (gpus > 0 and gpus % GPUS_PER_HOST == 0)):
        raise ValueError(
            f"--topology {name}: {match[1]}-N counts GPUs, {GPUS_PER_HOST} a host; "
            f"N is 1, 2, 4 or a multiple of {GPUS_PER_HOST}"
        )
    return System(name=name, model=match[1], chips=gpus)
