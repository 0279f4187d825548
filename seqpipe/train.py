"""Train state, the jitted training step, the training loop, and ahead-of-time compilation.

The loop dispatches step t, then reads step t-1's metrics, so the host never waits on the
step it just launched. Checkpoints (`seqpipe.checkpoint`) are saved every
`checkpoint.every` steps and at the end; a run resumes from the newest one in its workdir.
SIGTERM or SIGINT finishes the current step, saves, and returns; a second SIGINT aborts.
"""

import contextlib
import dataclasses
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from ml_collections import ConfigDict

from seqpipe import (
    checkpoint,
    data,
    hlo,
    layout,
    logs,
    model,
    optim,
    partition,
    peers,
    pipeline,
    reference,
    remat,
    run_config,
    runtime_log,
    schedule,
    sharding,
    signals,
)
from seqpipe import spec as spec_lib
from seqpipe import workdir as workdir_lib
from seqpipe.metrics import MetricsError, MetricsLog, Throughput, device_memory_peak, peak_flops
from seqpipe.run_config import KERNEL_PLATFORMS, RunConfig

State = dict[str, Any]
GradFn = Callable[[model.Params, jax.Array], tuple[jax.Array, model.Params]]


class TrainingError(RuntimeError):
    """Training cannot go on (for example a non-finite loss); the message says why."""


def resolve(
    config: ConfigDict, devices: list | None = None, budget: int | None = None
) -> RunConfig:
    """`run_config.resolve` for `devices` (default: this process's), choosing `auto` by
    compiling the candidates' steps (`compile_only`) where a device budget is known."""
    devices = jax.devices() if devices is None else devices
    return run_config.resolve(config, devices, budget, compile_only)


def _unpipelined(fn, cfg: model.GPTConfig, mesh: jax.sharding.Mesh):
    """`fn(params, tokens)` of the model without a pipeline: XLA partitions it over the
    mesh, unless its attention is a Pallas kernel, which XLA cannot partition; then each
    data shard runs whole on its devices (`reference.per_shard`)."""
    return reference.per_shard(fn, mesh) if cfg.attention in KERNEL_PLATFORMS else fn


def make_grad_fn(run: RunConfig, mesh: jax.sharding.Mesh) -> GradFn:
    """Loss and gradients of a [B, L+1] batch under the run's schedule."""
    if not run.pipelined:
        cfg, checkpoint = run.model, remat.POLICIES[run.remat].reference
        grad_fn = lambda params, tokens: reference.loss_and_grads(params, tokens, cfg, checkpoint)
        return _unpipelined(grad_fn, cfg, mesh)
    spec, scatter = run.spec, run.shard_optimizer
    return lambda params, tokens: pipeline.loss_and_grads(params, tokens, spec, mesh, scatter)


def _init_fn(run: RunConfig, tx: optax.GradientTransformation) -> Callable:
    def init(key):
        params = model.init_params(run.model, key)
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}
        # Born in the order the step reads, as the state stays (checkpoints excepted).
        return layout.to_stage_order(state, run.placement)

    return init


def abstract_state(
    run: RunConfig, mesh: jax.sharding.Mesh, tx: optax.GradientTransformation
) -> State:
    """Shapes, dtypes and shardings of the train state, with nothing allocated."""
    shapes = jax.eval_shape(_init_fn(run, tx), jax.random.key(run.train.seed))
    shardings = sharding.state_shardings(shapes, mesh, run.shard_optimizer)
    return checkpoint.abstract(shapes, shardings)


def init_state(run: RunConfig, mesh: jax.sharding.Mesh, tx: optax.GradientTransformation) -> State:
    """Parameters and optimizer state, created directly in their shardings."""
    abstract = abstract_state(run, mesh, tx)
    shardings = jax.tree.map(lambda s: s.sharding, abstract)
    if run.train.get("init_from"):
        return _imported_state(run, abstract, shardings, tx)
    init = jax.jit(_init_fn(run, tx), out_shardings=shardings)
    return init(jax.random.key(run.train.seed))


def _imported_state(run: RunConfig, abstract: State, shardings, tx) -> State:
    """The state at step 0 with train.init_from's weights (`seqpipe.hf`), each device's
    block read from the files, and fresh optimizer moments."""
    from seqpipe import hf

    positions = run.placement.positions()
    params = hf.initial_params(run.train.init_from, run.model, abstract["params"], positions)

    def init(params):
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}

    return jax.jit(init, out_shardings=shardings, donate_argnums=0)(params)


