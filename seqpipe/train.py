"""Train state, the jitted training step and the training loop."""

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from ml_collections import ConfigDict

from seqpipe import config as config_lib
from seqpipe import data, model, optim, pipeline, reference, sharding
from seqpipe.metrics import MetricsLog, Throughput
from seqpipe.model import GPTConfig

State = dict[str, Any]
GradFn = Callable[[model.Params, jax.Array], tuple[jax.Array, model.Params]]


class TrainingError(RuntimeError):
    """Training cannot go on (for example a non-finite loss); the message says why."""


def make_grad_fn(config: ConfigDict, mesh: jax.sharding.Mesh) -> GradFn:
    """Loss and gradients of a [B, L+1] batch under the configured schedule."""
    cfg = GPTConfig.from_config(config.model)
    if config.pipeline.schedule == "none":
        return lambda params, tokens: reference.loss_and_grads(
            params, tokens, cfg, config.pipeline.remat
        )
    spec = pipeline.make_spec(config)
    return lambda params, tokens: pipeline.loss_and_grads(params, tokens, spec, mesh)


def init_state(
    config: ConfigDict, mesh: jax.sharding.Mesh, tx: optax.GradientTransformation
) -> State:
    """Parameters and optimizer state, created directly in their shardings."""
    cfg = GPTConfig.from_config(config.model)

    def init(key):
        params = model.init_params(cfg, key)
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}

    shapes = jax.eval_shape(init, jax.random.key(config.train.seed))
    shardings = sharding.state_shardings(shapes, mesh)
    return jax.jit(init, out_shardings=shardings)(jax.random.key(config.train.seed))


def make_train_step(grad_fn: GradFn, tx: optax.GradientTransformation, lr_fn) -> Callable:
    def train_step(state: State, tokens: jax.Array) -> tuple[State, dict]:
        loss, grads = grad_fn(state["params"], tokens)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        new_state = {
            "step": state["step"] + 1,
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
        }
        metrics = {
            "loss": loss,
            "grad_norm": optax.global_norm(grads),
            "learning_rate": lr_fn(state["step"]),
        }
        return new_state, metrics

    return jax.jit(train_step, donate_argnums=0)


def make_eval_fn(config: ConfigDict) -> Callable:
    cfg = GPTConfig.from_config(config.model)
    return jax.jit(lambda params, tokens: model.loss(params, tokens, cfg))


def run(config: ConfigDict, workdir: str) -> list[dict]:
    """Train for config.train.steps steps; returns the logged records."""
    t = config.train
    config_lib.validate(config, jax.device_count())
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.stage)
    train_tokens, eval_tokens = data.load_tokens(config, workdir)  # checks the data first
    prepare_workdir(workdir)
    batches = data.train_iterator(config, train_tokens)
    eval_set = (
        [data.to_global(b, mesh) for b in data.eval_batches(config, eval_tokens, t.eval_batches)]
        if t.eval_every
        else []
    )
    tx = optim.make_optimizer(t)
    state = init_state(config, mesh, tx)
    step_fn = make_train_step(make_grad_fn(config, mesh), tx, optim.lr_schedule(t))
    eval_fn = make_eval_fn(config)
    tokens_per_step = t.global_batch_size * t.seq_len
    log = MetricsLog(workdir, t.steps, enabled=jax.process_index() == 0)
    records, throughput, pending = [], Throughput(), None

    def report(step: int, metrics: dict) -> None:
        # Called one step late so the host never waits on the step it just dispatched.
        if step % t.log_every and step != t.steps:
            return
        record = {"step": step, **{k: float(v) for k, v in jax.device_get(metrics).items()}}
        if not math.isfinite(record["loss"]):
            raise TrainingError(f"loss is {record['loss']} at step {step}; lower the learning rate")
        record["tokens_per_s"], record["step_time_s"] = throughput.update(step, tokens_per_step)
        if eval_set and (step % t.eval_every == 0 or step == t.steps):
            losses = [eval_fn(state["params"], b) for b in eval_set]
            record["eval_loss"] = float(np.mean(jax.device_get(losses)))
        records.append(record)
        log.write(record)

    try:
        for step in range(1, t.steps + 1):
            batch = data.to_global(next(batches)["tokens"], mesh)
            state, metrics = step_fn(state, batch)
            if pending:
                report(*pending)
            pending = (step, metrics)
        report(*pending)
    finally:
        log.close()
    return records


def prepare_workdir(workdir: str) -> Path:
    path = Path(workdir)
    path.mkdir(parents=True, exist_ok=True)
    return path
