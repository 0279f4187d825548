"""Fuzzing the config: every combination is either refused with one line naming a key, or
builds a pipelined step that traces (and, in the slow run, compiles and runs)."""

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from seqpipe import config as config_lib
from seqpipe import model, pipeline, reference, sharding
from seqpipe import schedule as schedule_lib

KEYS_MENTIONED = ("model.", "mesh.", "pipeline.", "train.", "data.")


# One bad value at a time (or none): each must be caught by name, and every config
# that passes validation must build a step.
CORRUPTIONS = {
    "mesh.data": [0, 3],
    "mesh.stage": [0, 16],
    "model.vocab_size": [0],
    "model.num_layers": [0, 3],
    "model.num_heads": [0, 3, 16],
    "pipeline.schedule": ["2f2b"],
    "pipeline.microbatches": [0, 3],
    "pipeline.segments": [0, 99],
    "pipeline.partition": ["even"],
    "pipeline.partition_multiple": [0, 5],
    "pipeline.virtual_stages": [0, 3],
    "pipeline.inflight": ["deep", 0, True],
    "train.seq_len": [0],
    "train.global_batch_size": [0, 7],
    "train.learning_rate": [-1.0, float("nan"), float("inf")],
    "train.steps": [0],
}


@st.composite
def configs(draw):
    c = config_lib.base_config()
    data, stage = draw(st.sampled_from([(8, 1), (4, 2), (2, 4), (1, 8)]))
    schedule = draw(st.sampled_from(config_lib.SCHEDULES))
    if stage > 1 and schedule == "none":
        schedule = "seq1f1b"
    gen = schedule_lib.GENERATORS.get(schedule)  # None for "none"
    virtual = draw(st.sampled_from([1, 2])) if gen and gen.interleaved else 1
    microbatches = stage * draw(st.integers(1, 2)) if virtual > 1 else draw(st.integers(1, 5))
    segments = draw(st.integers(1, 4))
    c.mesh.update(data=data, stage=stage)
    c.model.update(
        vocab_size=61,
        num_layers=stage * virtual * draw(st.integers(1, 2)),
        d_model=16,
        num_heads=draw(st.sampled_from([2, 4])),
        d_ff=16,
    )
    c.pipeline.update(
        schedule=schedule,
        microbatches=microbatches,
        segments=segments,
        partition=draw(st.sampled_from(config_lib.PARTITIONS)),
        partition_multiple=draw(st.sampled_from([1, 2])),
        virtual_stages=virtual,
        inflight=draw(st.sampled_from(["minimal", "full", 6])),
    )
    c.train.update(seq_len=16, global_batch_size=data * microbatches * draw(st.integers(1, 2)))
    if draw(st.booleans()):
        corrupt = draw(st.sampled_from(list(CORRUPTIONS)))
        section, key = corrupt.split(".")
        c[section][key] = draw(st.sampled_from(CORRUPTIONS[corrupt]))
    return c


def check(c, run: bool) -> None:
    try:
        config_lib.validate(c, num_devices=8)
    except config_lib.ConfigError as e:
        message = str(e)
        assert "\n" not in message and any(k in message for k in KEYS_MENTIONED), message
        event("refused")
        return
    event("accepted")
    mesh = sharding.make_mesh(c.mesh.data, c.mesh.stage)
    tokens = jax.ShapeDtypeStruct(
        (c.train.global_batch_size, c.train.seq_len + 1),
        np.int32,
        sharding=sharding.batch_sharding(mesh),
    )
    cfg = model.GPTConfig.from_config(c.model)
    params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    if c.pipeline.schedule == "none":
        step = jax.jit(lambda p, t: reference.loss_and_grads(p, t, cfg))
    else:
        spec = pipeline.make_spec(c)
        step = jax.jit(lambda p, t: pipeline.loss_and_grads(p, t, spec, mesh))
    lowered = step.lower(params, tokens)
    if run:
        real = model.init_params(cfg, jax.random.key(0))
        toks = jax.device_put(np.zeros(tokens.shape, np.int32), sharding.batch_sharding(mesh))
        loss, _ = lowered.compile()(real, toks)
        assert np.isfinite(float(loss))


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(configs())
def test_every_config_is_refused_in_one_line_or_traces(c):
    check(c, run=False)


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(configs())
def test_every_config_is_refused_in_one_line_or_runs_a_step(c):
    check(c, run=True)
