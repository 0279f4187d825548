"""Train state, the jitted training step, the training loop, and ahead-of-time compilation.

The loop dispatches step t, then reads step t-1's metrics, so the host never waits on the
step it just launched. Checkpoints (`seqpipe.checkpoint`) are saved every
`checkpoint.every` steps and at the end; a run resumes from the newest one in its workdir.
SIGTERM or SIGINT finishes the current step, saves, and returns; a second SIGINT aborts.
"""

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from ml_collections import ConfigDict

from seqpipe import checkpoint, data, model, optim, pipeline, reference, schedule, sharding
from seqpipe import config as config_lib
from seqpipe.metrics import MetricsError, MetricsLog, Throughput, device_memory_peak, peak_flops
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
            params, tokens, cfg, reference.CHECKPOINT[config.pipeline.remat]
        )
    spec = pipeline.make_spec(config)
    return lambda params, tokens: pipeline.loss_and_grads(params, tokens, spec, mesh)


def _init_fn(config: ConfigDict, tx: optax.GradientTransformation) -> Callable:
    cfg = GPTConfig.from_config(config.model)

    def init(key):
        params = model.init_params(cfg, key)
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}

    return init


def abstract_state(
    config: ConfigDict, mesh: jax.sharding.Mesh, tx: optax.GradientTransformation
) -> State:
    """Shapes, dtypes and shardings of the train state, with nothing allocated."""
    shapes = jax.eval_shape(_init_fn(config, tx), jax.random.key(config.train.seed))
    return checkpoint.abstract(shapes, sharding.state_shardings(shapes, mesh))


def init_state(
    config: ConfigDict, mesh: jax.sharding.Mesh, tx: optax.GradientTransformation
) -> State:
    """Parameters and optimizer state, created directly in their shardings."""
    shardings = jax.tree.map(lambda s: s.sharding, abstract_state(config, mesh, tx))
    init = jax.jit(_init_fn(config, tx), out_shardings=shardings)
    return init(jax.random.key(config.train.seed))


def make_train_step(
    grad_fn: GradFn, tx: optax.GradientTransformation, lr_fn, inject_nan_at: tuple = ()
) -> Callable:
    """The jitted step. A non-finite loss or gradient norm leaves the parameters and the
    optimizer state as they were (`metrics["skipped"]` is 1); only the step count moves on.

    `inject_nan_at` (tests only) makes the loss and gradients of those steps NaN.
    """

    def train_step(state: State, tokens: jax.Array) -> tuple[State, dict]:
        loss, grads = grad_fn(state["params"], tokens)
        if inject_nan_at:
            poison = jnp.isin(state["step"] + 1, jnp.asarray(inject_nan_at))
            loss = jnp.where(poison, jnp.nan, loss)
            grads = jax.tree.map(lambda g: jnp.where(poison, jnp.nan, g), grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        # A select on device, not a branch on the host: no sync, and NaNs never reach state.
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        new_state = {
            "step": state["step"] + 1,
            "params": keep(params, state["params"]),
            "opt_state": keep(opt_state, state["opt_state"]),
        }
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "learning_rate": lr_fn(state["step"]),
            "skipped": (~finite).astype(jnp.int32),
        }
        return new_state, metrics

    return jax.jit(train_step, donate_argnums=0)


def make_eval_fn(config: ConfigDict) -> Callable:
    cfg = GPTConfig.from_config(config.model)
    return jax.jit(lambda params, tokens: model.loss(params, tokens, cfg))


def bubble_fraction(config: ConfigDict) -> float:
    """The schedule's idle fraction under the synchronous-tick model (0 without a pipeline)."""
    if config.pipeline.schedule == "none":
        return 0.0
    spec = pipeline.make_spec(config)
    return schedule.stats(spec.schedule)["bubble"]


class StopRequest:
    """SIGTERM/SIGINT set a flag the loop checks after each step; a second SIGINT aborts.

    With several processes, all must stop at the same step: SIGTERM is left to JAX's
    preemption service (`reached_preemption_sync_point`), which agrees on a step across
    processes, and SIGINT is forwarded to it as a SIGTERM.
    """

    def __init__(self):
        self.signal_name: str | None = None
        self._previous = {}
        self._multi = jax.process_count() > 1

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            return self  # signals can only be caught on the main thread
        signals = (signal.SIGINT,) if self._multi else (signal.SIGTERM, signal.SIGINT)
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.signal_name == "SIGINT":
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        self.signal_name = signal.Signals(signum).name
        if self._multi:
            import os

            os.kill(os.getpid(), signal.SIGTERM)  # to JAX's preemption notifier

    def requested(self, step: int) -> bool:
        if self._multi:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                self.signal_name = self.signal_name or "SIGTERM"
                return True
            return False
        return self.signal_name is not None


