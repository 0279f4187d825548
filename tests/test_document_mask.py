"""Packed documents (`seqpipe.models.document_mask`): the document mask in `xla` and `blockwise`,
RoPE at the rows' positions, the counted-target loss, and every schedule on packed rows against
the un-pipelined reference.

The oracles: a dense softmax with the explicit block-diagonal causal mask written here
(attention); each document run alone as its own row (the model: no key of another
document, positions from 0); the reference (`reference.loss_and_grads`) for the pipeline,
itself checked against the documents run alone. The default run takes an all-pairs sample
of the schedule matrix; the shards run the rest.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_of
from kernel_helpers import in_cache
from oracle import LLAMA, LOSS_RTOL, SEQ_LEN, check, make_config, randomized_gains, tensor_config
from packed_rows import layouts, on_device, packed_batch
from pairwise import all_pairs, full_product, sampled

from seqpipe import schedule as schedule_lib
from seqpipe.kernels import attention, blockwise
from seqpipe.models import document_mask, model, reference
from seqpipe.parallel import sharding
from seqpipe.pipeline import executor

NAMES = ("out", "dq", "dk_prefix", "dv_prefix", "dk_own", "dv_own")
TOL = 1e-5


# ------------------------------------------------------------------ attention


def dense_masked_attention(q, kp, vp, ks, vs, q_ids, kv_ids):
    """Softmax over (prefix, own) keys with the explicit block-diagonal causal mask:
    written without `seqpipe` so that the oracle shares no code with what it checks."""
    k, v = jnp.concatenate([kp, ks], 1), jnp.concatenate([vp, vs], 1)
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    q_len, k_len = q.shape[1], k.shape[1]
    causal = np.arange(k_len)[None, :] <= np.arange(q_len)[:, None] + (k_len - q_len)
    allowed = causal[None] & (q_ids[:, :, None] == kv_ids[:, None, :])  # [b, Q, K]
    s = jnp.einsum("bqhe,bkhe->bhqk", q, k) * q.shape[-1] ** -0.5
    s = jnp.where(allowed[:, None], s, -jnp.inf)
    return jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(s, axis=-1), v)


def ids_for(lengths_per_row, row_len):
    docs, _ = document_mask.pack_rows(lengths_per_row, row_len)
    return document_mask.kernel_ids(jnp.asarray(docs))


# Rows of 20: documents crossing every cut, one-token documents, one document, padding.
ROWS_20 = [(3, 1, 1, 9, 6), (20,), (7, 1, 5), (1, 12, 7)]


def segment_case(prefix_len, q_len, kv=3, seed=0):
    """q, k, v prefix, k, v own, dO and (q ids, kv ids) of the segment [P, P + Q) of
    ROWS_20 (4 rows, 3 query heads of width 8 over `kv` K/V heads)."""
    ids = ids_for(ROWS_20, 20)[:, : prefix_len + q_len]
    keys = jax.random.split(jax.random.key(seed), 4)
    b, length = ids.shape
    q = jax.random.normal(keys[0], (b, q_len, 3, 8))
    k, v = (jax.random.normal(key, (b, length, kv, 8)) for key in keys[1:3])
    g = jax.random.normal(keys[3], q.shape)
    arrays = (q, k[:, :prefix_len], v[:, :prefix_len], k[:, prefix_len:], v[:, prefix_len:])
    return arrays, g, (ids[:, prefix_len:], ids)


def out_and_grads(fn, arrays, g):
    out, vjp = jax.vjp(fn, *arrays)
    return (out, *vjp(g))


def cached_small_blocks(q, kp, vp, ks, vs, documents):
    """`blockwise.cached_attention` reading the prefix from a cache (test_attention's);
    kp, vp themselves are the sinks, so their cotangents are the prefix's."""
    cache = in_cache(kp, vp, q.dtype)
    return blockwise.cached_attention(q, cache, kp, vp, ks, vs, kp.shape[1], 4, 3, documents)


@functools.cache
def _jitted(name):
    def run(arrays, g, documents):
        if name == "dense":
            fn = lambda *a: dense_masked_attention(*a, *documents)  # noqa: E731
        elif name == "blockwise_small":  # blocks of 4 queries and 3 keys
            fn = functools.partial(blockwise.blockwise_attention, documents=documents)
            fn = functools.partial(fn, block_q=4, block_k=3)
        elif name == "blockwise_cached":
            fn = lambda *a: cached_small_blocks(*a, documents)  # noqa: E731
        else:
            fn = functools.partial(attention.attend, name, documents=documents)
        return out_and_grads(fn, arrays, g)

    return jax.jit(run)


SEGMENTS = ((0, 20), (7, 6), (13, 7), (19, 1))  # (prefix, queries)


IMPLEMENTATIONS = ("xla", "blockwise", "blockwise_small", "blockwise_cached")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("kv", [3, 1])
@pytest.mark.parametrize("cut", SEGMENTS, ids=lambda c: f"P{c[0]}Q{c[1]}")
def test_document_mask_matches_the_explicit_mask(cut, kv, impl):
    """Output and the five cotangents against the dense oracle, masked keys' exactly 0."""
    arrays, g, documents = segment_case(*cut, kv=kv)
    want = _jitted("dense")(arrays, g, documents)
    got = _jitted(impl)(arrays, g, documents)
    for name, x, y in zip(NAMES, got, want, strict=True):
        np.testing.assert_allclose(x, y, rtol=TOL, atol=TOL, err_msg=f"{name} at {cut}")
    # Keys no query of their row sees get exact zeros.
    unseen = ~np.asarray(document_mask.mask(*documents).any(1))  # [b, P + Q]
    prefix_len = cut[0]
    for name, x in zip(NAMES[2:], got[2:], strict=True):
        keys = unseen[:, :prefix_len] if "prefix" in name else unseen[:, prefix_len:]
        assert not np.any(np.asarray(x)[keys]), f"{name}: a key no query sees is not 0"


@pytest.mark.parametrize("impl", ["blockwise_small", "blockwise_cached"])
@pytest.mark.parametrize(
    "rows, skipped",
    [([(7, 13), (7, 5, 8)], 7), ([(4, 16), (4, 3, 13)], 3)],
    ids=["new-documents", "first-block"],
)
def test_blockwise_never_reads_the_key_blocks_before_the_first_visible_key(rows, skipped, impl):
    """The prefix keys [0, skipped) lie in blocks (of 3) wholly before every row's first
    visible key; they hold NaN. A block that were read and masked would still spread it
    (0 * NaN in P @ V and in dP = dO @ V^T); skipped, output and cotangents are the
    oracle's. With 7, the segment starts a new document in every row: no prefix read."""
    prefix_len, q_len = 7, 6
    ids = ids_for(rows, 20)[:, : prefix_len + q_len]
    documents = (ids[:, prefix_len:], ids)
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (2, q_len, 3, 8))
    k, v = (jax.random.normal(key, (2, prefix_len + q_len, 3, 8)) for key in keys[1:3])
    g = jax.random.normal(keys[3], q.shape)
    poisoned = [x.at[:, :skipped].set(jnp.nan) for x in (k, v)]
    split = lambda k, v: (
        q,
        k[:, :prefix_len],
        v[:, :prefix_len],
        k[:, prefix_len:],
        v[:, prefix_len:],
    )  # noqa: E731
    want = _jitted("dense")(split(k, v), g, documents)
    got = _jitted(impl)(split(*poisoned), g, documents)
    for name, x, y in zip(NAMES, got, want, strict=True):
        x = np.asarray(x)
        if "prefix" in name:  # the poisoned keys' own cotangents: zeros, unread
            x, y = x[:, skipped:], np.asarray(y)[:, skipped:]
        np.testing.assert_allclose(x, y, rtol=TOL, atol=TOL, err_msg=name)


