"""Evaluating candidates on the models alone: memory estimate, verdict, step time.

`evaluate` is the one place a candidate meets the config: it applies the candidate's keys
to the user's config, builds its `PipelineSpec` (one table per shape, shared by the remat
policies) and prices it with `plan.memory` and `plan.timing`. Nothing is compiled here.
"""

from __future__ import annotations

import dataclasses

from seqpipe import schedule
from seqpipe.models.model import GPTConfig
from seqpipe.parallel import layout
from seqpipe.pipeline import spec
from seqpipe.pipeline.spec import PipelineSpec
from seqpipe.plan import bounds, memory, timing
from seqpipe.plan.space import Candidate
from seqpipe.run import config as config_lib
from seqpipe.schedule import partition


def config_of(base, c: Candidate, seq_len: int, global_batch: int, validate: bool = True):
    """A copy of `base` with the candidate's keys, the sequence and the batch, validated
    for its devices (ConfigError if the trainer would refuse it); the search leaves the
    validation to the winners (it builds the table again)."""
    cfg = base.copy_and_resolve_references()
    with cfg.unlocked():
        cfg.train.seq_len = seq_len
        cfg.train.global_batch_size = global_batch
        for key, value in c.overrides().items():
            section, name = key.split(".")
            cfg[section][name] = value
    if validate:
        config_lib.validate(cfg, c.devices)
    return cfg


def spec_of(config, c: Candidate):
    """The candidate's spec with remat `full`: the table, its lowering and the segments,
    built once for candidates that differ only in remat."""
    # Under `full` whatever the candidate's policy: the spec is shared by the policies
    # (built from the first candidate's, every other policy was priced as that one). The
    # whole config is in the key: another model or sequence is another spec.
    full = config.copy_and_resolve_references()
    with full.unlocked():
        full.pipeline.remat = "full"
    key = (dataclasses.replace(c, remat="full"), full.to_json())
    if key not in _TABLES:
        _TABLES[key] = spec.make_spec(full)
    return _TABLES[key]


_TABLES: dict = {}  # (a candidate with remat "full", its config) -> its spec


def evaluate(
    base, c: Candidate, seq_len: int, global_batch: int, rates, budget: int, validate=False
) -> dict:
    """The candidate's row: its estimated memory (by term), verdict against `budget`, and
    estimated step time, bubble, tokens/s and MFU. A candidate the trainer refuses gets
    `invalid` and the reason."""
    row = {"candidate": c, "label": c.label}
    try:
        config = config_of(base, c, seq_len, global_batch, validate)
        full = spec_of(config, c)
    except (config_lib.ConfigError, schedule.ScheduleError, ValueError) as e:
        return row | {"invalid": str(e)}
    rows = global_batch // (c.data * c.microbatches)
    shard = config_lib.shards_optimizer(config)
    est = memory.estimate(full, c.remat, rows, c.data, shard)
    state = memory.state_bytes(full.cfg, full.chunk_layers * full.virtual, c.data, shard)
    spec = dataclasses.replace(full, remat=c.remat)
    time = timing.step_time(spec, rows, c.data, shard, state, rates)
    return row | {
        "config": config,
        "memory_estimate": est,
        "memory_per_device_bytes": est["total"],
        "memory_source": "estimated",
        "verdict": bounds.verdict(est["total"], budget),
        **time,
    }


def lower_bound(base, c: Candidate, seq_len: int, global_batch: int, rates) -> float:
    """Seconds no schedule of the candidate beats: the last stage's own units (M x K x V)
    and its head's matmuls, the pipeline's fill and the work after the loop. Needs no
    table, so the search evaluates candidates in the order of this bound and stops where
    it passes the best."""
    cfg, lengths, layers, shard, state = _shape_of(base, c, seq_len, global_batch)
    local = tuple(length // c.context for length in lengths)  # a context device's
    spec = PipelineSpec(cfg, None, None, local, c.remat, layers, context=c.context)
    rows = global_batch // (c.data * c.microbatches)
    unit = timing.unit_cost(spec, rows, rates)
    busy = c.microbatches * c.segments * c.virtual * (unit["F"] + unit["B"])
    # The fill: the first segment's forward reaches the last stage after S - 1 hops, and
    # (unless W operations fill it) its backward returns as many; the first segment is the
    # cheapest under causal attention, so its FLOP share prices the hop.
    first = partition.segment_flops(lengths, **partition.model_dims(cfg))[0] * c.segments
    split = schedule.generator(c.schedule).split
    fill = (c.stage - 1) * first * (unit["F"] + (0 if split else unit["B"]))
    # The last stage also runs the head: its matmuls, forward and backward, at least (its
    # tensor and context devices each their share).
    head = 6 * cfg.d_model * cfg.vocab_size * global_batch // c.data * seq_len
    head_s = head / (cfg.tensor * c.context) / rates.flops
    return busy + head_s + fill + timing.after_loop(state, c.data, shard, rates, c.context)


_SHAPES: dict = {}


def _shape_of(base, c: Candidate, seq_len: int, global_batch: int) -> tuple:
    """(model, segment lengths, layers per chunk, sharded optimizer, state bytes) of the
    candidate's mesh, split and segments; once for all that share them."""
    cfg, layers, shard, state, multiple = _mesh_of(base, c, seq_len, global_batch)
    key = (c.segments, c.partition, multiple, seq_len, cfg)
    if key not in _LENGTHS:
        _LENGTHS[key] = tuple(
            partition.segment_lengths(
                seq_len, c.segments, c.partition, multiple=multiple, **partition.model_dims(cfg)
            )
        )
    return cfg, _LENGTHS[key], layers, shard, state


_LENGTHS: dict = {}


def _mesh_of(base, c: Candidate, seq_len: int, global_batch: int) -> tuple:
    """(model, layers per chunk, sharded optimizer, state bytes, segment multiple) of the
    candidate's mesh and layer split; once for all candidates that share them."""
    key = (id(base), c.data, c.stage, c.context, c.tensor, c.virtual, c.layers_per_stage)
    key += (seq_len,)
    if key not in _SHAPES:
        config = config_of(base, c, seq_len, global_batch, validate=False)
        cfg = full_cfg(config)
        layers = tuple(layout.of_config(config).layers_per_chunk)
        shard = config_lib.shards_optimizer(config)
        state = memory.state_bytes(cfg, max(layers) * c.virtual, c.data, shard)
        multiple = partition.segment_multiple(config)
        _SHAPES[key] = (base, (cfg, layers, shard, state, multiple))
    return _SHAPES[key][1]


def full_cfg(config):
    """The model as a stage of this mesh runs it (`GPTConfig` with its tensor devices)."""
    return dataclasses.replace(GPTConfig.from_config(config.model), tensor=config.mesh.tensor)


def state_of(base, c: Candidate, seq_len: int, global_batch: int) -> int:
    """Bytes of the parameters and AdamW moments a device of the candidate holds: exact
    (from the shardings), and a floor under any compiled figure."""
    state = _shape_of(base, c, seq_len, global_batch)[4]
    return state["params"] + state["moments"]
