"""The search space: every pipelined setting of a model on a slice, as `Candidate`s.

Pure Python: a candidate is a handful of config keys, and `candidates` enumerates the
ones the trainer would accept, without building a table or importing jax.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from seqpipe.pipeline import remat

SEGMENTS = (2, 4, 8, 16, 32)  # Seq1F1B's segment counts tried (K = 1 is the 1F1B family)
VIRTUAL = (2, 4)  # chunks per stage for the interleaved schedules
SCHEDULES = ("1f1b", "seq1f1b", "interleaved_1f1b", "seq1f1b_interleaved", "zb_h1", "seq_zb_h1")
DEPTHS = ("full", "minimal")
MICROBATCH_FACTORS = (1, 2, 4)  # M = S x these (a 1F1B pipeline fills at M >= S)
BLOCK = 128  # segment lengths a multiple of this: the attention kernels' block
TENSOR = (1, 2, 4, 8)
CONTEXT = (1, 2, 4, 8)  # devices a segment's positions are split over (`parallel.context`)


class PlanError(ValueError):
    """Bad input for the planner; the message is one line."""


@dataclasses.dataclass(frozen=True, order=True)
class Candidate:
    """One setting: the mesh and the pipeline keys the trainer reads."""

    data: int
    stage: int
    tensor: int
    schedule: str
    microbatches: int
    segments: int
    virtual: int
    inflight: str
    remat: str
    partition: str = "uniform"
    layers_per_stage: str = "even"
    context: int = 1

    @property
    def devices(self) -> int:
        return self.data * self.stage * self.context * self.tensor

    def overrides(self) -> dict[str, object]:
        """The config keys that make this candidate (`--config.KEY=VALUE`)."""
        return {
            "mesh.data": self.data,
            "mesh.stage": self.stage,
            "mesh.context": self.context,
            "mesh.tensor": self.tensor,
            "pipeline.schedule": self.schedule,
            "pipeline.microbatches": self.microbatches,
            "pipeline.segments": self.segments,
            "pipeline.virtual_stages": self.virtual,
            "pipeline.inflight": self.inflight,
            "pipeline.remat": self.remat,
            "pipeline.partition": self.partition,
            "pipeline.layers_per_stage": self.layers_per_stage,
        }

    @property
    def label(self) -> str:
        """Short: mesh DxSxT, C (context > 1), schedule, M, K, V, depth, remat (and the
        non-default splits)."""
        parts = [f"{self.data}x{self.stage}x{self.tensor}"]
        parts += [f"C={self.context}"] * (self.context > 1)
        parts += [self.schedule, f"M={self.microbatches}"]
        parts += [f"K={self.segments}"] * (self.segments > 1)
        parts += [f"V={self.virtual}"] * (self.virtual > 1)
        parts += [self.inflight, self.remat]
        parts += [f"part={self.partition}"] * (self.partition != "uniform")
        parts += [f"layers={self.layers_per_stage}"] * (self.layers_per_stage != "even")
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Problem:
    """What is planned: the model's shape, the devices, the sequence and the batch."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    devices: int
    seq_len: int
    global_batch: int
    devices_per_host: int = 8  # tensor and context parallelism stay in a host's fast links
    partition_multiple: int = 1
    num_experts: int = 0  # a mixture's experts split over the data replicas


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(p: Problem) -> list[tuple[int, int, int, int]]:
    """(data, stage, context, tensor), in the mesh's order: tensor divides the heads;
    tensor and context together stay in a host (a tensor group's collectives run at every
    matmul, a context group's K/V gathers at every layer); two or more stages dividing
    the layers; data divides the global batch (and a mixture's experts, split over it)."""
    out = []
    kv = p.num_kv_heads or p.num_heads
    for t, c in itertools.product(TENSOR, CONTEXT):
        if p.devices % (t * c) or p.num_heads % t or kv % t or t * c > p.devices_per_host:
            continue
        for s in divisors(p.devices // (t * c)):
            d = p.devices // (t * c * s)
            experts_split = not p.num_experts or p.num_experts % d == 0
            if s >= 2 and p.num_layers % s == 0 and p.global_batch % d == 0 and experts_split:
                out.append((d, s, c, t))
    return out


def segment_unit(p: Problem, tensor: int, context: int = 1) -> int:
    """What every segment length is a multiple of: the block, the tensor devices and
    `pipeline.partition_multiple`; with C > 1 context devices, each of its 2C pieces
    a multiple of the block (`run.config`'s `segment_multiple`, with the block)."""
    multiple = math.lcm(BLOCK, p.partition_multiple)
    if context == 1:
        return math.lcm(multiple, tensor)
    return context * math.lcm(2 * multiple, tensor)


def segment_counts(p: Problem, tensor: int, context: int = 1) -> list[int]:
    """K > 1 that split the sequence into equal segments of a multiple of `segment_unit`."""
    unit = segment_unit(p, tensor, context)
    return [k for k in SEGMENTS if p.seq_len % (k * unit) == 0]


def schedule_shapes(
    p: Problem, stage: int, tensor: int, context: int = 1
) -> list[tuple[str, int, int]]:
    """(schedule, K, V) for a stage count (and context devices: the 1F1B family's one
    segment, the sequence, splits over them only if it is a multiple of the unit)."""
    ks = segment_counts(p, tensor, context)
    whole = context == 1 or p.seq_len % segment_unit(p, tensor, context) == 0
    out = []
    for name in SCHEDULES:
        seq = name.startswith("seq")
        for k in ks if seq else [1] * whole:
            for v in VIRTUAL if "interleaved" in name else [1]:
                if p.num_layers % (stage * v) == 0:
                    out.append((name, k, v))
    return out


def microbatch_counts(p: Problem, data: int, stage: int, virtual: int) -> list[int]:
    rows = p.global_batch // data
    ms = [stage * f for f in MICROBATCH_FACTORS if rows % (stage * f) == 0]
    if virtual == 1 and not ms:  # fewer rows than stages: a short pipeline is all there is
        ms = [m for m in divisors(rows) if m < stage][-1:]
    return ms


def candidates(p: Problem, remats=tuple(remat.POLICIES)) -> list[Candidate]:
    """Every candidate of the space (uniform segments, even layers), before any pruning.
    The partition and the layer split are refined for the best few (`refinements`)."""
    out = []
    for d, s, c, t in meshes(p):
        for name, k, v in schedule_shapes(p, s, t, c):
            for m, depth, rm in itertools.product(microbatch_counts(p, d, s, v), DEPTHS, remats):
                out.append(Candidate(d, s, t, name, m, k, v, depth, rm, context=c))
    return out


def refinements(c: Candidate) -> list[Candidate]:
    """The same candidate with equal-FLOP segments and a FLOP-balanced layer split (the
    head's work moved off the last stage) where they apply."""
    parts = ["uniform", "flops"] if c.segments > 1 else ["uniform"]
    splits = ["even", "flops"] if c.virtual == 1 else ["even"]
    return [
        dataclasses.replace(c, partition=pa, layers_per_stage=sp)
        for pa in parts
        for sp in splits
        if (pa, sp) != ("uniform", "even")
    ]


def check(p: Problem) -> None:
    """PlanError (one line) if nothing of the space applies to the problem."""
    if not meshes(p):
        raise PlanError(
            f"no mesh of {p.devices} devices fits: the stages (2 or more) must divide "
            f"model.num_layers={p.num_layers} and the data replicas --global-batch "
            f"{p.global_batch}; change --global-batch or the topology"
        )
    if not any(segment_counts(p, t, c) for _, _, c, t in meshes(p)):
        unit = math.lcm(BLOCK, p.partition_multiple)
        raise PlanError(
            f"--seq-len {p.seq_len}: no segment count in {', '.join(map(str, SEGMENTS))} "
            f"divides it into equal segments of a multiple of {unit} tokens; use a multiple "
            f"of {2 * unit}"
        )
