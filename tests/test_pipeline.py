"""Every schedule's loss and gradients equal the un-pipelined reference (the oracle).

The default run takes an all-pairs sample of the matrix (schedule x mesh x segments x
partition x micro-batches vs stages x virtual stages x attention x model); `make test-all`
runs all of it. The reference always runs the `xla` attention, the oracle of the others.
The models: today's GPT, and a Llama-family one with every feature at once (`LLAMA`).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import LOSS_RTOL, MODELS, SEQ_LEN, check, make_config, microbatch_count, references
from pairwise import all_pairs, full_product, matrix, sampled

from seqpipe import schedule as schedule_lib
from seqpipe.kernels import kv_cache
from seqpipe.models import model
from seqpipe.parallel import layout, sharding
from seqpipe.pipeline import carry, executor, remat, remat_strategies, units
from seqpipe.pipeline import spec as spec_lib
from seqpipe.run import config as config_lib
from seqpipe.targets import hlo
from seqpipe.tools import step_cost

SCHEDULES = schedule_lib.SCHEDULES
MESHES = ((1, 1), (1, 2), (1, 4), (2, 4), (1, 8))
SEGMENTS = (1, 2, 3, 4)
PARTITIONS = ("uniform", "flops")
MICROBATCHES = ("fewer", "equal", "more")  # than stages
VIRTUAL = (1, 2)
ATTENTION = ("xla", "blockwise")  # the pipelined model's; the others test_attention checks
FACTORS = (SCHEDULES, MESHES, SEGMENTS, PARTITIONS, MICROBATCHES, VIRTUAL, ATTENTION, MODELS)


def valid(schedule, mesh, segments, part, relation, virtual, attention="auto", arch="gpt"):
    interleaved = schedule_lib.GENERATORS[schedule].interleaved
    if virtual > 1 and not interleaved:
        return False
    if interleaved and virtual == 1:
        return False  # the same table as the plain schedule
    if part == "flops" and segments == 1:
        return False  # one segment: nothing to partition
    return microbatch_count(relation, mesh[1], virtual) >= 1


def case_id(case):
    schedule, (d, s), k, part, rel, v, *rest = case
    return "-".join([f"{schedule}-{d}x{s}-K{k}-{part}-M{rel}-V{v}", *rest])


# Every pair of factor values in at least one case of the default run; the rest in the shards.
SAMPLE = all_pairs(FACTORS, valid)
CASES = matrix(FACTORS, valid)


def test_the_sample_holds_every_pair_of_the_full_matrix():
    """What the default run checks: each pair of factor values of some valid case."""
    pairs = lambda c: {(i, c[i], j, c[j]) for i in range(len(c)) for j in range(i)}  # noqa: E731
    full = full_product(FACTORS, valid)
    assert set().union(*map(pairs, SAMPLE)) == set().union(*map(pairs, full))
    assert len(set(SAMPLE)) == len(SAMPLE) and len(CASES) == len(full)
    # No smaller sample holds them all: the schedule x mesh pairs alone need one case
    # each (35 with the two zero-bubble schedules); the greedy sample is at most two over.
    floor = len({(c[0], c[1]) for c in full})
    assert floor <= len(SAMPLE) <= floor + 2, (floor, len(SAMPLE))


@pytest.mark.oldest  # also on the oldest supported release
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_pipeline_matches_reference(case):
    check(make_config(*case))


@pytest.mark.slow
@pytest.mark.parametrize("case", SAMPLE, ids=case_id)
def test_pipeline_keeping_every_residual_matches_reference(case):
    """The sample again under `remat=none`: each layer's residuals stashed and rebuilt
    (`remat_strategies.KeepLayerResiduals`) in every schedule, mesh and segment count of it."""
    config = make_config(*case)
    config.pipeline.remat = "none"
    check(config)


# Uneven layer splits (`pipeline.layers_per_stage`): a stage with fewer layers than the
# deepest pads its block with zero layers and skips them (a lax.cond per layer), under
# every remat policy; with several segments, so the skipped layers' K/V and cotangents
# are in play. (schedule, mesh, segments, layers, split, remat); the last three under
# make test-all (each remat policy but `layer` is in the first three).
UNEVEN_CASES = [
    ("seq_zb_h1", (1, 2), 2, 3, "2,1", "none"),
    ("seq_zb_h1", (1, 2), 3, 3, "2,1", "full_layer"),  # padding layers in the layer loop
    ("seq1f1b", (1, 4), 4, 9, "flops", "dots"),
]
UNEVEN_MORE = [
    ("seq1f1b", (2, 4), 3, 7, "2,2,2,1", "full"),
    ("1f1b", (1, 4), 1, 6, "1,2,2,1", "layer"),
    ("gpipe", (2, 2), 2, 5, "3,2", "none"),
]


@pytest.mark.parametrize(
    "case", sampled(UNEVEN_CASES, UNEVEN_MORE), ids=lambda c: "-".join(map(str, c))
)
def test_uneven_layer_split_matches_reference(case):
    schedule, mesh, segments, layers, split, policy = case
    base = (schedule, mesh, segments, "uniform", "more", 1)
    config = make_config(*base)
    config.model.num_layers = layers
    config.pipeline.update(layers_per_stage=split, remat=policy)
    config_lib.validate(config)
    spec = executor.make_spec(config)
    assert spec.uneven and sum(spec.layers_per_chunk) == layers
    check(config)


# bfloat16 compute on float32 parameters, as every real config runs, against the reference
# in the same dtypes: one case per schedule, each with several segments (so the K/V prefix,
# its gradient and the segments' offsets are all in play), on a 1 x 2 or 2 x 2 mesh.
BF16_CASES = [
    ("gpipe", (1, 2), 2, "uniform", "equal", 1),
    ("1f1b", (2, 2), 3, "flops", "more", 1),
    ("seq1f1b", (1, 2), 3, "uniform", "more", 1),
    ("interleaved_1f1b", (2, 2), 2, "uniform", "equal", 2),
    ("seq1f1b_interleaved", (1, 2), 4, "flops", "equal", 2),
    ("seq_zb_h1", (2, 2), 3, "flops", "more", 1),
]


# bfloat16 keeps 8 significant bits. The pipeline rounds in another order than the
# reference (attention segment by segment against a cached prefix, gradients summed per
# micro-batch and segment), so the rule is float32's with bfloat16's noise: each within
# `noise.FACTOR` times the bfloat16 reference's own distance from the float64 model.
@pytest.mark.parametrize("case", BF16_CASES, ids=case_id)
def test_pipeline_matches_reference_in_bfloat16(case):
    config = make_config(*case)
    config.model.dtype = "bfloat16"  # param_dtype stays float32
    check(config)


def test_bfloat16_residual_stash_is_stored_as_words_and_matches_reference():
    """Under remat=none a bf16 forward stashes its residuals as uint16 words (on CPU a
    bf16 slot write converts its window to float32); read back, they give the
    reference's gradients."""
    case = ("seq1f1b", (1, 2), 3, "uniform", "more", 1)
    config = make_config(*case)
    config.model.dtype = "bfloat16"
    config.pipeline.remat = "none"
    spec = executor.make_spec(config)
    stored = [b.dtype for group in carry.of_spec(spec, 2).saved for b in group]
    kept = [a.dtype for a in units.SegmentUnit(spec, 0).saved_avals(2)]
    assert jnp.bfloat16 in kept and jnp.bfloat16 not in stored and np.uint16 in stored
    check(config)