def make_train_step(
    grad_fn: GradFn,
    tx: optax.GradientTransformation,
    lr_fn,
    mesh: jax.sharding.Mesh,
    shard_optimizer: bool = False,
    inject_nan_at: tuple = (),
) -> Callable:
    """The jitted step. A non-finite loss or gradient norm leaves the parameters and the
    optimizer state as they were (`metrics["skipped"]` is 1); only the step count moves on.

    With `shard_optimizer` the gradients arrive (or are put) in the moments' shardings,
    split over `data`; each replica updates its share of the moments and the parameters,
    and pinning the new state to `sharding.state_shardings` makes XLA all-gather the
    parameters back onto every replica. The state leaves in the shardings it came in.

    `inject_nan_at` (tests only) makes the loss and gradients of those steps NaN.
    """

    def train_step(state: State, tokens: jax.Array) -> tuple[State, dict]:
        shardings = sharding.state_shardings(state, mesh, shard_optimizer)
        loss, grads = grad_fn(state["params"], tokens)
        # The pipeline already returns them so; without one, XLA reduce-scatters here.
        grads = jax.lax.with_sharding_constraint(
            grads, sharding.gradient_shardings(grads, mesh, shard_optimizer)
        )
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
        new_state = jax.lax.with_sharding_constraint(new_state, shardings)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            # The rate this step's update used: the schedule at the optimizer's own count,
            # which a skipped step does not advance (the train state's step does).
            "learning_rate": lr_fn(optim.schedule_count(state["opt_state"])),
            "skipped": (~finite).astype(jnp.int32),
        }
        return new_state, metrics

    return jax.jit(train_step, donate_argnums=0)


def abstract_batch(run: RunConfig, mesh: jax.sharding.Mesh):
    """The step's batch, abstract: tokens, and with `data.packing` the packed rows' ids
    and positions (`seqpipe.document_mask`)."""
    t = run.train
    rows = jax.ShapeDtypeStruct(
        (t.global_batch_size, t.seq_len + 1), jnp.int32, sharding=sharding.batch_sharding(mesh)
    )
    if run.config.data.packing == "none":
        return rows
    return {"tokens": rows, "documents": rows, "positions": rows}


def make_eval_fn(run: RunConfig, mesh: jax.sharding.Mesh) -> Callable:
    """Mean loss of a [B, L+1] batch, no gradients: through the pipeline's forwards alone
    (the training step's stages, segments and micro-batches) when there is a pipeline."""
    if not run.pipelined:
        cfg = run.model
        return jax.jit(
            _unpipelined(lambda params, batch: reference.batch_loss(params, batch, cfg), cfg, mesh)
        )
    spec = spec_lib.forward_only(run.spec)
    return jax.jit(lambda params, tokens: pipeline.eval_loss(params, tokens, spec, mesh))


def bubble_fractions(run: RunConfig) -> dict[str, float]:
    """The schedule's idle fraction under the synchronous-tick model (0 without a
    pipeline): `bubble` with the unit model (forward 1, backward 2 for every unit), and
    `bubble_head` with each segment's FLOP share, each stage's layer count and the head's
    and embedding's work on their chunks: the last stage runs the head in its forward
    ticks, and every stage waits for it (`pipeline.layers_per_stage=flops` moves layers
    off it)."""
    if not run.pipelined:
        return {"bubble": 0.0, "bubble_head": 0.0}
    spec = run.spec
    dims = partition.model_dims(spec.cfg)
    costs = partition.segment_flops(spec.lengths, **dims)
    chunks = partition.chunk_costs(
        spec.stages * spec.virtual,
        sum(spec.lengths),
        **dims,
        layers_per_chunk=spec.layers_per_chunk,
    )
    with_head = schedule.stats(spec.schedule, costs, spec.lengths, chunks)
    return {"bubble": schedule.stats(spec.schedule)["bubble"], "bubble_head": with_head["bubble"]}


