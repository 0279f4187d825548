"""Cloud TPU slice names (v5p-16, v4-8, v5litepod-16, v6e-8) as compile-only TPU devices;
`parse` hands GPU system names (h200-8) to `seqpipe.targets.gpu_topology`.

With libtpu installed, JAX compiles for a TPU topology on a machine without TPUs: the
devices are descriptions, enough to build a mesh and ask the TPU compiler for memory.

A name maps to chips and a shape as Cloud TPU creates the slice by default:

- v4-N and v5p-N count TensorCores, two a chip, joined into one device (`megacore`):
  N/2 chips on a 3D torus, from v4-8 / v5p-8 = 2x2x1 (4 chips, one host) up, doubling
  the last of the smallest sides: 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, ... Power-of-two
  sizes only (the other v5p shapes, such as 4x4x12, are left out), up to v4-4096
  (8x16x16) and v5p-8192 (16x16x16).
- v5litepod-N (also v5e-N) and v6e-N count chips, one TensorCore each: 1x1, 2x2, 2x4,
  4x4, 4x8, 8x8, 8x16, 16x16 (N = 1, 4, 8, ..., 256).

HBM per chip, from the Cloud TPU system architecture pages (which write GB): v4 32,
v5p 95, v5e 16, v6e 32; taken as GiB. The runtime keeps a little of it for itself.
"""

import dataclasses
import math
import os
import re

from seqpipe.errors import TopologyError
from seqpipe.targets import gpu_topology

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Generation:
    prefix: str  # in the topology name libtpu takes, e.g. "v5p" in "v5p:2x2x2"
    device_kind: str  # what the compile-only devices call themselves
    cores_per_chip: int  # how the slice name counts: TensorCores per chip
    chip_config: str
    dims: int  # 3: a 3D torus; 2: a 2D torus
    max_chips: int
    hbm_bytes: int


GENERATIONS = {
    "v4": Generation("v4", "TPU v4", 2, "megacore", 3, 2048, 32 * GiB),
    "v5p": Generation("v5p", "TPU v5", 2, "megacore", 3, 4096, 95 * GiB),
    "v5e": Generation("v5e", "TPU v5 lite", 1, "default", 2, 256, 16 * GiB),
    "v6e": Generation("v6e", "TPU v6 lite", 1, "default", 2, 256, 32 * GiB),
}
ALIASES = {"v5litepod": "v5e"}


@dataclasses.dataclass(frozen=True)
class Slice:
    name: str  # as the user gave it, e.g. "v5p-16"
    generation: str  # a key of GENERATIONS
    chips: int
    shape: tuple[int, ...]  # chips along each torus axis
    unit = "chip"  # what the --compile_only summary counts memory per

    @property
    def spec(self) -> Generation:
        return GENERATIONS[self.generation]

    @property
    def topology_name(self) -> str:
        return f"{self.spec.prefix}:{'x'.join(map(str, self.shape))}"

    def headline(self) -> str:
        return f"{self.name}: {self.chips} chips ({self.topology_name}, {self.spec.chip_config})"

    def prepare_env(self) -> None:
        prepare_env(self)

    def devices(self) -> list:
        return devices(self)

    def report(self, memory_total: int) -> dict:
        return report(self, memory_total)

    def budget(self) -> int:
        """Bytes a chip's program may use (`pipeline.remat=auto` fits it)."""
        return self.spec.hbm_bytes

    @property
    def chips_per_host_bounds(self) -> tuple[int, int, int]:
        # Hosts of 4 chips (2x2), as multi-host slices are built; 1- and 8-chip v5e/v6e
        # slices are one host of that size.
        if self.chips < 4:
            return (1, 1, 1)
        if self.spec.dims == 2 and self.chips == 8:
            return (2, 4, 1)
        return (2, 2, 1)