def test_masked_keys_get_exact_zero_cotangents():
    """Row 1 (one document from 0) sees the whole prefix; row 2's segment starts a new
    document at 7: its prefix keys [0, 7) are another document's and get zeros."""
    arrays, g, documents = segment_case(7, 6)
    _, _, dk_prefix, dv_prefix, _, _ = _jitted("xla")(arrays, g, documents)
    assert not np.any(dk_prefix[2]) and not np.any(dv_prefix[2])
    assert np.all(np.any(dk_prefix[1] != 0, axis=(-1, -2)))


def test_without_documents_xla_is_todays_program():
    arrays, _, _ = segment_case(7, 6)
    plain = jax.make_jaxpr(attention.segment_attention)(*arrays)
    none = jax.make_jaxpr(lambda *a: attention.segment_attention(*a, None))(*arrays)
    assert str(plain) == str(none)


def test_mismatched_document_ids_are_refused_in_one_line():
    arrays, _, (q_ids, kv_ids) = segment_case(7, 6)
    with pytest.raises(ValueError, match="document ids cover 6 queries and 12 keys") as e:
        attention.attend("xla", *arrays, documents=(q_ids, kv_ids[:, 1:]))
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ RoPE and the model


def test_rope_at_the_rows_positions_is_the_static_path_bit_for_bit():
    x = jax.random.normal(jax.random.key(0), (2, 6, 2, 8))
    for offset in (0, 5):
        static = attention.rope(x, offset, 10000.0)
        pos = jnp.broadcast_to(jnp.arange(6) + offset, (2, 6))
        assert np.array_equal(attention.rope(x, offset, 10000.0, positions_BxQ=pos), static)


