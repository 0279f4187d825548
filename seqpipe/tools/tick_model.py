"""The synchronous-tick time model of a schedule table, and the unit timings it runs on,
shared by the benchmarks (`tools.bench`, `tools.accel`) and the prediction
(`tools.predict`): each unit (one segment through one chunk's layers) is compiled and
timed alone, and a tick lasts as long as its busiest stage.

jax is imported inside the functions: the benchmarks import this module before their
`main` sets the XLA flags (the fake CPU device count).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from seqpipe import schedule
from seqpipe.run import config as config_lib

# A tiny model, for the quick runs of this benchmark and of `tools.accel`.
QUICK_MODEL = (
    "--config.model.vocab_size=256",
    "--config.model.num_layers=2",
    "--config.model.d_model=32",
    "--config.model.num_heads=2",
    "--config.model.d_ff=64",
)
PREDICT_STAGES, PREDICT_MICROBATCHES = (4, 8), 8


def variant(config, name: str, segments: int, part: str, virtual: int, stage: int | None = None):
    """A copy of `config` with another schedule (and optionally stage count)."""
    c = config.copy_and_resolve_references()
    with c.unlocked():
        c.pipeline.schedule = name
        c.pipeline.segments = segments
        c.pipeline.partition = part
        c.pipeline.virtual_stages = virtual
        if stage is not None:
            c.mesh.stage = stage
    config_lib.validate(c)
    return c


def label(name: str, segments: int, part: str, virtual: int) -> str:
    out = name
    if schedule.generator(name).granularity == "segment":
        out += f" K{segments} {part}"
    return out + (f" V{virtual}" if virtual > 1 else "")


def median_seconds(fn, args, repeats: int) -> float:
    """Median wall time of `fn(*args)` over `repeats` calls after one warm-up call."""
    import jax  # after main() sets the XLA flags

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def concrete(args, vocab: int, seed: int = 0):
    """Random arrays for abstract unit arguments (tokens in range, small activations)."""
    import jax  # after main() sets the XLA flags
    import jax.numpy as jnp  # after main() sets the XLA flags

    leaves, tree = jax.tree.flatten(args)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for key, x in zip(keys, leaves, strict=True):
        if jnp.issubdtype(x.dtype, jnp.integer):
            out.append(jax.random.randint(key, x.shape, 0, vocab, x.dtype))
        else:
            out.append((0.1 * jax.random.normal(key, x.shape)).astype(x.dtype))
    return jax.tree.unflatten(tree, out)


class UnitTimer:
    """Measured seconds of one-layer units, and of an n-layer chunk's unit from them."""

    def __init__(self, rows: int, repeats: int):
        self.rows, self.repeats, self.seconds = rows, repeats, {}

    def one_layer(self, spec, seg, first, last, backward, keep) -> float:
        from seqpipe.tools import flops  # jax: after main() sets the XLA flags

        key = flops.unit_key(spec, self.rows, seg, first, last, backward, keep)
        if key not in self.seconds:
            compiled, args = flops.compiled_unit(spec, self.rows, seg, first, last, backward, keep)
            real = concrete(args, spec.cfg.vocab_size)
            self.seconds[key] = median_seconds(compiled, real, self.repeats)
        return self.seconds[key]

    def unit(self, spec, seg, first, last, backward, n=None, keep_all: bool = False) -> float:
        """Seconds of a unit through an n-layer chunk (default: the deepest chunk's)."""
        from seqpipe.tools import flops  # jax: after main() sets the XLA flags

        return sum(
            count * self.one_layer(spec, seg, f, la, backward, keep or keep_all)
            for count, f, la, keep in flops.chunk_terms(spec, seg, first, last, backward, n)
        )


def predicted(spec, cost) -> dict:
    """Synchronous time and bubble of the table: each tick lasts as long as its busiest
    stage, a stage's tick costing cost(spec, seg, first, last, kind, n) of what it runs
    (kind: `flops.KIND_INDEX`, so a split table's B and W are measured apart; n: the
    chunk's layer count)."""
    from seqpipe.tools import flops  # jax: after main() sets the XLA flags

    sched = spec.schedule
    S, last = sched.stages, sched.stages * sched.virtual - 1
    total, busy = 0.0, np.zeros(S)
    for row in sched.ticks:
        tick = np.zeros(S)
        for r, cell in enumerate(row):
            for op in cell:
                g = op.unit.chunk * S + r
                kind, n = flops.KIND_INDEX[op.kind], spec.layers_per_chunk[g]
                tick[r] += cost(spec, op.unit.seg, g == 0, g == last, kind, n)
        total += tick.max()
        busy += tick
    return {"time": float(total), "bubble": float(np.mean(1 - busy / total))}


def unit_seconds(spec, timer) -> dict:
    """Measured seconds of one micro-batch's F, B and W units (all its segments) through
    chunk 1 (stage 1; a middle stage when S > 2): the costs `predicted` schedules with.
    An unsplit table's B is the whole backward and its W is 0."""
    g = min(1, spec.stages * spec.virtual - 1)
    first, last = g == 0, g == spec.stages * spec.virtual - 1
    n = spec.layers_per_chunk[g]
    out = {}
    for name, kind in (("F", 0), ("B", 1), ("W", 2)):
        if kind == 2 and not spec.schedule.split:
            out[name] = 0.0
            continue
        out[name] = sum(
            timer.unit(spec, k, first, last, kind, n) for k in range(spec.schedule.segments)
        )
    return out


def chunk_layers(spec) -> int:
    return spec.cfg.num_layers // (spec.stages * spec.virtual)


def prediction(specs, timer, layers: int | None = None) -> list[dict]:
    """Seq1F1B over 1F1B, predicted from the measured unit timings (each table after its
    1F1B). Where a table's chunks have another layer count than the benchmark's
    (`layers`), the units' backwards keep their outputs (as in the layer loop): with one
    layer per chunk XLA would drop a middle backward's last matmul, so those times are
    slight overestimates. Without `layers` every unit is timed as its chunk runs it."""
    out, base = [], None
    for p in specs:
        spec = p["spec"]
        keep_all = layers is not None and chunk_layers(spec) != layers
        pred = predicted(spec, lambda sp, *a, k=keep_all: timer.unit(sp, *a, keep_all=k))
        if spec.schedule.name == "1f1b":
            base = pred["time"]
        out.append(
            {
                "stages": spec.stages,
                "microbatches": spec.schedule.microbatches,
                "depth": p["depth"],
                "label": p["label"],
                "predicted_s": pred["time"],
                "bubble": pred["bubble"],
                "speedup_over_1f1b": base / pred["time"],
            }
        )
    return out
