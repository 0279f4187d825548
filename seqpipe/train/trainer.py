"""The training loop: the state restored (or created), stepped, evaluated, logged and
saved, one invocation of a run at a time.

The loop dispatches step t, then reads step t-1's metrics, so the host never waits on the
step it just launched. Checkpoints (`seqpipe.train.checkpoint`) are saved every
`checkpoint.every` steps and at the end; a run resumes from the newest one in its workdir.
SIGTERM or SIGINT finishes the current step, saves, and returns; a second SIGINT aborts.
"""

import contextlib
from collections.abc import Callable

import jax
from ml_collections import ConfigDict

from seqpipe.data import loader
from seqpipe.errors import TrainingError
from seqpipe.hf import config as hf_config
from seqpipe.hf import weights
from seqpipe.host import logs, peers, runtime_log
from seqpipe.host import workdir as workdir_lib
from seqpipe.parallel import sharding
from seqpipe.run.run_config import RunConfig
from seqpipe.train import aot, checkpoint, optim
from seqpipe.train import step as step_lib
from seqpipe.train.evaluation import evaluate, make_eval_fn
from seqpipe.train.metrics import MetricsError, MetricsLog
from seqpipe.train.report import Reporter
from seqpipe.train.stops import BadSteps, StopRequest


def run(config: ConfigDict, workdir: str) -> list[dict]:
    """Train to config.train.steps (or train.stop_at), resuming from the newest checkpoint
    in workdir; returns the records logged by this invocation."""
    trainer = Trainer(aot.resolve(config), workdir)
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
        rows = loader.local_rows(config, self.mesh)
        # The data is checked before the workdir is touched: a refusal leaves nothing.
        train_stream, eval_stream, tokenizer = loader.read_corpus(config)
        if t.get("init_from"):  # its files' names, shapes and dtypes, as the data
            weights.check(t.init_from, self.run.model)
        # What the checkpoints' data position counts: with packing, the documents too.
        packed = config.data.packing != "none"
        self.data_id = loader.identity(train_stream.tokens, train_stream.starts if packed else None)
        self.lock = workdir_lib.Lock(workdir, jax.process_index())  # one run per workdir
        self.manager = None
        try:
            loader.keep_tokenizer(tokenizer, workdir, config)
            if jax.process_index() == 0:
                checkpoint.clean_partial(workdir)  # what a cut save left; the lock is ours
            self.batches = loader.train_iterator(config, train_stream, rows)
            held_out = (
                loader.eval_batches(config, eval_stream, t.eval_batches, rows)
                if t.eval_every
                else []
            )
            self.eval_set = [
                loader.global_batch(b, self.mesh, t.global_batch_size) for b in held_out
            ]
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
            change = hf_config.rope_change(config.model, t.init_from)
            self.log.print(f"initialised from {t.init_from}" + (f"; {change}" if change else ""))
        self.bad = BadSteps()
        self.records: list[dict] = []

    def restore(self) -> bool:
        """The newest checkpoint's state and data position, or a fresh state at step 0."""
        abstract = step_lib.abstract_state(self.run, self.mesh, self.tx)
        restored = checkpoint.restore_latest(self.manager, abstract, self.config, self.data_id)
        if restored:
            self.start, self.state, data_state = restored
            if data_state is not None:  # None: other data, allowed, read from its start
                self.batches.set_state(data_state)
        else:
            self.start, self.state = 0, step_lib.init_state(self.run, self.mesh, self.tx)
        return bool(restored)

    def train(self) -> list[dict]:
        """Steps start+1 .. end (or until a signal); returns the records logged."""
        run, t = self.run, self.run.train
        step_fn = step_lib.make_train_step(
            step_lib.make_grad_fn(run, self.mesh),
            self.tx,
            optim.lr_schedule(t),
            self.mesh,
            run.shard_optimizer,
            tuple(t.inject_nan_at),
        )
        eval_fn = make_eval_fn(run, self.mesh)
        self.log.print(run.line())
        self.reporter = Reporter(run, self.mesh.devices.flatten().tolist(), self.start)
        pending = None  # the step dispatched last, not yet waited for
        kept = (
            f"the newest complete checkpoint in {checkpoint.directory(self.workdir)} is intact "
            "(a save it cut is removed at the next start); run again to resume"
        )
        with self._as_training_errors(), StopRequest(kept) as stop:
            for step in range(self.start + 1, self.end + 1):
                batch = loader.global_batch(next(self.batches), self.mesh, t.global_batch_size)
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
        eval_losses = None
        if eval_fn:
            saved = f"step {step} is saved in {checkpoint.directory(self.workdir)}"
            eval_losses = evaluate(eval_fn, self.state["params"], self.eval_set, step, saved)
        self._report(step, metrics, eval_losses, force=True)

    def _finished(self, step: int, metrics: dict) -> None:
        """Wait for `step` (dispatched before the one now running) and count a skip."""
        jax.block_until_ready(metrics)
        # One int off a step that is already done: counting skips adds no wait.
        self.bad.count(bool(int(jax.device_get(metrics["skipped"]))))
        self.log.step(step)
        self.reporter.finished(step, self.log)

    def _report(self, step: int, metrics: dict, eval_losses: list | None, force=False) -> None:
        """Log `step` if due (or forced, evaluated, skipped); stop after too many skips."""
        # A run's first step is always logged: its loss and the compile time it includes.
        due = step % self.config.train.log_every == 0 or step in (self.start + 1, self.end)
        skipped = self.bad.in_row > 0  # counted by _finished(step), just before
        if not (due or force or eval_losses or skipped):
            return
        record = self.reporter.record(step, metrics, self.bad.record(), eval_losses)
        self.records.append(record)
        self.log.write(record)
        limit = self.config.train.max_bad_steps
        if self.bad.in_row >= limit:
            kept = (
                f"the last checkpoint, step {self.saved_step} in "
                f"{checkpoint.directory(self.workdir)}, is as it was"
                if self.saved_step is not None
                else "no checkpoint was saved"
            )
            raise self.bad.error(step, record, limit, kept)

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