def test_rope_at_positions_has_the_rotations_gradient():
    x = jax.random.normal(jax.random.key(0), (2, 6, 2, 8))
    pos = jnp.asarray([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    _, vjp = jax.vjp(lambda x: attention.rope(x, 0, 10000.0, positions_BxQ=pos), x)
    g = jax.random.normal(jax.random.key(1), x.shape)
    # The rotation is orthogonal: its transpose applied to its output gives x back.
    rotated = attention.rope(x, 0, 10000.0, positions_BxQ=pos)
    (back,) = jax.vjp(lambda x: attention.rope(x, 0, 10000.0, positions_BxQ=pos), x)[1](rotated)
    np.testing.assert_allclose(back, x, rtol=1e-5, atol=1e-5)
    (dx,) = vjp(g)
    auto = jax.vjp(lambda x: _rope_by_autodiff(x, pos), x)[1](g)[0]
    np.testing.assert_allclose(dx, auto, rtol=1e-6, atol=1e-6)


def _rope_by_autodiff(x, pos):
    from seqpipe.kernels.rope import NO_SCALING, tables

    cos, sin = (jnp.asarray(t)[pos][:, :, None] for t in tables(np.arange(6), 8, 1e4, NO_SCALING))
    x1, x2 = jnp.split(x, 2, -1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def tiny(attention_name="xla", **kw) -> model.GPTConfig:
    dims = dict(vocab_size=61, num_layers=2, d_model=16, num_heads=2, d_ff=24)
    return model.GPTConfig(**(dims | kw), attention=attention_name)


LLAMA_TINY = {k: v for k, v in LLAMA.items() if k != "init_std"} | {"init_std": 0.2}


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("segments", [None, (4, 9), (5, 3, 5)])
def test_packed_logits_are_each_document_run_alone(segments, arch):
    """A packed row's logits equal each document's run as its own row (positions from 0,
    no key of another document), segment by segment or whole."""
    cfg = tiny(**(LLAMA_TINY if arch == "llama" else {}))
    params = randomized_gains(model.init_params(cfg, jax.random.key(0)))
    rows = [(3, 1, 5, 4), (13,), (2, 6, 1)]  # the last: 4 positions of padding
    docs, pos = document_mask.pack_rows(rows, 13)
    tokens = jax.random.randint(jax.random.key(1), (3, 13), 0, 61)
    packed = model.forward(params, tokens, cfg, segments, document_ids=docs, positions=pos)
    forward = jax.jit(model.forward, static_argnums=2)
    for b, lengths in enumerate(rows):
        at = 0
        for n in lengths:
            alone = forward(params, tokens[b : b + 1, at : at + n], cfg)
            np.testing.assert_allclose(packed[b : b + 1, at : at + n], alone, atol=2e-6)
            at += n


def test_the_loss_is_the_mean_over_counted_targets_of_each_document_alone():
    """Targets across a document boundary and into padding do not count; the mean is
    over the batch's counted targets: each document alone, its loss summed, over them."""
    cfg = tiny()
    params = model.init_params(cfg, jax.random.key(0))
    rows = [(3, 1, 5, 4), (13,), (2, 6, 1)]
    docs, pos = document_mask.pack_rows(rows, 13)
    tokens = jax.random.randint(jax.random.key(1), (3, 13), 0, 61)
    got = model.loss(params, tokens, cfg, documents=docs, positions=pos)
    loss = jax.jit(model.loss, static_argnums=2)
    total, count = 0.0, 0
    for b, lengths in enumerate(rows):
        at = 0
        for n in lengths:
            if n > 1:
                total += float(loss(params, tokens[b : b + 1, at : at + n], cfg)) * (n - 1)
                count += n - 1
            at += n
    assert count == int(document_mask.counted_targets(jnp.asarray(docs)).sum()) == 27
    np.testing.assert_allclose(float(got), total / count, rtol=1e-6)


def test_without_the_document_mask_packed_rows_attend_across_documents():
    cfg = tiny()
    params = model.init_params(cfg, jax.random.key(0))
    docs, pos = document_mask.pack_rows([(3, 10)], 13)
    tokens = jax.random.randint(jax.random.key(1), (1, 13), 0, 61)
    masked = model.loss(params, tokens, cfg, documents=docs)
    unmasked = model.loss(
        params, tokens, dataclasses.replace(cfg, document_mask=False), documents=docs
    )
    plain_counted = (
        model.head_loss_sum(
            params,
            model.hidden(params, tokens[:, :-1], cfg),
            tokens[:, 1:],
            cfg,
            document_mask.counted_targets(jnp.asarray(docs)),
        )
        / 11
    )
    np.testing.assert_allclose(float(unmasked), float(plain_counted), rtol=1e-6)
    assert abs(float(masked) - float(unmasked)) > 1e-4


# ------------------------------------------------------------------ every schedule

SCHEDULES = schedule_lib.SCHEDULES
MESHES = ((1, 2), (2, 2), (1, 4), (2, 4))
KS = (1, 2, 3, 4)
PARTITIONS = ("uniform", "flops")
REMAT = ("full", "none", "full_layer", "dots")
ATTENTION = ("xla", "blockwise")
MODELS = ("gpt", "llama")
FACTORS = (SCHEDULES, MESHES, KS, PARTITIONS, REMAT, ATTENTION, MODELS)


def valid(schedule, mesh, k, part, remat="full", attention_name="xla", arch="gpt"):
    return not (part == "flops" and k == 1)


def packed_config(schedule, mesh, k, part, remat="full", attention_name="xla", arch="gpt"):
    virtual = 2 if schedule_lib.GENERATORS[schedule].interleaved else 1
    c = make_config(schedule, mesh, k, part, "more", virtual, attention_name, arch)
    c.pipeline.remat = remat
    return c


def case_id(case):
    schedule, (d, s), k, *rest = case
    return "-".join([f"{schedule}-{d}x{s}-K{k}", *rest])


# In the shards: every schedule, mesh, K and partition (the default policy, attention and
# model), besides the sample.
FULL = [c + ("full", "xla", "gpt") for c in full_product(FACTORS[:4], valid)]


@pytest.mark.parametrize("case", sampled(all_pairs(FACTORS, valid), FULL), ids=case_id)
def test_packed_pipeline_matches_reference(case):
    check(packed_config(*case), packed=True)


TENSOR_CASES = [
    ("seq1f1b", (1, 2, 2), 3, "full", "gpt"),
    ("seq_zb_h1", (1, 2, 2), 4, "none", "llama"),
    ("seq1f1b_interleaved", (2, 2, 2), 2, "dots", "llama"),
]


@pytest.mark.parametrize("case", TENSOR_CASES, ids=lambda c: f"{c[0]}-{c[1]}-K{c[2]}-{c[3]}-{c[4]}")
def test_packed_tensor_parallel_pipeline_matches_reference(case):
    check(tensor_config(*case), packed=True)


def test_micro_batches_and_replicas_each_get_their_own_rows_ids():
    """Permuting the rows permutes nothing in the mean: each row keeps its ids wherever
    it lands (a mask built for the whole batch, or for the first micro-batch, would not)."""
    config = packed_config("seq1f1b", (2, 2), 2, "uniform")
    spec, mesh = executor.make_spec(config), sharding.mesh_of(config)
    params = model.init_params(spec.cfg, jax.random.key(0))
    batch = packed_batch(config.train.global_batch_size, SEQ_LEN, spec.cfg.vocab_size)
    order = np.roll(np.arange(len(batch["tokens"])), 3)
    step = jax.jit(lambda p, b: executor.loss_and_grads(p, b, spec, mesh)[0])
    losses = [
        float(
            step(
                params,
                on_device({k: v[o] for k, v in batch.items()}, sharding.batch_sharding(mesh)),
            )
        )
        for o in (np.arange(len(order)), order)
    ]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    ref = reference.loss_and_grads(params, {k: jnp.asarray(v) for k, v in batch.items()}, spec.cfg)[
        0
    ]
    np.testing.assert_allclose(losses[0], float(ref), rtol=LOSS_RTOL)


def test_packed_rows_layouts_hold_every_case():
    """The rows the tests pack: a one-token document, a row that is one document,
    padding, and documents crossing the cuts of K = 2, 3, 4 and of micro-batches."""
    rows = layouts(12, SEQ_LEN + 1)
    assert any(1 in r for r in rows) and any(r == (SEQ_LEN + 1,) for r in rows)
    assert any(sum(r) < SEQ_LEN + 1 for r in rows)


def test_verify_compares_a_packed_batch():
    """`python -m seqpipe.verify`'s comparison on packed rows (a packed config's batch:
    tokens, documents, positions), seq1f1b over two stages and two replicas."""
    from seqpipe.tools import verify

    config = packed_config("seq1f1b", (2, 2), 3, "flops", attention_name="blockwise")
    mesh = sharding.mesh_of(config)
    batch = packed_batch(config.train.global_batch_size, SEQ_LEN, config.model.vocab_size)
    result = verify.compare(run_of(config), on_device(batch, sharding.batch_sharding(mesh)), mesh)
    assert result["ok"], result
    plain = verify.compare(run_of(config), jnp.asarray(batch["tokens"]), mesh)
    assert abs(plain["loss"] - result["loss"]) > 1e-4  # the rows were read packed


def test_the_trainer_takes_packed_batches_and_unpacked_ones_as_today():
    """train.py's step batch: packed rows as the dict of global arrays (every key split
    over `data`), unpacked rows as the tokens array alone (today's program)."""
    from seqpipe.data import loader
    from seqpipe.train import step as step_lib

    config = packed_config("seq1f1b", (2, 2), 2, "uniform")
    mesh = sharding.mesh_of(config)
    rows = packed_batch(4, SEQ_LEN, 61)
    got = loader.global_batch(rows, mesh, 4)
    assert sorted(got) == ["documents", "positions", "tokens"]
    assert all(x.sharding == sharding.batch_sharding(mesh) for x in got.values())
    assert np.array_equal(np.asarray(got["documents"]), rows["documents"])
    plain = loader.global_batch({"tokens": rows["tokens"]}, mesh, 4)
    assert isinstance(plain, jax.Array) and np.array_equal(np.asarray(plain), rows["tokens"])
    assert isinstance(step_lib.abstract_batch(run_of(config), mesh), jax.ShapeDtypeStruct)


def test_the_pipelined_evaluation_of_packed_rows_is_the_models_loss():
    from seqpipe.pipeline import spec as spec_lib

    config = packed_config("seq1f1b", (2, 2), 3, "uniform", attention_name="blockwise")
    spec = spec_lib.forward_only(executor.make_spec(config))
    mesh = sharding.mesh_of(config)
    params = model.init_params(spec.cfg, jax.random.key(0))
    batch = packed_batch(config.train.global_batch_size, SEQ_LEN, spec.cfg.vocab_size)
    rows = on_device(batch, sharding.batch_sharding(mesh))
    got = jax.jit(lambda p, b: executor.eval_loss(p, b, spec, mesh))(params, rows)
    oracle = dataclasses.replace(spec.cfg, attention="xla")
    want = reference.batch_loss(params, {k: jnp.asarray(v) for k, v in batch.items()}, oracle)
    np.testing.assert_allclose(float(got), float(want), rtol=LOSS_RTOL)


def test_the_unpipelined_kernel_path_averages_packed_shards_by_their_counted_targets():
    """With `pipeline.schedule=none` a Pallas kernel runs per `data` shard
    (`reference.per_shard`); shards of packed rows count different numbers of targets, so
    the plain mean of their means was not the batch's loss. Weighted, loss and gradients
    equal the whole batch's."""
    config = packed_config("seq1f1b", (2, 2), 2, "uniform")
    cfg = executor.make_spec(config).cfg
    mesh = sharding.make_mesh(4, 1)
    params = model.init_params(cfg, jax.random.key(0))
    batch = packed_batch(4, SEQ_LEN, cfg.vocab_size)
    batch["documents"][0, SEQ_LEN // 2 :] = 0  # row 0 half padding: its shard counts fewer
    counts = np.asarray(document_mask.counted_targets(jnp.asarray(batch["documents"])))
    assert len(set(counts.sum(axis=1))) > 1
    value_and_grad = jax.value_and_grad(reference.batch_loss)
    want = value_and_grad(params, batch, cfg)
    rows = on_device(batch, sharding.batch_sharding(mesh))
    got = jax.jit(reference.per_shard(lambda p, b: value_and_grad(p, b, cfg), mesh))(params, rows)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
