"""Fuzzing the config: every combination is either refused with one line naming a key, or
builds a pipelined step that traces (and, in the slow run, compiles and runs)."""

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from seqpipe import schedule as schedule_lib
from seqpipe.models import model, reference
from seqpipe.parallel import sharding
from seqpipe.pipeline import executor
from seqpipe.run import config as config_lib
from seqpipe.run import run_config

KEYS_MENTIONED = ("model.", "mesh.", "pipeline.", "train.", "data.")


# One bad value at a time (or none): each must be caught by name, and every config
# that passes validation must build a step.
CORRUPTIONS = {
    "mesh.data": [0, 3, -2],
    "mesh.stage": [0, 16, -2],
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
    "model.experts_per_token": [0, 9],
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
    experts = draw(st.sampled_from([0, 0, 4, 6]))  # 6 experts on 4 or 8 replicas: refused
    if experts:
        c.model.update(mlp="swiglu", num_experts=experts, experts_per_token=2)
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
    if draw(st.booleans()):  # -1: the same split, found from the 8 devices
        c.mesh[draw(st.sampled_from(config_lib.MESH_AXES))] = -1
    if draw(st.booleans()):
        corrupt = draw(st.sampled_from(list(CORRUPTIONS)))
        section, key = corrupt.split(".")
        c[section][key] = draw(st.sampled_from(CORRUPTIONS[corrupt]))
    return c


def check(c, run: bool) -> None:
    try:
        config_lib.validate(c)  # before the device count is known, as train.py loads it
        resolved = run_config.resolve(c, jax.devices())  # the 8 devices
    except config_lib.ConfigError as e:
        message = str(e)
        assert "\n" not in message and any(k in message for k in KEYS_MENTIONED), message
        event("refused")
        return
    event("accepted")
    c = resolved.config
    mesh = sharding.make_mesh(c.mesh.data, c.mesh.stage)
    tokens = jax.ShapeDtypeStruct(
        (c.train.global_batch_size, c.train.seq_len + 1),
        np.int32,
        sharding=sharding.batch_sharding(mesh),
    )
    cfg = resolved.model
    params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    if not resolved.pipelined:
        step = jax.jit(lambda p, t: reference.loss_and_grads(p, t, cfg))
    else:
        spec = resolved.spec
        step = jax.jit(lambda p, t: executor.loss_and_grads(p, t, spec, mesh))
    lowered = step.lower(params, tokens)
    if run:
        real = model.init_params(cfg, jax.random.key(0))
        toks = jax.device_put(np.zeros(tokens.shape, np.int32), sharding.batch_sharding(mesh))
        loss, _ = lowered.compile()(real, toks)
        assert np.isfinite(float(loss))


# 20 drawn configs in the default run (about 40 s on 2 cores); 300 under `make test-all`.
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(configs())
def test_every_config_is_refused_in_one_line_or_traces(c):
    check(c, run=False)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(configs())
def test_many_configs_are_refused_in_one_line_or_trace(c):
    check(c, run=False)


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(configs())
def test_every_config_is_refused_in_one_line_or_runs_a_step(c):
    check(c, run=True)


@pytest.mark.parametrize(
    "data, stage, devices, expected",
    [
        (-1, 1, 1, (1, 1)),  # the design card's command on one GPU
        (-1, 1, 8, (8, 1)),  # on eight
        (-1, 8, 8, (1, 8)),
        (-1, 4, 16, (4, 4)),
        (-1, 8, 256, (32, 8)),  # a v5p-512
        (2, -1, 8, (2, 4)),
        (1, -1, 4, (1, 4)),
        (2, 4, 8, (2, 4)),  # nothing to resolve
    ],
)
def test_minus_one_takes_the_devices_the_other_axis_leaves(data, stage, devices, expected):
    c = config_lib.base_config()
    c.mesh.update(data=data, stage=stage)
    c.model.update(num_layers=8)
    c.pipeline.update(schedule="seq1f1b", microbatches=8)
    c.train.update(global_batch_size=256)
    config_lib.validate(c)
    resolved = config_lib.resolve(c, devices)
    assert (resolved.mesh.data, resolved.mesh.stage) == expected
    assert (c.mesh.data, c.mesh.stage) == (data, stage)  # a copy: the loaded config stays


@pytest.mark.parametrize(
    "data, stage, devices, expected",
    [
        (-1, 3, 8, "mesh.stage=3 does not divide the 8 visible devices"),
        (5, -1, 8, "mesh.data=5 does not divide the 8 visible devices"),
        (-1, 16, 8, "mesh.stage=16 does not divide the 8 visible devices"),
        (-1, -1, 8, "mesh.data=-1 and mesh.stage=-1: at most one mesh axis can be -1"),
        (2, 2, 8, "mesh.data * mesh.stage = 4 but 8 devices are visible"),
        (-2, 1, 8, "mesh.data=-2 must be at least 1, or -1"),
    ],
)
def test_impossible_splits_are_refused_in_one_line(data, stage, devices, expected):
    c = config_lib.base_config()
    c.mesh.update(data=data, stage=stage)
    c.model.update(num_layers=48)
    c.pipeline.update(schedule="seq1f1b", microbatches=16)
    c.train.update(global_batch_size=256)
    with pytest.raises(config_lib.ConfigError) as info:
        config_lib.resolve(c, devices)
    assert "\n" not in str(info.value) and expected in str(info.value), str(info.value)


def test_the_global_batch_is_checked_again_once_data_is_resolved():
    """Before the device count, batch 8 splits into 8 micro-batches; over 8 replicas it
    cannot: the message names the resolved mesh.data."""
    c = config_lib.base_config()
    c.mesh.update(data=-1, stage=1)
    c.pipeline.update(microbatches=8)
    c.train.update(global_batch_size=8)
    config_lib.validate(c)
    with pytest.raises(config_lib.ConfigError, match="mesh.data \\* pipeline.microbatches = 64"):
        config_lib.resolve(c, 8)


def test_the_schema_covers_every_key():
    """Every key of base_config has a type and range in SCHEMA, or a rule of its own."""
    import ml_collections

    def leaves(node, prefix=""):  # dotted keys, nested sections (model.rope_scaling) too
        for key, value in node.items():
            if isinstance(value, ml_collections.ConfigDict) and prefix:
                yield from leaves(value, f"{prefix}{key}.")
            elif isinstance(value, ml_collections.ConfigDict):
                yield from leaves(value, f"{key}.")
            else:
                yield f"{prefix}{key}"

    base = config_lib.base_config()
    keys = set(leaves(base))
    assert set(config_lib.SCHEMA) | set(config_lib.OWN_RULES) == keys
    assert not set(config_lib.SCHEMA) & set(config_lib.OWN_RULES)
    config_lib.validate(base)  # the defaults pass their own table


def _bad_values(rule) -> list:
    """A value of the wrong type (a bool for an integer: True == 1 passes a range check;
    ConfigDict itself turns a bool into a float), and values out of range: below, above,
    not finite, not a choice."""
    wrong_type = {int: True, float: "1.0", str: 1, bool: 1}[rule.kind]
    bad = [wrong_type, None]
    if rule.choices:
        bad.append("no-such-choice")
    if rule.kind is float:
        bad += [float("nan"), float("inf")]
    if rule.low is not None:
        bad.append(rule.low if rule.low_open else rule.low - 1)
    if rule.high is not None:
        bad.append(rule.high if rule.high_open else rule.high + 1)
    return bad


@pytest.mark.parametrize("key", sorted(config_lib.SCHEMA))
def test_every_key_is_checked_for_type_and_range(key):
    *sections, leaf = key.split(".")
    for value in _bad_values(config_lib.SCHEMA[key]):
        c = config_lib.base_config()
        c.pipeline.update(schedule="none")
        node = c
        for section in sections:
            node = node[section]
        with node.ignore_type():
            node[leaf] = value
        with pytest.raises(config_lib.ConfigError) as info:
            config_lib.validate(c)
        message = str(info.value)
        assert message.startswith(f"{key}={value!r} "), message
        assert "\n" not in message


@pytest.mark.parametrize("source", ["stdlib", "text", "tokens"])
def test_a_text_key_for_a_source_without_fields_is_refused_in_one_line(source):
    """data.text_key names a JSON field or Parquet column; elsewhere it was ignored
    without a word (issue 47). Its default passes with every source."""
    path = {"data.path": "corpus"}  # checked when read, not here
    config_lib.load("tiny", {"data.source": source, **path})  # the default: accepted
    with pytest.raises(config_lib.ConfigError) as e:
        config_lib.load("tiny", {"data.source": source, "data.text_key": "body", **path})
    assert str(e.value) == (
        f"data.text_key='body' is for data.source=jsonl or parquet (the field or column that "
        f"holds each document's text); data.source={source} has no fields: leave "
        "data.text_key=text, or set data.source"
    )
    for keyed in config_lib.TEXT_KEY_SOURCES:
        config_lib.load("tiny", {"data.source": keyed, "data.text_key": "body", **path})
