"""Tensor parallelism inside the pipeline (`mesh.tensor`, `seqpipe.parallel.tensor`): every schedule
against the un-pipelined reference on meshes with tensor in {2, 4}; the compiled step's
collectives (over `tensor` inside the units, none over `data` in the tick loop); configs
that cannot split refused in one line; a run resumed across (data, stage, tensor) meshes.

The default run takes an all-pairs sample of schedule x mesh x segments x remat x model;
the shards (`make test-shard`) run the rest of the product. The Llama-family model (`oracle.LLAMA`)
has 2 K/V heads: split over tensor=2, replicated (each device the one its query heads
read) over tensor=4.
"""

import jax
import numpy as np
import pytest
from helpers import PIPELINED, run_of, run_python, subprocess_env, tiny_args, tiny_config
from oracle import MODELS, SEQ_LEN, check, microbatch_count, tensor_config
from pairwise import all_pairs, full_product, sampled

from seqpipe import schedule as schedule_lib
from seqpipe.models import model
from seqpipe.parallel import sharding, tensor
from seqpipe.pipeline import executor
from seqpipe.run import config as config_lib
from seqpipe.targets import hlo
from seqpipe.train import aot, optim, trainer
from seqpipe.train import step as step_lib

SCHEDULES = schedule_lib.SCHEDULES
# (data, stage, tensor)
MESHES = ((1, 2, 2), (2, 2, 2), (1, 4, 2), (1, 2, 4), (1, 1, 2))
SEGMENTS = (1, 2, 3, 4)
REMAT = ("full", "none", "dots", "layer", "full_layer")
SAMPLED_REMAT = ("full", "none", "dots")  # `layer` and `full_layer` in the shards
FACTORS = (SCHEDULES, MESHES, SEGMENTS, REMAT, MODELS)


def valid(schedule, mesh, segments, remat, arch="gpt") -> bool:
    interleaved = schedule_lib.GENERATORS[schedule].interleaved
    return microbatch_count("more", mesh[1], 2 if interleaved else 1) >= 1


def case_id(case):
    schedule, (d, s, t), k, remat, *arch = case
    return "-".join([f"{schedule}-{d}x{s}x{t}-K{k}-{remat}", *arch])


# The sample: three meshes, K in (1, 3, 4) (K = 3 splits unequally) and three policies,
# so that the schedule's pairs with each set its size (21); the rest in the shards.
SAMPLE = all_pairs((SCHEDULES, MESHES[:2] + MESHES[3:4], (1, 3, 4), SAMPLED_REMAT, MODELS), valid)
SAMPLE.append(("seq1f1b", (1, 2, 2), 3, "full_layer", "gpt"))  # the per-layer recompute of `full`
# Replicated K/V heads (4 devices, 2 heads) under a split backward (W's gradients placed
# at the device's head) and with every residual kept.
SAMPLE += [("seq_zb_h1", (1, 2, 4), 3, "full", "llama"), ("seq1f1b", (1, 2, 4), 4, "none", "llama")]


@pytest.mark.parametrize("case", sampled(SAMPLE, full_product(FACTORS, valid)), ids=case_id)
def test_tensor_parallel_pipeline_matches_reference(case):
    check(tensor_config(*case))


def test_a_broken_sequence_split_is_caught():
    """The oracle can fail: a reduce-scatter whose transpose repeats this device's
    cotangent instead of all-gathering the devices' breaks the gradients."""
    case = ("seq1f1b", (1, 2, 2), 2, "full")
    original = tensor._reduce_scatter_bwd

    def repeated(name, axis, _, g):
        return (jax.numpy.concatenate([g, g], axis=axis),)

    tensor.reduce_scatter.defvjp(tensor._reduce_scatter_fwd, repeated)
    try:
        with pytest.raises(AssertionError, match="gradient or loss off"):
            check(tensor_config(*case))
    finally:
        tensor.reduce_scatter.defvjp(tensor._reduce_scatter_fwd, original)