def _shape(chips: int, dims: int) -> tuple[int, ...]:
    """The default torus for a power-of-two chip count: from 2x2(x1), double the last of
    the smallest sides until the chips are there."""
    if chips == 1:
        return (1,) * dims
    shape = [2, 2] + [1] * (dims - 2)
    while math.prod(shape) < chips:
        smallest = min(shape)
        last = max(i for i, side in enumerate(shape) if side == smallest)
        shape[last] *= 2
    return tuple(shape)


def supported_sizes(generation: str) -> list[int]:
    """The N of every supported `generation-N` name."""
    spec = GENERATIONS[generation]
    first = 1 if spec.dims == 2 else 4
    chips = [first] + [2**k for k in range(2, 13) if first < 2**k <= spec.max_chips]
    return [c * spec.cores_per_chip for c in chips]


def parse(name: str):
    """A TPU slice from its Cloud TPU name, or a GPU system (`seqpipe.targets.gpu_topology`) from
    its; ValueError (one line: what is supported) if neither."""
    if gpu_topology.is_gpu_name(name):
        return gpu_topology.parse(name)
    names = "v4-N, v5p-N, v5litepod-N (or v5e-N), v6e-N, h100-N, h200-N"
    match = re.fullmatch(r"(v4|v5p|v5litepod|v5e|v6e)-(\d+)", name.strip().lower())
    if not match:
        raise ValueError(
            f"--topology {name!r} is not a TPU slice or GPU system name; use one of {names}"
        )
    generation = ALIASES.get(match[1], match[1])
    size = int(match[2])
    sizes = supported_sizes(generation)
    if size not in sizes:
        counts = (
            "TensorCores (2 a chip)" if GENERATIONS[generation].cores_per_chip == 2 else "chips"
        )
        raise ValueError(
            f"--topology {name}: {match[1]}-N counts {counts}; supported N: "
            f"{', '.join(map(str, sizes))}"
        )
    spec = GENERATIONS[generation]
    chips = size // spec.cores_per_chip
    return Slice(name=name, generation=generation, chips=chips, shape=_shape(chips, spec.dims))


def prepare_env(s: Slice) -> None:
    """Before jax is imported. Keep jax on the CPU: compiling for the slice needs no local
    accelerator. Let libtpu load beside other processes that hold it (parallel tests, other
    users): compile-only devices never touch a chip. And tell libtpu what it would ask the
    Cloud metadata server for, so it prints no warnings about the missing TPU environment.
    Values already set are kept."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", s.name)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def devices(s: Slice) -> list:
    """The slice's chips as compile-only JAX devices (needs libtpu)."""
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(
            platform="tpu",
            topology_name=s.topology_name,
            chip_config_name=s.spec.chip_config,
            chips_per_host_bounds=s.chips_per_host_bounds,
            num_slices=1,
        )
    except Exception as e:  # no libtpu, or one that does not know this topology
        raise TopologyError(
            f"--topology {s.name}: cannot describe {s.topology_name} ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); install libtpu for this jax "
            "(pip install 'jax[tpu]==<jax version>')"
        ) from None
    return list(desc.devices)


def report(s: Slice, memory_total: int) -> dict:
    """The slice's fields for the --compile_only JSON: what it is, and whether the step's
    memory per chip fits the chip's HBM."""
    return {
        "slice": s.name,
        "chips": s.chips,
        "topology": s.topology_name,
        "chip_config": s.spec.chip_config,
        "hbm_per_chip_bytes": s.spec.hbm_bytes,
        "hbm_fraction": round(memory_total / s.spec.hbm_bytes, 4),
        "fits": memory_total <= s.spec.hbm_bytes,
    }


_OVER_HBM = re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM")


def refused_need(message: str) -> int | None:
    """The temporaries' bytes a chip would need, from the TPU compiler's refusal of a step
    over its HBM (libtpu raises instead of reporting the peak), or None for another error.
    A lower bound on the step's peak: the arguments come on top."""
    found = _OVER_HBM.search(message)
    if found is None:
        return None
    return int(float(found.group(1)) * 2 ** (10 * "KMGT".index(found.group(2)) + 10))
