"""What a run reports beside each step's own metrics: throughput, FLOP/s and MFU, the first
step's time with its compilation, peak memory, and the constants every record repeats."""

import time

import jax
import numpy as np

from seqpipe import schedule
from seqpipe.models import model
from seqpipe.run.run_config import RunConfig
from seqpipe.schedule import partition
from seqpipe.train.metrics import MetricsLog, Throughput, device_memory_peak, peak_flops


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
    # The sequence's segments: a context device runs 1/context of each one's work, the
    # same shares (its local lengths would misweigh attention against the matmuls).
    lengths = spec.sequence_lengths
    costs = partition.segment_flops(lengths, **dims)
    chunks = partition.chunk_costs(
        spec.stages * spec.virtual,
        sum(lengths),
        **dims,
        layers_per_chunk=spec.layers_per_chunk,
    )
    with_head = schedule.stats(spec.schedule, costs, lengths, chunks)
    return {"bubble": schedule.stats(spec.schedule)["bubble"], "bubble_head": with_head["bubble"]}


class Reporter:
    """The records of one invocation's steps; its clocks start just before the first."""

    def __init__(self, run: RunConfig, devices: list, start: int):
        t = run.config.train
        self.start = start
        self.tokens_per_step = t.global_batch_size * t.seq_len
        self.flops_per_token = model.flops_per_token(run.model, t.seq_len)
        self.devices = devices
        self.peak = peak_flops(devices[0].device_kind)
        self.constants = {"flops_per_token": self.flops_per_token, **bubble_fractions(run)}
        self.throughput = Throughput(start)
        self.loop_start = time.perf_counter()
        self.first_step_s = None  # compilation plus the first step, kept out of the throughput

    def finished(self, step: int, log: MetricsLog) -> None:
        """`step` is done: after the first, the clocks restart without its compilation."""
        if step == self.start + 1:
            self.first_step_s = time.perf_counter() - self.loop_start
            self.throughput.reset(step)
            log.restart_clock(step)  # the ETA leaves compilation out

    def record(self, step: int, metrics: dict, bad: dict, eval_losses: list | None) -> dict:
        """`step`'s record: its metrics, the bad-step counts `bad`, its eval loss, rates."""
        values = jax.device_get(metrics)
        record = {"step": step, **{k: float(v) for k, v in values.items() if k != "skipped"}}
        record.update(bad)
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