def _compiled_text(config) -> str:
    spec = executor.make_spec(config)
    mesh = sharding.mesh_of(config)
    params = jax.eval_shape(lambda: model.init_params(spec.cfg, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct(
        (config.train.global_batch_size, SEQ_LEN + 1),
        np.int32,
        sharding=sharding.batch_sharding(mesh),
    )
    step = jax.jit(lambda p, t: executor.loss_and_grads(p, t, spec, mesh))
    return step.lower(params, tokens).compile().as_text()


def test_tensor_collectives_run_inside_the_units_and_data_ones_after_the_loop():
    """2 x 2 x 2: inside the tick loop every all-gather, reduce-scatter and all-reduce
    runs over a tensor group (two adjacent devices sharing data and stage), the only
    other collectives are the stage ring's permutes; over `data`, one pmean after it."""
    config = tensor_config("seq1f1b", (2, 2, 2), 2, "full")
    mesh = sharding.mesh_of(config)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)[:, :, 0]  # [data, stage, tensor]
    tensor_groups = frozenset(frozenset(ids[d, s].tolist()) for d in range(2) for s in range(2))
    data_groups = frozenset(frozenset(ids[:, s, t].tolist()) for s in range(2) for t in range(2))
    comps = hlo.computations(_compiled_text(config))
    inside = hlo.inside_loops(comps)
    loop = "\n".join(comps[n] for n in inside)
    after = "\n".join(v for k, v in comps.items() if k not in inside)
    in_loop = hlo.collective_groups(loop)
    assert {op for op, _ in in_loop} >= {"all-gather", "reduce-scatter", "all-reduce"}
    assert all(groups == tensor_groups for _, groups in in_loop), in_loop
    assert "collective-permute" in loop
    assert any(groups == data_groups for _, groups in hlo.collective_groups(after))


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("model.num_heads", 2, "model.num_heads=2 is not divisible by mesh.tensor=4"),
        ("model.d_ff", 30, "model.d_ff=30 is not divisible by mesh.tensor=4"),
        ("model.vocab_size", 62, "model.vocab_size=62 is not divisible by mesh.tensor=4"),
        ("train.seq_len", 18, "mesh.tensor=4"),
    ],
)
def test_a_model_that_does_not_split_is_refused_in_one_line(key, value, message):
    c = tensor_config("seq1f1b", (1, 2, 4), 2, "full")
    section, leaf = key.split(".")
    c[section][leaf] = value
    with pytest.raises(config_lib.ConfigError, match=message) as e:
        config_lib.validate(c, num_devices=8)
    assert "\n" not in str(e.value)


def test_kv_heads_that_neither_split_nor_replicate_are_refused_in_one_line():
    """6 K/V heads on 4 tensor devices: 4 does not divide 6, nor is it a multiple of it."""
    c = tensor_config("seq1f1b", (1, 2, 4), 2, "full")
    c.model.update(d_model=48, num_heads=12, num_kv_heads=6)
    with pytest.raises(config_lib.ConfigError, match="mesh.tensor=4 neither divides the 6") as e:
        config_lib.validate(c, num_devices=8)
    assert "\n" not in str(e.value)
    c.model.num_kv_heads = 2  # replicated: each device holds the K/V head it reads
    config_lib.validate(c, num_devices=8)


def test_mesh_products_count_the_tensor_axis():
    c = tensor_config("seq1f1b", (1, 2, 2), 2, "full")
    with pytest.raises(config_lib.ConfigError, match="mesh.data \\* mesh.stage \\* mesh.tensor"):
        config_lib.validate(c, num_devices=8)
    c.mesh.data = -1
    assert config_lib.resolve(c, 8).mesh.data == 2


def test_hlo_replica_groups_in_every_form():
    assert hlo._parse_groups("{{0,1},{2,3}}") == {frozenset({0, 1}), frozenset({2, 3})}
    assert hlo._parse_groups("[2,2]<=[4]") == {frozenset({0, 1}), frozenset({2, 3})}
    assert hlo._parse_groups("[2,2]<=[2,2]T(1,0)") == {frozenset({0, 2}), frozenset({1, 3})}
    # jax 0.12's XLA names the mesh and the axes a group spans.
    mesh = "mesh['data'=2,'stage'=2,'tensor'=2]"
    assert hlo._parse_groups(mesh + " {'tensor'}") == {
        frozenset({2 * i, 2 * i + 1}) for i in range(4)
    }
    assert hlo._parse_groups(mesh + " {'data'}") == {frozenset({i, i + 4}) for i in range(4)}
    assert hlo._parse_groups(mesh + " {'stage','tensor'}") == {
        frozenset(range(4)),
        frozenset(range(4, 8)),
    }