# Every policy on two-layer chunks (so `layer` and `dots` checkpoint inside a unit's scan),
# with unequal segments, interleaving and a data axis among the cases.
REMAT_CASES = [
    ("none", ("seq1f1b", (1, 2), 3, "uniform", "more", 1)),
    ("none", ("seq1f1b_interleaved", (2, 2), 2, "flops", "equal", 2)),
    ("dots", ("seq1f1b", (2, 2), 4, "flops", "equal", 1)),
    ("dots", ("1f1b", (1, 4), 1, "uniform", "fewer", 1)),
    ("layer", ("seq1f1b", (1, 2), 2, "uniform", "more", 1)),
    ("full_layer", ("seq1f1b", (1, 2), 3, "flops", "more", 1)),
    ("full_layer", ("seq_zb_h1", (1, 2), 2, "uniform", "equal", 1)),  # split B and W
    ("none", ("seq_zb_h1", (1, 2), 3, "flops", "more", 1)),  # B's residuals, W's inputs kept
]


@pytest.mark.parametrize(
    "remat, case", REMAT_CASES, ids=lambda x: x if isinstance(x, str) else case_id(x)
)
def test_every_remat_policy_matches_reference(remat, case):
    """pipeline.remat changes what a forward keeps, never the numbers."""
    config = make_config(*case)
    config.model.num_layers *= 2
    config.pipeline.remat = remat
    check(config)
    spec = executor.make_spec(config)
    mesh = sharding.make_mesh(*case[1])
    params = jax.eval_shape(lambda: model.init_params(spec.cfg, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((config.train.global_batch_size, SEQ_LEN + 1), np.int32)
    jaxpr = jax.make_jaxpr(lambda p, t: executor.loss_and_grads(p, t, spec, mesh))(params, tokens)
    # The policy is really applied: layers checkpointed exactly where a policy asks.
    assert ("remat" in str(jaxpr)) == (remat in ("full_layer", "layer", "dots"))


def test_remat_policies_agree_everywhere():
    """The config offers exactly the table's policies (and `auto`, which picks one of them),
    and each names real checkpoints."""
    assert config_lib.REMAT_POLICIES == (*remat.POLICIES, "auto")
    for policy in remat.POLICIES.values():
        for checkpoint in (policy.checkpoint, policy.reference):
            assert checkpoint is None or checkpoint in model.CHECKPOINT_POLICIES


def test_each_policy_runs_by_the_strategy_its_row_names():
    """A `remat.POLICIES` row names the `remat_strategies` class that runs its forward and
    backward; the unit asks that class, and what the row says of residuals is what the
    class keeps."""
    for name, policy in remat.POLICIES.items():
        named = remat_strategies.named(policy.strategy)
        assert named.keeps_residuals == policy.keeps_residuals, name
        config = make_config("seq1f1b", (1, 2), 2, "uniform", "equal", 1)
        config.pipeline.remat = name
        spec = executor.make_spec(config)
        assert type(units.strategy(spec)) is named
        assert type(units.SegmentUnit(spec, 1).strategy) is named
    with pytest.raises(ValueError, match="no remat strategy 'Nothing'"):
        remat_strategies.named("Nothing")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_broken_kv_gradient_is_caught(monkeypatch, dtype):
    """The oracle can fail, in either compute dtype: dropping the K/V prefix cotangents
    (each segment sees the cached K/V as constants) breaks the gradients."""
    config = make_config("seq1f1b", (1, 2), 3, "uniform", "equal", 1)
    config.model.dtype = dtype
    cfg = executor.make_spec(config).cfg
    oracle_cfg = dataclasses.replace(cfg, attention="xla")
    references(oracle_cfg, config.train.global_batch_size, SEQ_LEN, False)  # unbroken
    stop, original = jax.lax.stop_gradient, model.layer

    def detached(p, x, k, v, offset, cfg, *taps):
        return original(p, x, stop(k), stop(v), offset, cfg, *taps)

    monkeypatch.setattr(model, "layer", detached)
    with pytest.raises(AssertionError, match="gradient or loss off"):
        check(config)


def test_step_hlo_has_transfers_in_loop_and_no_data_all_reduce():
    config = make_config("seq1f1b", (2, 4), 4, "uniform", "more", 1)
    spec = executor.make_spec(config)
    mesh = sharding.make_mesh(2, 4)
    params = jax.eval_shape(lambda: model.init_params(spec.cfg, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct(
        (config.train.global_batch_size, SEQ_LEN + 1),
        np.int32,
        sharding=sharding.batch_sharding(mesh),
    )
    text = (
        jax.jit(lambda p, t: executor.loss_and_grads(p, t, spec, mesh))
        .lower(params, tokens)
        .compile()
        .as_text()
    )
    comps = hlo.computations(text)
    assert hlo.loop_bodies(comps), "no while loop in the compiled step"
    inside = hlo.inside_loops(comps)
    loop_text = "\n".join(comps[n] for n in inside)
    outside = "\n".join(v for k, v in comps.items() if k not in inside)
    assert "collective-permute" in loop_text
    assert "all-reduce" not in loop_text
    assert "all-reduce" in outside  # the one pmean over data, after the loop


# One case per schedule, several meshes and segment counts, unequal segments among them.
EVAL_CASES = [
    ("gpipe", (1, 2), 2, "uniform", "equal", 1),
    ("1f1b", (2, 2), 1, "uniform", "more", 1),
    ("seq1f1b", (1, 4), 3, "flops", "fewer", 1),
    ("interleaved_1f1b", (1, 2), 1, "uniform", "equal", 2),
    ("seq1f1b_interleaved", (2, 2), 2, "flops", "more", 2),
]


@pytest.mark.parametrize("case", EVAL_CASES, ids=case_id)
def test_pipelined_eval_matches_the_model(case):
    """Evaluation runs the training table's forwards alone on the same stages and
    segments: its loss equals the un-pipelined model's, and the compiled program moves
    activations between stages instead of gathering the layer stack onto every device."""
    config = make_config(*case)
    spec = spec_lib.forward_only(executor.make_spec(config))
    mesh = sharding.make_mesh(*case[1])
    params = model.init_params(spec.cfg, jax.random.key(0))
    tokens = jax.random.randint(
        jax.random.key(1), (config.train.global_batch_size, SEQ_LEN + 1), 0, spec.cfg.vocab_size
    )
    want = float(jax.jit(lambda p, t: model.loss(p, t, spec.cfg))(params, tokens))
    tokens = jax.device_put(tokens, sharding.batch_sharding(mesh))
    params = layout.to_stage_order(params, spec.placement)  # as the state holds them
    step = jax.jit(lambda p, t: executor.eval_loss(p, t, spec, mesh))
    np.testing.assert_allclose(float(step(params, tokens)), want, rtol=LOSS_RTOL)
    collectives = hlo.count_collectives(step.lower(params, tokens).compile().as_text())
    assert collectives["all-gather"] == collectives["all-to-all"] == 0
    assert (collectives["collective-permute"] > 0) == (case[1][1] > 1)


def _take(layout, unit):
    """What `layout` stashes of a fresh trace of one layer of `unit` (abstract)."""
    cfg, rows = unit.spec.cfg, 2
    kv = (1, unit.n, rows, unit.spec.kv_len, cfg.local_heads, cfg.head_dim)

    def trace(p, x, words_k, words_v):
        at = kv_cache.Prefix(words_k, words_v, jnp.int32(0), jnp.int32(0))
        prefix = unit.layer_prefix(rows, at)
        _, pullback = unit.kept_layer_vjp(p, x, *prefix)
        return layout.take(pullback, (p, *prefix), f"segment {unit.seg}")

    chunk, _, x_in, *_ = unit.avals(rows)
    p = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), chunk)
    x = jax.ShapeDtypeStruct((rows, unit.length, cfg.d_model), x_in.dtype)
    words = jax.ShapeDtypeStruct(kv, kv_cache.storage_dtype(cfg.dtype))
    return jax.eval_shape(trace, p, x, words, words)


def test_the_executors_residual_layout_is_checked_against_the_probe():
    """The backward rebuilds each layer's vjp from a probe's layout; the forward stashes
    by it (`take`), which tells segments' layouts apart (under `xla`, whose prefix
    probabilities differ in shape; `blockwise` keeps nothing prefix-shaped)."""
    config = make_config("seq1f1b", (1, 2), 2, "uniform", "equal", 1, "xla")
    config.pipeline.remat = "none"
    spec = executor.make_spec(config)
    first, second = (units.SegmentUnit(spec, k) for k in (0, 1))
    kept = _take(first.layer_layout(2), first)  # a second trace of segment 0's layer
    stored = first.layer_layout(2).stored
    assert tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in kept) == stored
    with pytest.raises(AssertionError, match="segment 0: the forward's residuals differ"):
        _take(second.layer_layout(2), first)  # its prefix differs


@pytest.mark.parametrize("remat", ["none", "dots"])
def test_residuals_are_written_and_read_a_layer_at_a_time(remat):
    """Kept residuals go into their stash slot a layer at a time and come back the same way
    (`remat_strategies.KeepLayerResiduals`): no dynamic slice or update of a stash buffer
    ([slots, n, ...]) spans more than one layer of one slot. Under a vjp of the whole chunk the
    executor wrote and read whole slots: copies of every layer's residuals per unit."""
    config = make_config("seq1f1b", (1, 2), 3, "uniform", "more", 1)
    config.model.num_layers = 4  # two layers a chunk
    config.pipeline.remat = remat
    spec = executor.make_spec(config)
    mesh = sharding.mesh_of(config)
    params = jax.eval_shape(lambda: model.init_params(spec.cfg, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((config.train.global_batch_size, SEQ_LEN + 1), np.int32)
    step = jax.jit(lambda p, t: executor.loss_and_grads(p, t, spec, mesh))
    module = step_cost.Module(step.lower(params, tokens).compile().as_text())
    rows = config.train.global_batch_size // config.pipeline.microbatches
    stash = {tuple(b.shape) for group in carry.of_spec(spec, rows).saved for b in group}
    kv = tuple(carry.of_spec(spec, rows).kv_k.shape)
    assert spec.chunk_layers == 2 and stash and kv not in stash
    windows = []
    for comp in module.comps:
        types = module.types(comp)
        for i in module.comps[comp]:
            if i.op == "dynamic-update-slice" and tuple(step_cost.dims_of(i.type)) in stash:
                windows.append(step_cost.dims_of(types[i.operands[1]]))
            buffer = step_cost.dims_of(types.get(i.operands[0], "")) if i.operands else []
            if i.op == "dynamic-slice" and tuple(buffer) in stash:
                windows.append(step_cost.dims_of(i.type))
    assert windows and all(w[:2] == [1, 1] for w in windows), windows


def test_a_residual_the_probe_saw_constant_is_rebuilt_from_the_probe():
    """A kernel's constant residual (splash's mask tables) is a constant in the probe's
    abstract trace but may be a tracer in the executor's (JAX lifts it into a
    `shard_map` trace): the forward leaves it out of the stash and the backward's
    rebuilt vjp uses the probe's constant."""
    table = np.arange(1, 5, dtype=np.float32)

    def scale(by):
        @jax.custom_vjp
        def f(x):
            return x * by

        f.defvjp(lambda x: (x * by, (by,)), lambda res, g: (g * res[0],))
        return f

    found = []

    def probe(x):
        _, vjp = jax.vjp(scale(table), x)
        found.append(units.ResidualLayout.split(vjp, (x,))[0])

    jax.eval_shape(probe, jax.ShapeDtypeStruct((4,), jnp.float32))
    layout = found[0]

    @jax.jit
    def forward_then_backward(x):
        by = table + 0 * x.sum()  # the same values, as a tracer
        _, vjp = jax.vjp(scale(by), x)
        stored = layout.take(vjp, (x,), "test")
        assert stored == []  # nothing to stash: the table is the probe's constant
        return layout.rebuild(stored, (x,))(jnp.ones(4))[0]

    np.testing.assert_array_equal(forward_then_backward(jnp.zeros(4)), table)


def _step_jaxpr(config):
    """(abstract parameters, the jaxpr of the pipelined loss and gradients) of a config
    on a 1 x 2 mesh."""
    spec = executor.make_spec(config)
    mesh = sharding.make_mesh(1, 2)
    params = jax.eval_shape(lambda: model.init_params(spec.cfg, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((config.train.global_batch_size, SEQ_LEN + 1), np.int32)
    jaxpr = jax.make_jaxpr(lambda p, t: executor.loss_and_grads(p, t, spec, mesh))(params, tokens)
    return params, jaxpr


@pytest.mark.parametrize("policy", ["full", "full_layer", "none"])
def test_weights_are_cast_once_a_step_where_the_policy_says_so(policy):
    """bf16 compute: the stage's float32 weights are cast once, before the tick loop (no
    unit converts them per layer), except under `full_layer`, which keeps no copy."""
    config = make_config("seq1f1b", (1, 2), 2, "uniform", "equal", 1)
    config.model.dtype = "bfloat16"
    config.pipeline.remat = policy
    params, jaxpr = _step_jaxpr(config)
    (body,) = [e.params["jaxpr"] for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    casts = [
        e
        for e in body.eqns  # the stage's program outside its tick loop
        if e.primitive.name == "convert_element_type"
        and e.invars[0].aval.dtype == np.float32
        and e.outvars[0].aval.dtype == jnp.bfloat16
    ]
    n_weights = len(jax.tree.leaves(params))
    assert len(casts) == (n_weights if remat.POLICIES[policy].casts_once else 0)


def _scan_outputs(jaxpr):
    """The outputs of every scan in `jaxpr`, nested ones too."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield from eqn.outvars
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a closed jaxpr's
                if hasattr(sub, "eqns"):
                    yield from _scan_outputs(sub)


@pytest.mark.parametrize("policy", ["full_layer", "none"])
def test_layer_loops_add_gradients_in_place(policy):
    """A backward's layer loop adds each layer's gradients into the accumulator at the
    layer: no scan stacks a chunk's gradients as its output, a second copy of the
    accumulator (4.5 GiB a device for gpt_1b's 24 layers under `full_layer`)."""
    config = make_config("seq1f1b", (1, 2), 2, "uniform", "equal", 1)
    config.model.update(num_layers=4, d_ff=40, num_heads=4)  # no weight [n, b, L, D]-shaped
    config.pipeline.remat = policy
    params, jaxpr = _step_jaxpr(config)
    # A chunk's gradients, [n, ...] (the accumulator is [V, n, ...]).
    chunk = {(2, *leaf.shape[1:]) for leaf in jax.tree.leaves(params["layers"])}
    stacked = [v.aval.shape for v in _scan_outputs(jaxpr.jaxpr) if v.aval.dtype == np.float32]
    assert not [s for s in stacked if s in chunk], stacked


def test_splash_pipeline_keeping_residuals_matches_reference(monkeypatch):
    """splash (in Pallas interpret mode, as off a TPU it runs) through the layer stash: the
    carry's stash and the forward's layout come from two probes of one layer, and each
    must see splash's mask tables alike. When the kernel cached per shape held the first
    trace's tracers as its tables, the first probe saw constants and the next tracers to
    stash: the carry had fewer buffers than the forward kept, and the backward's read of
    the stash failed (`zip() argument 2 is longer than argument 1`, llama3_1_8b on v5p-64:
    4x2x4 interleaved_1f1b M=4 V=4 remat=dots). Loss and gradients against the reference."""
    from seqpipe.kernels import splash

    monkeypatch.setattr(
        splash, "splash_attention", functools.partial(splash.splash_attention, interpret=True)
    )
    splash._kernel.cache_clear()  # this trace is the first to build the kernel
    case = ("interleaved_1f1b", (1, 2), 1, "uniform", "equal", 2, "splash", "llama")
    config = make_config(*case)
    config.pipeline.remat = "dots"
    check(config)
