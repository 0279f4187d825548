"""Context parallelism (`mesh.context`, `seqpipe.parallel.context`): every segment's
positions split zigzag over C devices, against the un-pipelined reference (loss and every
gradient), for C in {2, 4}, with tensor parallelism, grouped-query heads and packed rows;
broken splits caught; the local rows, the attention's balance and bad input.

The default run takes a hand-picked sample (both C, with tensor 2, GQA and packed rows
among them); the shards run an all-pairs sample of the whole matrix besides, every
schedule on every mesh.
"""

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import REPO, run_python, subprocess_env, tiny_config
from oracle import CONTEXT_SEQ_LEN as SEQ_LEN
from oracle import LLAMA, LOSS_RTOL, check, context_config, randomized_gains
from pairwise import all_pairs, sampled

from seqpipe import schedule as schedule_lib
from seqpipe.kernels import attention, kv_cache
from seqpipe.models import model
from seqpipe.parallel import context, sharding
from seqpipe.pipeline import carry, executor
from seqpipe.pipeline import spec as spec_lib
from seqpipe.run import config as config_lib
from seqpipe.train import trainer

HF_GQA = REPO / "tests" / "fixtures" / "hf" / "llama_gqa_llama3"  # made by transformers


# (schedule, (data, stage, context, tensor), segments, remat, model, rows, attention)
SAMPLE = [
    ("seq1f1b", (1, 2, 2, 1), 2, "full", "llama", "plain", "blockwise"),
    ("seq1f1b", (1, 2, 4, 1), 4, "none", "gpt", "packed", "xla"),
    ("seq1f1b_interleaved", (1, 2, 2, 2), 2, "dots", "llama", "packed", "blockwise"),
    ("seq_zb_h1", (1, 2, 2, 2), 4, "full", "llama", "plain", "blockwise"),
    ("seq_zb_h1", (1, 2, 4, 1), 2, "none", "llama", "packed", "blockwise"),
    ("1f1b", (2, 2, 2, 1), 1, "full_layer", "gpt", "plain", "xla"),
    ("seq1f1b", (1, 1, 4, 2), 3, "layer", "gpt", "plain", "blockwise"),
]
FACTORS = (
    schedule_lib.SCHEDULES,
    ((1, 2, 2, 1), (1, 2, 4, 1), (1, 2, 2, 2), (2, 2, 2, 1), (1, 1, 4, 2)),
    (1, 2, 4),
    ("full", "none", "dots", "layer", "full_layer"),
    ("gpt", "llama"),
    ("plain", "packed"),
    ("xla", "blockwise"),
)
# Every schedule on every context mesh at least once (the pairs), in the shards.
PAIRS = all_pairs(FACTORS, lambda *c: True)


def case_id(case):
    schedule, (d, s, c, t), k, *rest = case
    return "-".join([f"{schedule}-{d}x{s}x{c}x{t}-K{k}", *rest])


@pytest.mark.parametrize("case", sampled(SAMPLE, PAIRS), ids=case_id)
def test_context_parallel_pipeline_matches_reference(case):
    schedule, mesh, k, remat, arch, rows, attention_name = case
    check(context_config(schedule, mesh, k, remat, arch, attention_name), rows == "packed")


@pytest.mark.parametrize("kernel", [pytest.param("splash", marks=pytest.mark.slow), "pallas_gpu"])
def test_the_pallas_kernels_take_the_split(monkeypatch, kernel):
    """splash and pallas_gpu (in Pallas interpret mode, as they run off their chips) on
    packed rows split over 2 context devices: each piece's call is their usual contract."""
    from seqpipe.kernels import pallas_gpu, splash

    if kernel == "splash":
        fn = functools.partial(splash.splash_attention, interpret=True)
        monkeypatch.setattr(splash, "splash_attention", fn)
        splash._kernel.cache_clear()
    else:
        tiles = pallas_gpu.Blocks(forward=(4, 2), dkv=(4, 2), dq=(2, 4))
        fn = functools.partial(pallas_gpu.pallas_gpu_attention, blocks=tiles, interpret=True)
        monkeypatch.setattr(pallas_gpu, "pallas_gpu_attention", fn)
    config = context_config("seq1f1b", (1, 2, 2, 1), 2, "full", "llama", kernel)
    check(config, packed=True)