def run(config: ConfigDict, workdir: str) -> list[dict]:
    """Train to config.train.steps (or train.stop_at), resuming from the newest checkpoint
    in workdir; returns the records logged by this invocation."""
    t = config.train
    config_lib.validate(config, jax.device_count())
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.stage)
    rows = data.local_rows(config, mesh)  # before anything is written: a refusal leaves none
    train_tokens, eval_tokens = data.load_tokens(config, workdir)  # checks the data first
    prepare_workdir(workdir)
    batches = data.train_iterator(config, train_tokens, rows)
    eval_set = (
        [
            data.to_global(b, mesh, t.global_batch_size)
            for b in data.eval_batches(config, eval_tokens, t.eval_batches, rows)
        ]
        if t.eval_every
        else []
    )
    tx = optim.make_optimizer(t)
    main = jax.process_index() == 0
    manager = checkpoint.make_manager(workdir, config)
    try:
        restored = checkpoint.restore_latest(manager, abstract_state(config, mesh, tx), config)
    except BaseException:
        manager.close()
        raise
    if restored:
        start, state, data_state = restored
        batches.set_state(data_state)
    else:
        start, state = 0, init_state(config, mesh, tx)
    end = min(t.stop_at or t.steps, t.steps)
    log = MetricsLog(workdir, t.steps, enabled=main, start_step=start)
    if restored:
        log.print(f"resumed from {checkpoint.directory(workdir)}/{start}")
    if start >= end:
        log.print(f"nothing to do: the checkpoint is at step {start}, the run ends at {end}")
        log.close()
        manager.close()
        return []

    step_fn = make_train_step(
        make_grad_fn(config, mesh), tx, optim.lr_schedule(t), tuple(t.inject_nan_at)
    )
    eval_fn = make_eval_fn(config)
    tokens_per_step = t.global_batch_size * t.seq_len
    flops_per_token = model.flops_per_token(GPTConfig.from_config(config.model), t.seq_len)
    devices = mesh.devices.flatten().tolist()
    peak = peak_flops(devices[0].device_kind)
    constants = {"flops_per_token": flops_per_token, "bubble": bubble_fraction(config)}
    records, throughput = [], Throughput(start)
    loop_start = time.perf_counter()
    first_step_s = None  # compilation plus the first step, kept out of the throughput
    bad = {"bad_steps": 0, "bad_steps_in_row": 0}  # skipped steps: in all, and the current run
    saved_step = start if restored else None

    def report(step: int, metrics: dict, eval_losses: list | None, force: bool = False) -> None:
        # Called one step late so the host never waits on the step it just dispatched.
        skipped = bad["bad_steps_in_row"] > 0  # counted by finished(step), just before
        # A run's first step is always logged: its loss and the compile time it includes.
        due = step % t.log_every == 0 or step in (start + 1, end)
        if not (due or force or eval_losses or skipped):
            return
        values = jax.device_get(metrics)
        record = {"step": step, **{k: float(v) for k, v in values.items() if k != "skipped"}}
        record.update({k: bad[k] for k in ("bad_steps", "bad_steps_in_row")})
        if eval_losses:
            record["eval_loss"] = float(np.mean(jax.device_get(eval_losses)))
        record.update(constants)
        if step == start + 1:
            record["first_step_s"] = first_step_s
        else:
            tokens_per_s, record["step_time_s"] = throughput.update(step, tokens_per_step)
            record["tokens_per_s"] = tokens_per_s
            record["flops_per_s"] = flops_per_token * tokens_per_s
            if peak:
                record["mfu"] = record["flops_per_s"] / (peak * len(devices))
        memory = device_memory_peak(jax.local_devices())
        if memory is not None:
            record["peak_memory_bytes"] = memory
        records.append(record)
        log.write(record)
        if bad["bad_steps_in_row"] >= t.max_bad_steps:
            first = step - bad["bad_steps_in_row"] + 1
            kept = (
                f"the last checkpoint, step {saved_step} in {checkpoint.directory(workdir)}, is "
                "as it was"
                if saved_step is not None
                else "no checkpoint was saved"
            )
            raise TrainingError(
                f"steps {first}-{step}: {bad['bad_steps_in_row']} in a row with a non-finite "
                f"loss or gradient norm (train.max_bad_steps={t.max_bad_steps}; last loss "
                f"{record['loss']}, grad_norm {record['grad_norm']}); stopped without saving, "
                f"{kept}; lower train.learning_rate or check the data"
            )

    def finished(step: int, metrics: dict) -> None:
        # Wait for step t-1 while step t runs: the host stays one step ahead, no more.
        nonlocal first_step_s
        jax.block_until_ready(metrics)
        # One int off a step that is already done: counting skips adds no wait.
        if int(jax.device_get(metrics["skipped"])):
            bad["bad_steps"] += 1
            bad["bad_steps_in_row"] += 1
        else:
            bad["bad_steps_in_row"] = 0
        log.step(step)
        if step == start + 1:
            first_step_s = time.perf_counter() - loop_start
            throughput.reset(step)

    def save(step: int) -> None:
        nonlocal saved_step
        checkpoint.wait(manager, saved_step)  # the previous write's failure surfaces here
        checkpoint.save(manager, step, state, batches.get_state(), config)
        saved_step = step

    pending, step = None, start
    try:
        with StopRequest() as stop:
            for step in range(start + 1, end + 1):
                batch = data.to_global(next(batches)["tokens"], mesh, t.global_batch_size)
                state, metrics = step_fn(state, batch)
                evaluate = bool(eval_set) and (step % t.eval_every == 0 or step == end)
                eval_losses = [eval_fn(state["params"], b) for b in eval_set] if evaluate else None
                if pending:
                    finished(pending[0], pending[1])
                    report(*pending)
                pending = (step, metrics, eval_losses)
                stopping = stop.requested(step)
                if (
                    step == end
                    or stopping
                    or (config.checkpoint.every and step % config.checkpoint.every == 0)
                ):
                    finished(step, metrics)
                    report(*pending, force=True)
                    pending = None
                    save(step)
                if stopping:
                    log.print(
                        f"stopped by {stop.signal_name} at step {step}; checkpoint saved in "
                        f"{checkpoint.directory(workdir)}; run again to resume"
                    )
                    break
    except checkpoint.SaveError as e:
        raise TrainingError(str(e)) from None
    except MetricsError as e:
        kept = (
            f"step {saved_step} in {checkpoint.directory(workdir)} is the newest checkpoint"
            if saved_step is not None
            else "no checkpoint was saved"
        )
        raise TrainingError(
            f"{e}; stopped, {kept}; free space there and run again to resume"
        ) from None
    finally:
        try:
            checkpoint.wait(manager, saved_step)
        except checkpoint.SaveError as e:
            raise TrainingError(str(e)) from None
        finally:
            manager.close()
            log.close()
    return records


