"""Every segment attention implementation against `xla` (the einsum oracle): the output and
all five cotangents (dq, prefix dK/dV, own dK/dV), segment by segment over a sequence."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_helpers import in_cache, verify_triton_lowerings

from seqpipe.kernels import attention, blockwise, kv_cache, pallas_gpu, splash
from seqpipe.kernels.attention import segment_attention
from seqpipe.run import config as config_lib
from seqpipe.targets import compat

RTOL = ATOL = 1e-5  # float32 on CPU: both compute in float32
KERNEL_TOL = 1e-6  # pallas_gpu in interpret mode, float32: measured within 5.4e-7
NAMES = ("out", "dq", "dk_prefix", "dv_prefix", "dk_own", "dv_own")


def sequence(length, b=2, h=3, e=8, seed=0, kv=None):
    """q, k, v and an output cotangent of a whole sequence, [b, L, H, E] each (K/V with
    `kv` heads: grouped-query attention)."""
    keys = jax.random.split(jax.random.key(seed), 4)
    heads = (h, kv or h, kv or h, h)
    return [
        jax.random.normal(key, (b, length, n, e), jnp.float32)
        for key, n in zip(keys, heads, strict=True)
    ]


@functools.cache
def _out_and_grads(fn):
    def run(q, kp, vp, ks, vs, g):
        out, vjp = jax.vjp(fn, q, kp, vp, ks, vs)
        return (out, *vjp(g))

    return jax.jit(run)


def check_segments(fn, lengths, first=0, tol=RTOL, **shape):
    """fn against xla on each segment of a sequence cut into `lengths` (prefix 0 first),
    from segment `first` on, to `tol` (relative and absolute)."""
    q, k, v, g = sequence(sum(lengths), **shape)
    offset = sum(lengths[:first])
    for length in lengths[first:]:
        own = slice(offset, offset + length)
        args = (q[:, own], k[:, :offset], v[:, :offset], k[:, own], v[:, own], g[:, own])
        want = _out_and_grads(segment_attention)(*args)
        got = _out_and_grads(fn)(*args)
        for name, x, y in zip(NAMES, got, want, strict=True):
            np.testing.assert_allclose(
                x, y, rtol=tol, atol=tol, err_msg=f"{name}, segments {lengths} at {offset}"
            )
        offset += length


# Eight unequal segments: segment k = 1..8 of a sequence, the first with prefix 0, of
# lengths that are not multiples of the blocks (4 queries, 3 keys), shorter and longer
# than a block. (Each segment shape compiles twice; this CPU has little to spare.)
LENGTHS = (4, 1, 6, 2, 3, 9, 1, 5)
small_blocks = functools.partial(blockwise.blockwise_attention, block_q=4, block_k=3)


def test_blockwise_matches_xla_on_every_segment_of_eight():
    check_segments(small_blocks, LENGTHS)


def repeated_kv(q, kp, vp, ks, vs):
    """Grouped-query attention as multi-head attention on K/V heads repeated per group
    (HF's `repeat_kv`): the oracle of xla's grouped path, which never repeats them."""
    group = q.shape[2] // ks.shape[2]
    kp, vp, ks, vs = (jnp.repeat(x, group, axis=2) for x in (kp, vp, ks, vs))
    return segment_attention(q, kp, vp, ks, vs)


@pytest.mark.parametrize("kv", [1, 2])
def test_grouped_xla_equals_repeated_kv_heads(kv):
    """Four query heads on two K/V heads (GQA) and on one (MQA): xla's grouped einsums
    equal multi-head attention on repeated K/V, whose K/V cotangents sum over each group."""
    check_segments(repeated_kv, (5, 7), h=4, kv=kv)


@pytest.mark.parametrize("kv", [1, 2])
def test_grouped_blockwise_matches_xla(kv):
    check_segments(small_blocks, (4, 1, 6, 9), h=4, kv=kv)
    check_segments(cached_small_blocks, (5, 7), h=4, kv=kv)


def cached_small_blocks(q, kp, vp, ks, vs):
    """`blockwise.cached_attention` reading the prefix from a cache; kp, vp themselves are
    the sinks, so their cotangents are the prefix's."""
    cache = in_cache(kp, vp, q.dtype)
    return blockwise.cached_attention(q, cache, kp, vp, ks, vs, kp.shape[1], 4, 3)


def test_blockwise_reading_the_kv_cache_matches_xla():
    check_segments(cached_small_blocks, LENGTHS)


def test_bfloat16_cache_words_give_blockwise_bit_for_bit():
    """A bf16 cache is stored as uint16 words; read through them, the kernel computes
    exactly what it computes on the prefix arrays (forward and all five cotangents), and
    sinks longer than the prefix get zero cotangents past it."""
    q, k, v, g = (x.astype(jnp.bfloat16) for x in sequence(13))
    own, pre = slice(6, 13), slice(0, 6)
    args = (q[:, own], k[:, pre], v[:, pre], k[:, own], v[:, own])
    want = _out_and_grads(small_blocks)(*args, g[:, own])
    cache = in_cache(k[:, pre], v[:, pre], jnp.bfloat16)
    assert cache.words_k.dtype == jnp.uint16
    sink = jnp.zeros((2, 9, 3, 8), jnp.bfloat16)

    def cached(q, sk, sv, ks, vs):
        return blockwise.cached_attention(q, cache, sk, sv, ks, vs, 6, 4, 3)

    out, vjp = jax.vjp(cached, args[0], sink, sink, *args[3:])
    got = (out, *vjp(g[:, own]))
    for name, x, y in zip(NAMES, got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(x[:, : y.shape[1]], np.float32), y, err_msg=name)
    assert not np.asarray(got[2][:, 6:], np.float32).any()


def test_blockwise_with_default_blocks():
    """The default blocks of 512: three over 1100 queries (the last overlapping), one over
    a short segment after them."""
    check_segments(blockwise.blockwise_attention, (1100, 300), b=1, h=2, e=16)


def test_blockwise_in_bfloat16_matches_xla_within_rounding():
    """bfloat16 inputs (as training runs): both cast probabilities to bfloat16 before
    their matmuls, in another order, so they agree to bfloat16's rounding (2^-8), not
    to float32's."""
    q, k, v, g = (x.astype(jnp.bfloat16) for x in sequence(19))
    args = (q[:, 11:], k[:, :11], v[:, :11], k[:, 11:], v[:, 11:], g[:, 11:])
    want = _out_and_grads(segment_attention)(*args)
    got = _out_and_grads(small_blocks)(*args)
    for name, x, y in zip(NAMES, got, want, strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        scale = np.abs(y).max()
        assert np.abs(x - y).max() <= 2e-2 * scale, name


def test_blockwise_keeps_no_score_matrix():
    """Compiled temporaries stay far below one float32 [b, H, Q, P + Q] score matrix, which
    the xla path needs several of (so this test can fail)."""
    b, h, e, prefix, q_len = 1, 2, 16, 6144, 2048
    args = [jnp.zeros((b, n, h, e)) for n in (q_len, prefix, prefix, q_len, q_len, q_len)]
    scores = b * h * q_len * (prefix + q_len) * 4

    def temp(fn):
        compiled = _out_and_grads(fn).lower(*args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp(segment_attention) >= scores
    # About four [b, H, 512, 512] float32 blocks (scores, probabilities and their
    # gradients) and float32 dq, dK, dV: 11 MiB here, against 128 MiB of scores.
    assert temp(blockwise.blockwise_attention) <= scores / 8


def test_splash_in_interpret_mode_matches_xla():
    """Pallas interpret mode is slow on CPU: two segments, the first with prefix 0, both
    padded to the 128-blocks (queries 130 -> 256 and 6 -> 128, keys 136 -> 256)."""
    check_segments(functools.partial(splash.splash_attention, interpret=True), (130, 6), h=2)


def test_grouped_splash_in_interpret_mode_matches_xla():
    """Four query heads on two K/V heads, which splash's MQA kernel takes per K/V head."""
    fn = functools.partial(splash.splash_attention, interpret=True)
    check_segments(fn, (130, 6), first=1, h=4, kv=2)


# Tiles smaller than the segments, query and key blocks of different sizes both ways
# round (the diagonal crossing differs), every length off every block: the prefix (5)
# and the segments (5, 7) leave a partial last block in each kernel.
TINY_TILES = pallas_gpu.Blocks(forward=(4, 2), dkv=(4, 2), dq=(2, 4))


def test_pallas_gpu_in_interpret_mode_matches_xla():
    """The Triton kernels in Pallas interpret mode, three heads, two segments: prefix 0,
    then prefix 5. Float32 throughout, as xla: measured within 5.4e-7 of it, so the
    tolerance is 1e-6, not the 1e-5 of blockwise."""
    fn = functools.partial(pallas_gpu.pallas_gpu_attention, blocks=TINY_TILES, interpret=True)
    check_segments(fn, (5, 7), tol=KERNEL_TOL)


@pytest.mark.parametrize("kv", [1, 2])
def test_grouped_pallas_gpu_in_interpret_mode_matches_xla(kv):
    fn = functools.partial(pallas_gpu.pallas_gpu_attention, blocks=TINY_TILES, interpret=True)
    check_segments(fn, (5, 7), tol=KERNEL_TOL, h=4, kv=kv)
    check_segments(cached_tiny_tiles, (5, 7), first=1, tol=KERNEL_TOL, h=4, kv=kv)


def test_pallas_gpu_with_default_tiles_in_interpret_mode():
    """The default tiles, fitted to a short segment: 20 queries in a 32-row block, a
    40-key prefix in a 64-key block (Triton's tiles are powers of two, 16 or more)."""
    fn = functools.partial(pallas_gpu.pallas_gpu_attention, interpret=True)
    check_segments(fn, (40, 20), first=1, tol=KERNEL_TOL, b=1, h=2, e=16)


def test_pallas_gpu_in_bfloat16_matches_xla_within_rounding():
    """bfloat16 inputs: both cast probabilities to bfloat16 before the PV and dS matmuls,
    in another order; they agree to bfloat16's rounding, as blockwise does."""
    q, k, v, g = (x.astype(jnp.bfloat16) for x in sequence(19))
    args = (q[:, 11:], k[:, :11], v[:, :11], k[:, 11:], v[:, 11:], g[:, 11:])
    fn = functools.partial(pallas_gpu.pallas_gpu_attention, blocks=TINY_TILES, interpret=True)
    want = _out_and_grads(segment_attention)(*args)
    got = _out_and_grads(fn)(*args)
    for name, x, y in zip(NAMES, got, want, strict=True):
        assert x.dtype == y.dtype, name
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert np.abs(x - y).max() <= 2e-2 * np.abs(y).max(), name


def cached_tiny_tiles(q, kp, vp, ks, vs):
    """`pallas_gpu.cached_attention` reading the prefix from a cache (kp, vp are the
    sinks, so their cotangents are the prefix's)."""
    cache = in_cache(kp, vp, q.dtype)
    fn = pallas_gpu.cached_attention
    return fn(q, cache, kp, vp, ks, vs, kp.shape[1], TINY_TILES, True)


def test_pallas_gpu_reading_the_kv_cache_matches_xla():
    """The kernels slicing the prefix's tiles from the cache's slot and layer in place
    (prefix 5, a partial last key block)."""
    check_segments(cached_tiny_tiles, (5, 7), first=1, tol=KERNEL_TOL)


def test_bfloat16_cache_words_give_pallas_gpu_bit_for_bit():
    """From uint16 cache words, bitcast in the kernel, the kernels compute exactly what they
    compute on prefix arrays (forward and all five cotangents); sinks longer than the
    prefix get zero cotangents past it."""
    q, k, v, g = (x.astype(jnp.bfloat16) for x in sequence(13))
    own, pre = slice(6, 13), slice(0, 6)
    args = (q[:, own], k[:, pre], v[:, pre], k[:, own], v[:, own])
    tiles = functools.partial(pallas_gpu.pallas_gpu_attention, blocks=TINY_TILES, interpret=True)
    want = _out_and_grads(tiles)(*args, g[:, own])
    cache = in_cache(k[:, pre], v[:, pre], jnp.bfloat16)
    assert cache.words_k.dtype == jnp.uint16
    sink = jnp.zeros((2, 9, 3, 8), jnp.bfloat16)

    def cached(q, sk, sv, ks, vs):
        return pallas_gpu.cached_attention(q, cache, sk, sv, ks, vs, 6, TINY_TILES, True)

    out, vjp = jax.jit(lambda *a: jax.vjp(cached, *a))(args[0], sink, sink, *args[3:])
    got = (out, *vjp(g[:, own]))
    for name, x, y in zip(NAMES, got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(x[:, : y.shape[1]], np.float32), y, err_msg=name)
    assert not np.asarray(got[2][:, 6:], np.float32).any()


def _cached_out_and_grads(sink_shape: tuple):
    """pallas_gpu reading a 300-position prefix from the K/V cache words (slot and layer
    traced): its output and the cotangents of q, the zero sinks and the segment's K/V."""

    def cached(words_k, words_v, slot, layer, q, ks, vs, g):
        cache = kv_cache.Prefix(words_k, words_v, slot, layer)
        sink = jnp.zeros(sink_shape, jnp.bfloat16)

        def fn(q, sk, sv, ks, vs):
            return pallas_gpu.cached_attention(q, cache, sk, sv, ks, vs, 300)

        out, vjp = jax.vjp(fn, q, sink, sink, ks, vs)
        return (out, *vjp(g))

    return cached


def test_pallas_gpu_lowers_to_verified_triton_modules(monkeypatch):
    """Compiled for a GPU (not interpreted), at gpt_1b's head width in bfloat16, the prefix
    as arrays and in a K/V cache: JAX lowers the four kernels (forward, prefix dK/dV, own
    dK/dV, dq) to Triton modules that pass MLIR's verifier. This needs no GPU; compiling
    them to PTX and running them does."""
    verified = verify_triton_lowerings(monkeypatch)
    shape = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bfloat16)
    q, prefix = shape((2, 100, 4, 128)), shape((2, 300, 4, 128))
    with compat.gpu_target("NVIDIA H200"):
        traced = _out_and_grads(pallas_gpu.pallas_gpu_attention).trace(q, prefix, prefix, q, q, q)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert verified == [True] * 4
    assert text.count("__gpu$xla.gpu.triton") == 4

    # The same four reading the prefix from uint16 cache words (the slot and layer traced).
    words = jax.ShapeDtypeStruct((2, 3, 2, 400, 4, 128), jnp.uint16)
    index = jax.ShapeDtypeStruct((), jnp.int32)

    cached = _cached_out_and_grads((2, 350, 4, 128))
    with compat.gpu_target("NVIDIA H200"):
        traced = jax.jit(cached).trace(words, words, index, index, q, q, q, q)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert verified == [True] * 8
    assert text.count("__gpu$xla.gpu.triton") == 4


def test_grouped_pallas_gpu_lowers_to_verified_triton_modules(monkeypatch):
    """Llama 3.1 8B's grouping (4 query heads per K/V head), bf16, E = 128, the prefix in a
    K/V cache: the K/V index maps (h // 4) and the cache reads lower to Triton modules that
    pass MLIR's verifier."""
    verified = verify_triton_lowerings(monkeypatch)
    q = jax.ShapeDtypeStruct((1, 100, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 100, 2, 128), jnp.bfloat16)
    words = jax.ShapeDtypeStruct((2, 3, 1, 400, 2, 128), jnp.uint16)
    index = jax.ShapeDtypeStruct((), jnp.int32)

    cached = _cached_out_and_grads((1, 350, 2, 128))
    with compat.gpu_target("NVIDIA H200"):
        traced = jax.jit(cached).trace(words, words, index, index, q, kv, kv, q)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert verified == [True] * 4
    assert text.count("__gpu$xla.gpu.triton") == 4


def test_pallas_gpu_refuses_odd_widths_in_one_line():
    q = jnp.zeros((1, 4, 1, 24))
    with pytest.raises(ValueError, match="powers of two for the head width"):
        pallas_gpu.pallas_gpu_attention(q, q, q, q, q, interpret=True)


def test_auto_picks_per_backend():
    assert attention.resolve("auto", "tpu") == "splash"
    assert attention.resolve("auto", "cpu") == "blockwise"  # measured faster than xla here
    assert attention.resolve("auto", "gpu") == "blockwise"
    assert attention.resolve("xla", "tpu") == "xla"
    with pytest.raises(ValueError, match="not one of"):
        attention.resolve("flash")


def test_config_names_every_implementation_and_rejects_others():
    assert config_lib.ATTENTION == attention.IMPLEMENTATIONS
    c = config_lib.base_config()
    c.model.attention = "flash"
    with pytest.raises(config_lib.ConfigError, match=r"model.attention='flash' is not valid"):
        config_lib.validate(c)


def test_the_kernels_are_refused_off_their_platform_in_one_line():
    """Splash (TPU) and pallas_gpu (NVIDIA GPU) compile for their own platform only; with
    or without a pipeline (without one, each data shard runs in a shard_map:
    `reference.per_shard`)."""
    from seqpipe.kernels import attention
    from seqpipe.run import run_config

    def config(name, schedule):
        c = config_lib.base_config()
        c.model.attention = name
        c.pipeline.schedule = schedule
        return c

    for schedule in ("seq1f1b", "none"):
        with pytest.raises(config_lib.ConfigError, match="splash is a TPU kernel and this is cpu"):
            run_config.resolve(config("splash", schedule), jax.devices()[:1])
        with pytest.raises(config_lib.ConfigError, match="pallas_gpu is an NVIDIA GPU kernel and"):
            run_config.resolve(config("pallas_gpu", schedule), jax.devices()[:1])
        run_config.check_attention("splash", "tpu")
        run_config.check_attention("pallas_gpu", "gpu")
        run_config.resolve(config("auto", schedule), jax.devices()[:1])
    assert attention.resolve("auto", "tpu") == "splash"


def test_without_a_pipeline_each_data_shard_runs_whole_and_the_mean_is_the_batchs():
    """`reference.per_shard` (how a step without a pipeline runs a Pallas kernel, which
    XLA cannot partition): the loss and every gradient equal the model run whole on the
    batch, on a mesh whose `stage` axis holds copies."""
    from seqpipe.models import model, reference
    from seqpipe.parallel import sharding

    cfg = model.GPTConfig(
        vocab_size=64, num_layers=2, d_model=32, num_heads=4, d_ff=64, attention="blockwise"
    )
    params = model.init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, cfg.vocab_size)
    mesh = sharding.make_mesh(4, 2)
    grad_fn = functools.partial(reference.loss_and_grads, cfg=cfg)
    loss, grads = jax.jit(grad_fn)(params, tokens)
    batch = jax.device_put(tokens, sharding.batch_sharding(mesh))
    shard_loss, shard_grads = jax.jit(reference.per_shard(grad_fn, mesh))(params, batch)
    np.testing.assert_allclose(shard_loss, loss, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(shard_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "platform, pinned",
    [("tpu", [True, False, False, True]), ("gpu", [True] * 4), ("cpu", [False] * 4)],
)
def test_the_caches_are_pinned_row_major_where_the_platform_gains(platform, pinned):
    """GPUs pin every carried buffer, CPUs none; a TPU those whose two minor dimensions
    fill whole tiles (16 rows of 16-bit words, 8 of 32-bit, by 128 lanes): gpt_1b's 16 K/V
    heads of 128, not gpt_30b's 7 local heads of 96 under tensor 8 nor heads of 64."""
    shapes = [
        ((6, 3, 4, 1536, 16, 128), jnp.uint16),
        ((6, 3, 4, 1536, 7, 96), jnp.uint16),
        ((6, 3, 4, 1536, 8, 64), jnp.uint16),
        ((4, 1536, 8, 128), jnp.float32),
    ]
    arrays = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]

    def traced(*xs):
        with kv_cache.layouts_for(platform):
            return kv_cache.row_major(xs)

    jaxpr = jax.make_jaxpr(traced)(*arrays).jaxpr
    constrained = {e.invars[0] for e in jaxpr.eqns if e.primitive.name == "layout_constraint"}
    assert [v in constrained for v in jaxpr.invars] == pinned