# ------------------------------------------------------------------ broken splits fail


def _own_keys_only(x):
    """A gather in which every device sees only its own K/V, repeated."""
    return jnp.stack([x] * jax.lax.axis_size(context.AXIS))


def _starts_of_the_next_device(split):
    return np.roll(np.array([split.starts(c) for c in range(split.size)], np.float64), 1, axis=0)


ORIGINAL_BLOCK = kv_cache.Prefix.block


def _prefix_read_one_position_late(self, which, start, size, dtype):
    """The local prefix read out of the K/V cache one position past where it lies."""
    return ORIGINAL_BLOCK(self, which, start + 1, size, dtype)


@pytest.mark.parametrize(
    "where, name, broken",
    [
        (context, "_gather", _own_keys_only),  # a device that misses the others' K/V
        (context, "_piece_starts", _starts_of_the_next_device),  # positions of the wrong pieces
        (kv_cache.Prefix, "block", _prefix_read_one_position_late),  # a prefix shard misread
    ],
    ids=["misses-kv", "wrong-positions", "prefix-offset"],
)
def test_a_broken_split_is_caught(monkeypatch, where, name, broken):
    """The oracle can fail: each break changes the loss or a gradient past tolerance
    (`blockwise` reads the local prefix out of the K/V cache where it lies)."""
    config = context_config("seq1f1b", (1, 2, 2, 1), 3, arch="llama", attention="blockwise")
    monkeypatch.setattr(where, name, broken)
    with pytest.raises(AssertionError):
        check(config)


# ------------------------------------------------------------------ the split itself


