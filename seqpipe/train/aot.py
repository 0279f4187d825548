"""Ahead-of-time compilation: the step compiled for a target's devices without allocating
anything, and what it needs there (memory, collectives, FLOPs); `auto` chosen by it."""

import dataclasses
import math
import time

import jax
from ml_collections import ConfigDict

from seqpipe.models import model
from seqpipe.parallel import sharding
from seqpipe.run import run_config
from seqpipe.run.run_config import RunConfig
from seqpipe.targets import hlo
from seqpipe.train import optim
from seqpipe.train.evaluation import make_eval_fn
from seqpipe.train.report import bubble_fractions
from seqpipe.train.step import State, abstract_batch, abstract_state, make_grad_fn, make_train_step


def resolve(
    config: ConfigDict, devices: list | None = None, budget: int | None = None
) -> RunConfig:
    """`run_config.resolve` for `devices` (default: this process's), choosing `auto` by
    compiling the candidates' steps (`compile_only`) where a device budget is known."""
    devices = jax.devices() if devices is None else devices
    return run_config.resolve(config, devices, budget, compile_only)


def compile_config(config: ConfigDict, devices: list, with_evaluation: bool = True) -> dict:
    """`compile_only` of `config` resolved for `devices` (the planner compiles its candidates
    by this)."""
    return compile_only(resolve(config, devices), with_evaluation)


def compile_only(run: RunConfig, with_evaluation: bool = True) -> dict:
    """Compile the run's training step for its target's devices without allocating
    parameters; the report (`_compile`), with how `auto` chose where it did (the chosen
    step's report: choosing compiled it) and the run's line (`RunConfig.line`)."""
    report = {**(run.report or _compile(run, with_evaluation)), "run": run.line()}
    if run.attention_choice is not None:
        choice = run.attention_choice
        report = {**report, "attention_auto": {**dataclasses.asdict(choice), "line": choice.line()}}
    if run.remat_choice is not None:
        report = {**report, "remat_auto": dataclasses.asdict(run.remat_choice)}
    return report


def _compile(run: RunConfig, with_evaluation: bool) -> dict:
    """Per-device memory from XLA's `memory_analysis()` (of the step, and of the
    evaluation beside the train state), the collectives in each compiled program, and the
    model's analytic FLOPs per step (XLA's `cost_analysis` counts a loop body once,
    whatever its trip count). Without `with_evaluation` the evaluation is not compiled (its
    memory is reported as none: the planner's confirmations, where the step's peak is the
    larger)."""
    t = run.train
    mesh = sharding.mesh_of(run.config, list(run.target.devices))
    tx = optim.make_optimizer(t)
    state = abstract_state(run, mesh, tx)
    batch = abstract_batch(run, mesh)
    step_fn = make_train_step(
        make_grad_fn(run, mesh), tx, optim.lr_schedule(t), mesh, run.shard_optimizer
    )
    start = time.perf_counter()
    compiled = step_fn.lower(state, batch).compile()
    seconds = time.perf_counter() - start
    memory = _memory(compiled)
    # The evaluation runs while the whole train state (the step's arguments) stays on the
    # device; its own arguments (parameters, a batch) are among them.
    eval_compiled = None
    evaluation = dict.fromkeys(memory, 0)
    if with_evaluation:
        eval_compiled = make_eval_fn(run, mesh).lower(state["params"], batch).compile()
        evaluation = _memory(eval_compiled)
    evaluation["total"] = memory["arguments"] + evaluation["outputs"] + evaluation["temporaries"]
    peak = max(memory["total"], evaluation["total"])
    return {
        **_describe(run, state, mesh),
        **bubble_fractions(run),
        "memory_per_device_bytes": memory,
        "eval_memory_per_device_bytes": evaluation,
        "peak_memory_per_device_bytes": peak,  # the larger of the two totals
        "memory_per_device_gib": round(peak / 2**30, 3),
        "collectives": hlo.count_collectives(compiled.as_text()),
        "eval_collectives": hlo.count_collectives(eval_compiled.as_text()) if eval_compiled else {},
        **_flops(run),
        "compile_s": round(seconds, 1),
    }


def _describe(run: RunConfig, state: State, mesh: jax.sharding.Mesh) -> dict:
    """The report's account of the run: its mesh, state, schedule and model."""
    split = sharding.split_table(state["params"], run.mesh.data, run.mesh.tensor)
    p = run.config.pipeline
    return {
        "mesh": run.mesh.sizes(),
        "shard_optimizer": run.shard_optimizer,
        # From the shardings: each part of the train state (the step's arguments) per device.
        "state_bytes_per_device": {k: _bytes_per_device(v) for k, v in state.items()},
        # Leaves whose moments stay whole on every replica: no dimension divides mesh.data.
        "optimizer_kept_whole": [name for name, _, dim in split if dim is None]
        if run.shard_optimizer
        else [],
        "device_kind": mesh.devices.flat[0].device_kind,
        "schedule": p.schedule,
        "remat": run.remat,
        "microbatches": p.microbatches,
        "segments": p.segments,
        "attention": run.model.attention,
        "params": model.num_params(
            jax.eval_shape(lambda: model.init_params(run.model, jax.random.key(0)))
        ),
        "layers_per_stage": list(run.placement.layers_per_chunk),
    }


def _flops(run: RunConfig) -> dict:
    t = run.train
    flops_per_token = model.flops_per_token(run.model, t.seq_len)
    return {
        "flops_per_token": flops_per_token,
        "flops_per_step": flops_per_token * t.global_batch_size * t.seq_len,
    }


def _bytes_per_device(tree) -> int:
    """Bytes of `tree`'s shape structs on one device, from their shardings."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )


def _memory(compiled) -> dict[str, int]:
    """XLA's per-device memory of a compiled program; `total` counts donated (aliased)
    arguments once."""
    mem = compiled.memory_analysis()
    out = {
        "arguments": mem.argument_size_in_bytes,
        "outputs": mem.output_size_in_bytes,
        "temporaries": mem.temp_size_in_bytes,
        "aliased": mem.alias_size_in_bytes,
        "generated_code": mem.generated_code_size_in_bytes,
    }
    out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
    return out