def test_a_run_resumes_across_tensor_meshes(tmp_path):
    """Saved on 2 x 2 x 2, resumed on 1 x 4 x 2 and then 1 x 2 x 4 (the sharded optimizer
    on where there are replicas): the losses of a straight run on 2 x 2 x 2."""
    split = {**PIPELINED, "model.num_heads": "4", "model.d_ff": "64"}
    meshes = {
        "2x2x2": {"mesh.data": "2", "mesh.stage": "2", "mesh.tensor": "2"},
        "1x4x2": {"mesh.data": "1", "mesh.stage": "4", "mesh.tensor": "2"},
        "1x2x4": {"mesh.data": "1", "mesh.stage": "2", "mesh.tensor": "4"},
    }

    def config(mesh, stop):
        return tiny_config(**{**split, **meshes[mesh], "train.stop_at": str(stop)})

    straight = trainer.run(config("2x2x2", 3), str(tmp_path / "a"))
    run = str(tmp_path / "b")
    resumed = trainer.run(config("2x2x2", 1), run)
    resumed += trainer.run(config("1x4x2", 2), run)
    resumed += trainer.run(config("1x2x4", 3), run)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    np.testing.assert_allclose(
        [r["loss"] for r in resumed], [r["loss"] for r in straight], rtol=1e-5
    )


def test_verify_checks_a_tensor_parallel_pipeline(tmp_path):
    """`python -m seqpipe.verify --config.mesh.tensor=2`: the configured pipeline on a
    1 x 2 x 2 mesh against the reference, on a real batch."""
    overrides = {
        **PIPELINED,
        "mesh.data": "1",
        "mesh.stage": "2",
        "mesh.tensor": "2",
        "data.cache_dir": str(tmp_path / "cache"),
    }
    args = tiny_args(**overrides)
    result = run_python("-m", "seqpipe.verify", *args, env=subprocess_env(devices=4))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("OK")


def test_the_sharded_optimizer_halves_moments_on_two_replicas_with_tensor_split():
    """On 2 x 2 x 2, every weight's moments are split over tensor (by the weight's own
    split) and over the two replicas (another dimension): optimizer bytes per device halve
    with train.shard_optimizer=on, and the parameters stay whole on each replica."""
    sizes = {}
    for mode in ("off", "on"):
        c = tensor_config("seq1f1b", (2, 2, 2), 2, "full")
        c.train.shard_optimizer = mode
        mesh = sharding.mesh_of(c)
        state = step_lib.abstract_state(run_of(c), mesh, optim.make_optimizer(c.train))
        sizes[mode] = {k: aot._bytes_per_device(v) for k, v in state.items()}
        moments = [
            x.sharding.spec
            for path, x in jax.tree_util.tree_leaves_with_path(state["opt_state"])
            if jax.tree_util.keystr(path).endswith("['layers']['wq']")
        ]
        assert len(moments) == 2  # Adam's two
        for spec in moments:
            assert spec[0] == sharding.STAGE and spec[2] == sharding.TENSOR
            assert (sharding.DATA in spec) == (mode == "on")
    assert sizes["on"]["params"] == sizes["off"]["params"]
    assert sizes["on"]["opt_state"] * 2 == pytest.approx(sizes["off"]["opt_state"], rel=0.01)


def test_each_tensor_device_carries_its_share_of_the_buffers():
    """Messages, stashed inputs and head cotangents hold 1/t of a segment's positions, the
    K/V buffers 1/t of the heads (from the spec alone, outside the step)."""
    from seqpipe.pipeline import carry

    sizes = {}
    for t in (1, 2, 4):
        c = tensor_config("seq1f1b", (1, 2, t), 4, "full")
        sizes[t] = carry.of_spec(executor.make_spec(c), 2).nbytes()
    for t in (2, 4):
        for field in ("recv_fwd", "recv_bwd", "saved", "head_dy", "kv_k", "dkv_v"):
            assert sizes[t][field] * t == sizes[1][field], field


@pytest.mark.parametrize("module", ["seqpipe.tools.bench", "seqpipe.tools.accel"])
def test_the_benchmarks_refuse_a_tensor_parallel_mesh_in_one_line(module, capsys):
    import importlib

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(module).main(["--quick", "--config.mesh.tensor=2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "mesh.tensor=2 is not supported there" in err