def compile_only(config: ConfigDict) -> dict:
    """Compile the training step for the configured mesh without allocating parameters.

    Returns per-device memory from XLA's `memory_analysis()` and the model's analytic FLOPs
    per step (XLA's `cost_analysis` counts a loop body once, whatever its trip count).
    """
    t = config.train
    config_lib.validate(config, jax.device_count())
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.stage)
    tx = optim.make_optimizer(t)
    state = abstract_state(config, mesh, tx)
    batch = jax.ShapeDtypeStruct(
        (t.global_batch_size, t.seq_len + 1), jnp.int32, sharding=sharding.batch_sharding(mesh)
    )
    step_fn = make_train_step(make_grad_fn(config, mesh), tx, optim.lr_schedule(t))
    start = time.perf_counter()
    compiled = step_fn.lower(state, batch).compile()
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    memory = {
        "arguments": mem.argument_size_in_bytes,
        "outputs": mem.output_size_in_bytes,
        "temporaries": mem.temp_size_in_bytes,
        "aliased": mem.alias_size_in_bytes,
        "generated_code": mem.generated_code_size_in_bytes,
    }
    # Donated state is aliased to the outputs, so it is counted once.
    memory["total"] = (
        memory["arguments"] + memory["outputs"] - memory["aliased"] + memory["temporaries"]
    )
    cfg = GPTConfig.from_config(config.model)
    flops_per_token = model.flops_per_token(cfg, t.seq_len)
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state["params"]))
    return {
        "mesh": {"data": config.mesh.data, "stage": config.mesh.stage},
        "device_kind": mesh.devices.flat[0].device_kind,
        "schedule": config.pipeline.schedule,
        "microbatches": config.pipeline.microbatches,
        "segments": config.pipeline.segments,
        "params": num_params,
        "bubble": bubble_fraction(config),
        "memory_per_device_bytes": memory,
        "memory_per_device_gib": round(memory["total"] / 2**30, 3),
        "flops_per_token": flops_per_token,
        "flops_per_step": flops_per_token * t.global_batch_size * t.seq_len,
        "compile_s": round(seconds, 1),
    }


def prepare_workdir(workdir: str) -> Path:
    path = Path(workdir)
    path.mkdir(parents=True, exist_ok=True)
    return path