@pytest.mark.parametrize("lengths, size", [((16, 16), 2), ((8, 8, 16), 4), ((24,), 3)])
def test_local_rows_cover_the_sequence_once_in_zigzag_pieces(lengths, size):
    order = context.row_order(lengths, size)
    assert order.shape == (size, sum(lengths) // size)
    assert sorted(order.reshape(-1).tolist()) == list(range(sum(lengths)))
    offset = 0
    for length in lengths:  # device c holds pieces c and 2C - 1 - c of every segment
        h = length // (2 * size)
        for c in range(size):
            row = order[c][order[c] >= offset]
            row = row[row < offset + length] - offset
            assert row.tolist() == [
                *range(c * h, (c + 1) * h),
                *range((2 * size - 1 - c) * h, (2 * size - c) * h),
            ]
        offset += length


def test_rope_of_the_local_pieces_is_the_static_path():
    """Each device's pieces rotated at their places in the sequence: the whole row's
    rotation (float rounding apart: a piece's start angle is added in float32), llama3
    scaling included."""
    cfg = model.GPTConfig.from_config(
        dict(vocab_size=8, num_layers=1, d_model=16, num_heads=2, d_ff=8, **LLAMA_ROPE)
    )
    lengths, size = (16, 32), 4
    x = jax.random.normal(jax.random.key(0), (2, sum(lengths), 2, 8))
    whole = attention.rope(x, 0, cfg.rope_base, cfg.rope_scaling)
    order = context.row_order(lengths, size)
    local = [length // size for length in lengths]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:size]), (context.AXIS,))

    def on_device(x_local_rows):
        outs, start = [], 0
        for k in range(len(local)):
            split = context.Split(size, tuple(local[: k + 1]))
            piece = x_local_rows[:, start : start + local[k]]
            outs.append(context.rope(piece, split, cfg.rope_base, cfg.rope_scaling))
            start += local[k]
        return jnp.concatenate(outs, axis=1)

    rows = jnp.stack([x[:, o] for o in order])  # [C, b, L/C, H, E]
    spec = jax.sharding.PartitionSpec(context.AXIS)
    got = jax.shard_map(
        lambda r: on_device(r[0])[None], mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False
    )(rows)
    want = jnp.stack([whole[:, o] for o in order])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-6)


LLAMA_ROPE = {"rope_base": 500000.0, "rope_scaling": LLAMA["rope_scaling"]}


def test_every_device_does_the_same_attention_work():
    """The FLOP balance of the zigzag split, max over mean of the score entries each
    device's kernels compute (xla: every entry of its blocks), per segment and summed over
    a micro-batch: 1.0; a contiguous split of the same segments is far off."""
    lengths, size = (64, 64, 64, 64), 4
    local = [length // size for length in lengths]
    work = np.zeros(size)
    for k in range(len(lengths)):
        split = context.Split(size, tuple(local[: k + 1]))
        per_device = np.array(
            [sum(split.piece * (s + split.piece) for s in split.starts(c)) for c in range(size)]
        )
        assert per_device.max() / per_device.mean() == 1.0
        work += per_device
    assert work.max() / work.mean() == 1.0
    h = 64 // size  # segment 0 cut into C contiguous chunks instead
    contiguous = [h * (c * h + h) for c in range(size)]
    assert max(contiguous) / np.mean(contiguous) > 1.5


def test_each_device_keeps_its_share_of_the_residuals():
    """Under remat none with blockwise (the prefix read where it lies in the cache), a
    context device's stash of layer residuals is about 1/C of one device's: no residual is
    a copy of the prefix, nor of the keys gathered (0.78 when the prefix read out of the
    cache was an input of the checkpointed attention); K/V buffers are exactly 1/C."""
    sizes = {}
    for size in (1, 2):
        config = context_config("seq1f1b", (1, 2, size, 1), 4, "none", "llama", "blockwise")
        sizes[size] = carry.of_spec(executor.make_spec(config), 2).nbytes()
    assert sizes[2]["saved"] <= 0.55 * sizes[1]["saved"], (sizes[2]["saved"], sizes[1]["saved"])
    assert sizes[2]["kv_k"] * 2 == sizes[1]["kv_k"]


# ------------------------------------------------------------------ composes


def test_the_evaluation_under_context_is_the_models_loss():
    config = context_config("seq1f1b", (1, 2, 2, 1), 2, arch="llama")
    spec = spec_lib.forward_only(executor.make_spec(config))
    mesh = sharding.mesh_of(config)
    params = randomized_gains(model.init_params(spec.cfg, jax.random.key(0)))
    tokens = jax.random.randint(
        jax.random.key(1), (config.train.global_batch_size, SEQ_LEN + 1), 0, 64
    )
    want = model.loss(params, tokens, dataclasses.replace(spec.cfg, attention="xla"))
    got = jax.jit(lambda p, t: executor.eval_loss(p, t, spec, mesh))(
        params, jax.device_put(tokens, sharding.batch_sharding(mesh))
    )
    np.testing.assert_allclose(float(got), float(want), rtol=LOSS_RTOL)


def test_an_uneven_layer_split_under_context():
    config = context_config("seq1f1b", (1, 2, 2, 1), 2, "none", "llama")
    config.model.num_layers = 5
    config.pipeline.layers_per_stage = "3,2"
    check(config)


@pytest.mark.parametrize("packed", [pytest.param(False, marks=pytest.mark.slow), True])
def test_verify_is_ok_on_a_transformers_made_gqa_llama(tmp_path, packed):
    """`python -m seqpipe.verify --config hf:DIR` with mesh.context=2 over 2 stages: OK, on
    the fixture's tokenizer and a jsonl corpus of real text packed into rows."""
    corpus = tmp_path / "docs.jsonl"
    lines = [x.strip() for x in Path(json.__file__).read_text().splitlines() if x.strip()]
    corpus.write_text("".join(json.dumps({"text": x}) + "\n" for x in lines * 4))
    args = [
        "--config",
        f"hf:{HF_GQA}",
        "--config.mesh.context=2",
        "--config.mesh.stage=2",
        "--config.pipeline.schedule=seq1f1b",
        "--config.pipeline.segments=2",
        "--config.pipeline.microbatches=2",
        "--config.train.seq_len=64",
        "--config.train.global_batch_size=4",
        "--config.data.source=jsonl",
        f"--config.data.path={corpus}",
        "--config.data.text_key=text",
        f"--config.data.packing={'best_fit' if packed else 'none'}",
        f"--config.data.cache_dir={tmp_path / 'cache'}",
    ]
    result = run_python("-m", "seqpipe.verify", *args, env=subprocess_env(devices=4))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("OK")
    assert ("on packed rows" in result.stdout) == packed


def test_a_run_resumes_across_context_meshes(tmp_path):
    """Saved on stage 2 x context 2 x tensor 2, resumed on 2 replicas x context 2 (the
    sharded optimizer on) and then without context: the losses of the straight run."""
    base = {
        "mesh.data": "1",
        "mesh.stage": "2",
        "pipeline.schedule": "seq1f1b",
        "pipeline.microbatches": "2",
        "pipeline.segments": "2",
        "model.num_heads": "4",
        "train.seq_len": str(SEQ_LEN),
    }
    meshes = {
        "c2t2": {"mesh.context": "2", "mesh.tensor": "2"},
        "c2d2": {"mesh.context": "2", "mesh.data": "2"},
        "c1": {"mesh.data": "4"},
    }

    def config(mesh, stop):
        return tiny_config(**{**base, **meshes[mesh], "train.stop_at": str(stop)})

    straight = trainer.run(config("c2t2", 3), str(tmp_path / "a"))
    run = str(tmp_path / "b")
    resumed = trainer.run(config("c2t2", 1), run)
    resumed += trainer.run(config("c2d2", 2), run)
    resumed += trainer.run(config("c1", 3), run)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    np.testing.assert_allclose(
        [r["loss"] for r in resumed], [r["loss"] for r in straight], rtol=1e-5
    )


def test_the_context_axis_sits_between_stage_and_tensor():
    mesh = sharding.make_mesh(1, 2, jax.devices()[:8], tensor=2, context=2)
    assert mesh.axis_names == ("data", "stage", "context", "tensor")
    ids = np.vectorize(lambda d: d.id)(mesh.devices)[0]  # [stage, context, tensor]
    assert ids[0, 0].tolist() == [0, 1] and ids[0, :, 0].tolist() == [0, 2]


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "overrides, devices, message",
    [
        (
            {"train.seq_len": "36"},
            8,
            "mesh.context=4: seq_len 36 is not a multiple of 8 (with mesh.context=4 each "
            "segment is 8 equal pieces); change one of these keys",
        ),
        (
            {"mesh.context": "3"},
            8,
            "mesh.data * mesh.stage * mesh.context = 6 but 8 devices are visible",
        ),
        (
            {"mesh.data": "-1", "mesh.context": "3"},
            8,
            "mesh.stage * mesh.context = 6 does not divide the 8 visible devices",
        ),
        (
            {"pipeline.schedule": "none", "mesh.stage": "1", "mesh.data": "2"},
            8,
            "mesh.context=4 splits each segment over devices inside the pipeline; set "
            "pipeline.schedule",
        ),
        ({"mesh.context": "0"}, 8, "mesh.context"),
    ],
)
def test_bad_input_is_one_line(overrides, devices, message):
    base = {
        "mesh.data": "1",
        "mesh.stage": "2",
        "mesh.context": "4",
        "pipeline.schedule": "seq1f1b",
        "pipeline.microbatches": "2",
        "pipeline.segments": "2",
        "train.seq_len": "48",
    }
    with pytest.raises(config_lib.ConfigError) as e:
        config_lib.validate(tiny_config(**{**base, **overrides}), num_devices=devices)
    assert message in str(e.value) and "\n" not in str(e.value)