class StopRequest:
    """SIGTERM/SIGINT set a flag the loop checks after each step; a second SIGINT aborts.

    With several processes, all must stop at the same step: SIGTERM is left to JAX's
    preemption service (`reached_preemption_sync_point`), which agrees on a step across
    processes, and SIGINT is forwarded to it as a SIGTERM.
    """

    def __init__(self, kept: str = "run again to resume"):
        self.signal_name: str | None = None
        self.kept = kept  # what the second Ctrl-C's line says of the checkpoints
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
        # Past the loop the start-up handlers are back: a signal ends the process at once.
        signals.set_context("while finishing", self.kept)

    def _handle(self, signum, frame):
        # Two Ctrl-Cs during one long call into C (the first compilation) reach Python as
        # one call of this handler; the wakeup pipe counts each.
        sigints = signals.count_sigints()
        if signum == signal.SIGINT and (self.signal_name == "SIGINT" or sigints >= 2):
            # The second Ctrl-C: out now, in one line. An exception would unwind through
            # whatever runs (an orbax save, which logs it with a traceback); a save it cuts
            # is removed at the next start, and the kernel drops the workdir's lock.
            stopped = f"stopped by a second Ctrl-C, without saving; {self.kept}"
            runtime_log.exit_at_once(stopped, 130)
        self.signal_name = signal.Signals(signum).name
        if self._multi:
            os.kill(os.getpid(), signal.SIGTERM)  # to JAX's preemption notifier

    def requested(self, step: int) -> bool:
        if self._multi:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                self.signal_name = self.signal_name or "SIGTERM"
                return True
            return False
        return self.signal_name is not None


@dataclasses.dataclass
class BadSteps:
    """Steps skipped for a non-finite loss or gradient norm: in all, and the current run."""

    total: int = 0
    in_row: int = 0

    def count(self, skipped: bool) -> None:
        if skipped:
            self.total += 1
            self.in_row += 1
        else:
            self.in_row = 0

    def record(self) -> dict:
        return {"bad_steps": self.total, "bad_steps_in_row": self.in_row}


def run(config: ConfigDict, workdir: str) -> list[dict]:
    """Train to config.train.steps (or train.stop_at), resuming from the newest checkpoint
    in workdir; returns the records logged by this invocation."""
    trainer = Trainer(resolve(config), workdir)
    try:
        if trainer.start >= trainer.end:
            trainer.log.print(
                f"nothing to do: the checkpoint is at step {trainer.start}, "
                f"the run ends at {trainer.end}"
            )
            return []
        return trainer.train()
    finally:
        trainer.close()


