"""Everything static about a pipelined step: the model, the schedule table, the segments."""

import dataclasses

import numpy as np

from seqpipe import schedule
from seqpipe.errors import ConfigError
from seqpipe.kernels import attention
from seqpipe.models.model import GPTConfig
from seqpipe.parallel import context, layout
from seqpipe.pipeline.remat import POLICIES, Policy
from seqpipe.schedule import partition


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    cfg: GPTConfig
    schedule: schedule.Schedule
    program: schedule.Program
    lengths: tuple[int, ...]  # segment lengths, summing to the sequence length
    remat: str = (
        "full"  # a key of `seqpipe.pipeline.remat.POLICIES`: what a forward keeps for its backward
    )
    # Layers of each global chunk (chunk c * stages + r is stage r's c-th); () = even.
    layers_per_chunk: tuple[int, ...] = ()
    # Packed rows (`seqpipe.models.document_mask`): the attention masks by the rows' document ids
    # (`documents`), RoPE reads their positions (`positions`). `packed_as` sets them
    # from a batch.
    documents: bool = False
    positions: bool = False
    # Context-parallel devices each segment's positions are split over
    # (`seqpipe.parallel.context`): `lengths` and everything measured by them are one
    # device's share, L_k / context.
    context: int = 1

    def __post_init__(self):
        if not self.layers_per_chunk:
            chunks = self.stages * self.virtual
            even = (self.cfg.num_layers // chunks,) * chunks
            object.__setattr__(self, "layers_per_chunk", even)

    def packed_as(self, batch) -> "PipelineSpec":
        """This spec for `batch` (a dict; an array of tokens is unpacked): the document
        mask where the rows carry ids and `model.document_mask` is on, RoPE at the rows'
        positions where they carry them."""
        has = batch.keys() if isinstance(batch, dict) else ()
        documents = "documents" in has and self.cfg.document_mask
        return dataclasses.replace(self, documents=documents, positions="positions" in has)

    @property
    def packed(self) -> bool:
        """Whether units read a `document_mask.Packing` (document ids or positions)."""
        return self.documents or self.positions

    @property
    def forward_only(self) -> bool:
        """An evaluation's table: forwards and the loss, nothing kept for a backward."""
        return self.schedule.forward_only

    @property
    def policy(self) -> Policy:
        if self.remat not in POLICIES:  # `auto`: train.py compiles to choose, tools don't
            raise ConfigError(
                f"pipeline.remat={self.remat} is chosen by train.py (a run or --compile_only); "
                f"name one of {', '.join(POLICIES)} here"
            )
        return POLICIES[self.remat]

    @property
    def stages(self) -> int:
        return self.schedule.stages

    @property
    def virtual(self) -> int:
        return self.schedule.virtual

    @property
    def segments(self) -> int:
        return len(self.lengths)

    @property
    def chunk_layers(self) -> int:
        """Layers in one model chunk as a stage holds it (a stage holds `virtual` of them):
        the deepest chunk's; a shallower chunk's block is padded to it and skips the rest."""
        return max(self.layers_per_chunk)

    @property
    def placement(self) -> "layout.Placement":
        """Where the layers live (`seqpipe.parallel.layout`)."""
        return layout.Placement(self.stages, self.virtual, self.layers_per_chunk)

    @property
    def uneven(self) -> bool:
        """Whether chunks differ in depth (then a unit runs its chunk's own layer count)."""
        return len(set(self.layers_per_chunk)) > 1

    @property
    def seg_max(self) -> int:
        """The longest segment: messages and stashed inputs are padded to it."""
        return max(self.lengths)

    @property
    def tensor(self) -> int:
        """Tensor-parallel devices per stage (`seqpipe.parallel.tensor`): each holds 1/tensor of a
        segment's positions between the matmuls."""
        return self.cfg.tensor

    @property
    def msg_len(self) -> int:
        """Positions of a message (and a stashed input) on one device: the longest
        segment's share of this device."""
        return self.seg_max // self.tensor

    def local_length(self, seg: int) -> int:
        """Positions of segment `seg` that one tensor device holds between the matmuls."""
        return self.lengths[seg] // self.tensor

    @property
    def sequence_lengths(self) -> tuple[int, ...]:
        """The segments' lengths in the sequence (`lengths` are one context device's)."""
        return tuple(length * self.context for length in self.lengths)

    def context_split(self, seg: int):
        """How segment `seg`'s positions lie over the context devices (a
        `seqpipe.parallel.context.Split`), or None without context parallelism."""
        if self.context == 1:
            return None
        return context.Split(self.context, self.lengths[: seg + 1])

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.cumsum((0,) + self.lengths[:-1]))

    @property
    def kv_len(self) -> int:
        """Positions the KV cache keeps: only segments before the last are read back as a
        prefix, and each is written as a window of the longest segment's length."""
        return max((o + self.seg_max for o in self.offsets[:-1]), default=0)


def attention_on(name: str, platform: str | None = None) -> str:
    """The implementation `name` runs as on `platform`: the one place `auto` becomes one.
    `seqpipe.run.run_config` names the platform of the devices a step is compiled for; a
    tool's spec (`make_spec` of a config not resolved) runs on JAX's default backend."""
    return attention.resolve(name, platform)


def make_spec(config, seq_len: int | None = None) -> PipelineSpec:
    """Build the schedule table and segment partition from a config (its attention, if
    `auto`, for JAX's default backend: `seqpipe.run.run_config` resolves it first)."""
    model = GPTConfig.from_config(config.model)
    model = dataclasses.replace(model, attention=attention_on(model.attention))
    cfg = dataclasses.replace(model, tensor=config.mesh.get("tensor", 1))
    p = config.pipeline
    lengths = partition.segment_lengths(
        seq_len or config.train.seq_len,
        p.segments,
        p.partition,
        multiple=partition.segment_multiple(config),
        **partition.model_dims(cfg),
    )
    if cfg.num_experts:  # router losses per segment, experts over the data replicas
        experts = max(config.mesh.data, 1)
        cfg = dataclasses.replace(cfg, router_segments=tuple(lengths), expert_parallel=experts)
    # The train state's placement, whatever `seq_len` says: the step must read the layers
    # where the state holds them.
    layers = layout.of_config(config).layers_per_chunk
    table = schedule.build(
        p.schedule,
        config.mesh.stage,
        p.microbatches,
        p.segments,
        p.virtual_stages,
        p.inflight,
    )
    # Each context device runs its share of every segment (`seqpipe.parallel.context`).
    size = config.mesh.get("context", 1)
    local = tuple(length // size for length in lengths)
    program = schedule.lower(table)
    return PipelineSpec(cfg, table, program, local, p.remat, layers, context=size)


def forward_only(spec: PipelineSpec) -> PipelineSpec:
    """The same stages, segments and forward order, without backwards (evaluation)."""
    table = schedule.forward_only(spec.schedule)
    return dataclasses.replace(spec, schedule=table, program=schedule.lower(table))
