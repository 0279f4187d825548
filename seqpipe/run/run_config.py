"""The run configuration: the user's config resolved once, for the devices it runs on.

`resolve` sizes the `-1` mesh axes, picks `model.attention=auto` and `pipeline.remat=auto`
for the target (the devices present, or a `--topology` slice's or GPU system's, with its
memory budget) and returns a frozen `RunConfig`. That is what the trainer,
`train.compile_only` and the tools that build a step receive: they read its typed fields
(the model, the pipeline spec, the remat policy, the mesh), and no `auto` is left for the
trace to decide. `RunConfig.line` says in one line what was chosen.

Choosing `auto` under a budget compiles the candidates' steps: `resolve` takes the function
that compiles one (`train.compile_only`), so that this module stays below the trainer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ml_collections import ConfigDict

from seqpipe.kernels.attention import KERNEL_PLATFORMS
from seqpipe.models.model import GPTConfig
from seqpipe.parallel import layout
from seqpipe.pipeline import spec as spec_lib
from seqpipe.run import attention_auto, remat_auto
from seqpipe.run import config as config_lib


@dataclasses.dataclass(frozen=True)
class Target:
    """The devices a step is compiled for, and the bytes a device may use (None: unknown,
    as on the CPU, whose memory is the host's)."""

    devices: tuple
    budget: int | None = None

    @property
    def platform(self) -> str:
        return self.devices[0].platform


@dataclasses.dataclass(frozen=True)
class Mesh:
    """The mesh axes' sizes, none of them -1."""

    data: int
    stage: int
    tensor: int
    context: int = 1

    def sizes(self) -> dict[str, int]:
        """The axes in mesh order (data, stage, context, tensor); context only where it
        splits (a run without context parallelism reads as before it existed)."""
        kept = ("data", "stage") + (("context",) if self.context > 1 else ()) + ("tensor",)
        return {axis: getattr(self, axis) for axis in kept}


@dataclasses.dataclass(frozen=True, eq=False)
class RunConfig:
    """A config resolved for its target: what the runtime reads."""

    # The user's config with its mesh sized, `auto` as given (checkpoints record it so): the
    # data, train and checkpoint sections are read from it.
    config: ConfigDict
    model: GPTConfig  # the whole model (tensor 1), its attention an implementation
    spec: spec_lib.PipelineSpec | None  # the pipelined step; None without a pipeline
    remat: str  # a key of `seqpipe.pipeline.remat.POLICIES`
    mesh: Mesh
    placement: layout.Placement  # where the train state's layers live
    shard_optimizer: bool  # `config.shards_optimizer`
    target: Target
    remat_choice: remat_auto.Choice | None = None  # how `pipeline.remat=auto` chose
    attention_choice: attention_auto.Choice | None = None  # ... `model.attention=auto`
    # The step's `train.compile_only` report where choosing `auto` compiled it.
    report: dict | None = dataclasses.field(default=None, repr=False)

    @property
    def train(self) -> ConfigDict:
        return self.config.train

    @property
    def pipelined(self) -> bool:
        return self.spec is not None

    def line(self) -> str:
        """What runs, in one line: the attention, the remat policy (each `auto` saying
        what it picked, and why), the mesh and the schedule."""
        c, m = self.config, self.mesh
        if self.attention_choice is not None:
            attention = self.attention_choice.line()
        elif c.model.attention == "auto":
            attention = f"{self.model.attention} (auto on {self.target.platform})"
        else:
            attention = self.model.attention
        remat = self.remat_choice.line() if self.remat_choice is not None else self.remat
        mesh = ", ".join(f"{axis} {size}" for axis, size in m.sizes().items())
        return (
            f"attention: {attention}; pipeline.remat: {remat}; mesh: {mesh} "
            f"({len(self.target.devices)} {self.target.platform}); pipeline.schedule: "
            f"{c.pipeline.schedule}"
        )


# Compiles a run's step and returns its report (`train.compile_only`).
Measure = Callable[[RunConfig], dict]


def resolve(
    config: ConfigDict, devices, budget: int | None = None, measure: Measure | None = None
) -> RunConfig:
    """`config` resolved for `devices`: the -1 mesh axes sized (`config.resolve`, which
    validates it all), `model.attention` and `pipeline.remat` an implementation and a
    policy. `budget`: bytes a device may use (default `remat_auto.device_budget`). Where
    there is a budget and a `measure`, `auto` compiles its candidates with it and keeps
    the first that fits; else it picks without compiling (attention: the platform's own;
    remat: `full`). ConfigError for what cannot run there."""
    config = config_lib.resolve(config, len(devices))
    budget = remat_auto.device_budget(devices) if budget is None else budget
    target = Target(tuple(devices), budget)
    if config.pipeline.remat != "auto":
        return _with_attention(config, config.pipeline.remat, target, measure)
    if measure is None and budget is not None:
        raise config_lib.ConfigError(
            "pipeline.remat=auto is chosen by train.py (a run or --compile_only); name one "
            "of full, full_layer, layer, dots, none here"
        )
    runs = {}

    def peak_of(policy: str) -> int:
        runs[policy] = _measured(_with_attention(config, policy, target, measure), measure)
        return runs[policy].report["peak_memory_per_device_bytes"]

    choice = remat_auto.choose(peak_of, budget)
    run = runs.get(choice.policy) or _with_attention(config, choice.policy, target, measure)
    return dataclasses.replace(run, remat_choice=choice)


def _with_attention(config: ConfigDict, remat: str, target: Target, measure) -> RunConfig:
    """The run with `remat` and the attention resolved for the target: `auto` is the
    platform's own kernel, or, where that has a fallback and there is a budget to fit,
    the first of them whose compiled step fits (`seqpipe.run.attention_auto`)."""
    name = spec_lib.attention_on(config.model.attention, target.platform)
    check_attention(name, target.platform)
    names = attention_auto.candidates(name) if config.model.attention == "auto" else (name,)
    if len(names) == 1 or target.budget is None or measure is None:
        return build(config, remat, name, target)
    runs = {}

    def peak_of(candidate: str) -> int:
        runs[candidate] = _measured(build(config, remat, candidate, target), measure)
        return runs[candidate].report["peak_memory_per_device_bytes"]

    choice = attention_auto.choose(peak_of, names, target.budget)
    return dataclasses.replace(runs[choice.name], attention_choice=choice)


def _measured(run: RunConfig, measure: Measure) -> RunConfig:
    return run if run.report is not None else dataclasses.replace(run, report=measure(run))


def build(config: ConfigDict, remat: str, attention: str, target: Target) -> RunConfig:
    """The run of a config whose mesh is sized, with `remat` and `attention` as given."""
    resolved = attention_auto.with_attention(remat_auto.with_policy(config, remat), attention)
    spec = None if config.pipeline.schedule == "none" else spec_lib.make_spec(resolved)
    return RunConfig(
        config=config,
        model=GPTConfig.from_config(resolved.model),
        spec=spec,
        remat=remat,
        mesh=Mesh(
            **{axis: config.mesh.get(axis, 1) for axis in ("data", "stage", "tensor", "context")}
        ),
        placement=layout.of_config(config),
        shard_optimizer=config_lib.shards_optimizer(config),
        target=target,
    )


def check_attention(name: str, platform: str) -> None:
    """ConfigError for an attention the step cannot run: a Pallas kernel on another
    platform than its own."""
    if name in KERNEL_PLATFORMS and platform not in KERNEL_PLATFORMS[name]:
        kind = "a TPU" if name == "splash" else "an NVIDIA GPU"
        raise config_lib.ConfigError(
            f"model.attention={name} is {kind} kernel and this is {platform}; use auto or blockwise"
        )