class Trainer:
    """One invocation of `run`: the state restored (or created), stepped, logged and saved.

    The host stays one step ahead: it dispatches step t, then waits for step t-1 and
    reports it, so it never waits on the step it just launched.
    """

    def __init__(self, run: RunConfig, workdir: str):
        self.run, self.config, self.workdir = run, run.config, workdir
        workdir_lib.check(workdir)  # a file, or read-only: refused before any work
        peers.watch(checkpoint.directory(workdir))  # what a lost process's line names
        # Third-party logs: warnings on the console, all in the workdir's log once it is ours.
        self.logs = logs.Capture()
        try:
            self._start(run.config, workdir)
        except BaseException:
            self.logs.close()
            raise

    def _start(self, config: ConfigDict, workdir: str) -> None:
        t = config.train
        self.mesh = sharding.mesh_of(config, list(self.run.target.devices))
        rows = data.local_rows(config, self.mesh)
        # The data is checked before the workdir is touched: a refusal leaves nothing.
        train_stream, eval_stream, tokenizer = data.read_corpus(config)
        if t.get("init_from"):  # its files' names, shapes and dtypes, as the data
            from seqpipe import hf

            hf.check(t.init_from, self.run.model)
        # What the checkpoints' data position counts: with packing, the documents too.
        packed = config.data.packing != "none"
        self.data_id = data.identity(train_stream.tokens, train_stream.starts if packed else None)
        self.lock = workdir_lib.Lock(workdir, jax.process_index())  # one run per workdir
        self.manager = None
        try:
            data.keep_tokenizer(tokenizer, workdir, config)
            if jax.process_index() == 0:
                checkpoint.clean_partial(workdir)  # what a cut save left; the lock is ours
            self.batches = data.train_iterator(config, train_stream, rows)
            held_out = (
                data.eval_batches(config, eval_stream, t.eval_batches, rows) if t.eval_every else []
            )
            self.eval_set = [data.global_batch(b, self.mesh, t.global_batch_size) for b in held_out]
            self.tx = optim.make_optimizer(t)
            self.manager = checkpoint.make_manager(workdir, config)
            restored = self.restore()
            self.lock.record_owner()
            self.logs.open(workdir, jax.process_index())
        except BaseException:
            if self.manager is not None:
                self.manager.close()
            self.lock.release()
            raise
        self.saved_step = self.start if restored else None  # the newest checkpoint
        self.end = min(t.stop_at or t.steps, t.steps)
        main = jax.process_index() == 0
        self.log = MetricsLog(workdir, t.steps, enabled=main, start_step=self.start)
        if restored:
            self.log.print(f"resumed from {checkpoint.directory(workdir)}/{self.start}")
            if t.get("init_from"):
                self.log.print(
                    f"train.init_from={t.init_from} is not read: {workdir} holds its own "
                    f"checkpoint (step {self.start}), which the run resumes"
                )
        elif t.get("init_from"):
            from seqpipe import hf_config

            change = hf_config.rope_change(config.model, t.init_from)
            self.log.print(f"initialised from {t.init_from}" + (f"; {change}" if change else ""))
        self.bad = BadSteps()
        self.records: list[dict] = []

    def restore(self) -> bool:
        """The newest checkpoint's state and data position, or a fresh state at step 0."""
        abstract = abstract_state(self.run, self.mesh, self.tx)
        restored = checkpoint.restore_latest(self.manager, abstract, self.config, self.data_id)
        if restored:
            self.start, self.state, data_state = restored
            if data_state is not None:  # None: other data, allowed, read from its start
                self.batches.set_state(data_state)
        else:
            self.start, self.state = 0, init_state(self.run, self.mesh, self.tx)
        return bool(restored)

    def train(self) -> list[dict]:
        """Steps start+1 .. end (or until a signal); returns the records logged."""
        run, t = self.run, self.run.train
        step_fn = make_train_step(
            make_grad_fn(run, self.mesh),
            self.tx,
            optim.lr_schedule(t),
            self.mesh,
            run.shard_optimizer,
            tuple(t.inject_nan_at),
        )
        eval_fn = make_eval_fn(run, self.mesh)
        self.log.print(run.line())
        self._start_reporting()
        pending = None  # the step dispatched last, not yet waited for
        kept = (
            f"the newest complete checkpoint in {checkpoint.directory(self.workdir)} is intact "
            "(a save it cut is removed at the next start); run again to resume"
        )
        with self._as_training_errors(), StopRequest(kept) as stop:
            for step in range(self.start + 1, self.end + 1):
                batch = data.global_batch(next(self.batches), self.mesh, t.global_batch_size)
                self.state, metrics = step_fn(self.state, batch)
                if pending:
                    self._finished(pending[0], pending[1])
                    self._report(*pending)
                pending = (step, metrics, None)
                stopping = stop.requested(step)
                evaluate = bool(self.eval_set) and (step % t.eval_every == 0 or step == self.end)
                every = self.config.checkpoint.every
                if step == self.end or stopping or evaluate or (every and step % every == 0):
                    pending = None
                    self._checkpoint(step, metrics, eval_fn if evaluate else None)
                if stopping:
                    self.log.print(
                        f"stopped by {stop.signal_name} at step {step}; checkpoint saved in "
                        f"{checkpoint.directory(self.workdir)}; run again to resume"
                    )
                    break
        return self.records

    def _checkpoint(self, step: int, metrics: dict, eval_fn: Callable | None) -> None:
        """Wait for `step`, save it, then evaluate it (with an `eval_fn`) and log it. Saved
        before the evaluation: however that ends, the run has lost no step. Too many bad
        steps in a row stop the run here, without saving."""
        self._finished(step, metrics)
        if self.bad.in_row >= self.config.train.max_bad_steps:
            self._report(step, metrics, None, force=True)  # raises
        self._save(step)
        eval_losses = self._evaluate(eval_fn, step) if eval_fn else None
        self._report(step, metrics, eval_losses, force=True)

    def _evaluate(self, eval_fn: Callable, step: int) -> list | None:
        """The eval losses of the current parameters, at most two batches in flight (as the
        steps: dispatching a hundred at once stalled XLA's CPU collectives until it
        aborted); None, with a line, if the backend fails: training goes on."""
        losses = []
        try:
            for i, batch in enumerate(self.eval_set):
                losses.append(eval_fn(self.state["params"], batch))
                if i:
                    jax.block_until_ready(losses[i - 1])
            return jax.block_until_ready(losses)
        except jax.errors.JaxRuntimeError as e:
            reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            print(
                f"warning: the evaluation at step {step} failed ({reason}); step {step} is "
                f"saved in {checkpoint.directory(self.workdir)}, training goes on",
                file=sys.stderr,
                flush=True,
            )
            return None

    def _finished(self, step: int, metrics: dict) -> None:
        """Wait for `step` (dispatched before the one now running) and count a skip."""
        jax.block_until_ready(metrics)
        # One int off a step that is already done: counting skips adds no wait.
        self.bad.count(bool(int(jax.device_get(metrics["skipped"]))))
        self.log.step(step)
        if step == self.start + 1:
            self.first_step_s = time.perf_counter() - self.loop_start
            self.throughput.reset(step)
            self.log.restart_clock(step)  # the ETA leaves compilation out

    def _start_reporting(self) -> None:
        """What every record repeats, and the clocks: started just before the first step."""
        t = self.config.train
        self.tokens_per_step = t.global_batch_size * t.seq_len
        self.flops_per_token = model.flops_per_token(self.run.model, t.seq_len)
        self.devices = self.mesh.devices.flatten().tolist()
        self.peak = peak_flops(self.devices[0].device_kind)
        self.constants = {
            "flops_per_token": self.flops_per_token,
            **bubble_fractions(self.run),
        }
        self.throughput = Throughput(self.start)
        self.loop_start = time.perf_counter()
        self.first_step_s = None  # compilation plus the first step, kept out of the throughput

    def _report(self, step: int, metrics: dict, eval_losses: list | None, force=False) -> None:
        """Log `step` if due (or forced, evaluated, skipped); stop after too many skips."""
        # A run's first step is always logged: its loss and the compile time it includes.
        due = step % self.config.train.log_every == 0 or step in (self.start + 1, self.end)
        skipped = self.bad.in_row > 0  # counted by _finished(step), just before
        if not (due or force or eval_losses or skipped):
            return
        record = self._record(step, metrics, eval_losses)
        self.records.append(record)
        self.log.write(record)
        if self.bad.in_row >= self.config.train.max_bad_steps:
            raise self._too_many_bad_steps(step, record)

    def _record(self, step: int, metrics: dict, eval_losses: list | None) -> dict:
        values = jax.device_get(metrics)
        record = {"step": step, **{k: float(v) for k, v in values.items() if k != "skipped"}}
        record.update(self.bad.record())
        if eval_losses:
            record["eval_loss"] = float(np.mean(jax.device_get(eval_losses)))
        record.update(self.constants)
        if step == self.start + 1:
            record["first_step_s"] = self.first_step_s
        else:
            tokens_per_s, record["step_time_s"] = self.throughput.update(step, self.tokens_per_step)
            record["tokens_per_s"] = tokens_per_s
            record["flops_per_s"] = self.flops_per_token * tokens_per_s
            if self.peak:
                record["mfu"] = record["flops_per_s"] / (self.peak * len(self.devices))
        memory = device_memory_peak(jax.local_devices())
        if memory is not None:
            record["peak_memory_bytes"] = memory
        return record

    def _too_many_bad_steps(self, step: int, record: dict) -> TrainingError:
        in_row, limit = self.bad.in_row, self.config.train.max_bad_steps
        kept = (
            f"the last checkpoint, step {self.saved_step} in "
            f"{checkpoint.directory(self.workdir)}, is as it was"
            if self.saved_step is not None
            else "no checkpoint was saved"
        )
        return TrainingError(
            f"steps {step - in_row + 1}-{step}: {in_row} in a row with a non-finite "
            f"loss or gradient norm (train.max_bad_steps={limit}; last loss "
            f"{record['loss']}, grad_norm {record['grad_norm']}); stopped without saving, "
            f"{kept}; lower train.learning_rate or check the data"
        )

    def _save(self, step: int) -> None:
        checkpoint.wait(self.manager, self.saved_step)  # the previous write's failure surfaces here
        checkpoint.save(
            self.manager, step, self.state, self.batches.get_state(), self.config, self.data_id
        )
        self.saved_step = step

    @contextlib.contextmanager
    def _as_training_errors(self):
        """A failed checkpoint or metrics write stops training with one line saying why."""
        try:
            yield
        except jax.errors.JaxRuntimeError as e:
            if not peers.is_lost_peer(e):
                raise
            # Nothing is closed: a save or a shutdown would wait for the lost process.
            runtime_log.exit_at_once(peers.lost_message(str(e)), 1)
        except checkpoint.SaveError as e:
            if e.__cause__ is not None and peers.is_lost_peer(e.__cause__):
                # The save's collective lost its peer: a lost process, not a full disk.
                runtime_log.exit_at_once(peers.lost_message(str(e.__cause__)), 1)
            raise TrainingError(str(e)) from None
        except MetricsError as e:
            kept = (
                f"step {self.saved_step} in {checkpoint.directory(self.workdir)} is the newest "
                "checkpoint"
                if self.saved_step is not None
                else "no checkpoint was saved"
            )
            raise TrainingError(
                f"{e}; stopped, {kept}; free space there and run again to resume"
            ) from None

    def close(self) -> None:
        """Wait for the save in flight (its failure is a TrainingError), then close all."""
        try:
            with self._as_training_errors():
                checkpoint.wait(self.manager, self.saved_step)
        finally:
            self.manager.close()
            self.log.close()
            self.logs.close()
            self.lock.release()


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
        "mesh": dataclasses.asdict(run.mesh),
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
