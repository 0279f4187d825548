"""The model, and the identity Seq1F1B rests on: segment-by-segment equals whole-sequence."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqpipe.kernels.attention import segment_attention
from seqpipe.models import model
from seqpipe.models.model import GPTConfig

CFG = GPTConfig(vocab_size=97, num_layers=3, d_model=32, num_heads=4, d_ff=48)
SEQ = 24
GRAD_RTOL = 1e-5  # of a leaf's largest magnitude: float32 sums in another order


def max_relative_error(actual, expected) -> tuple[str, float]:
    """The worst leaf and its max |actual - expected| / max |expected|."""
    worst = ("", 0.0)
    for (path, a), e in zip(
        jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True
    ):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        scale = max(float(np.max(np.abs(e))), np.finfo(np.float32).tiny)
        err = float(np.max(np.abs(a - e))) / scale
        if err > worst[1] or not np.isfinite(err):
            worst = (jax.tree_util.keystr(path), err)
    return worst


def assert_tree_close(actual, expected):
    leaf, err = max_relative_error(actual, expected)
    assert err <= GRAD_RTOL, f"{leaf} differs by {err:.2e} of its largest magnitude"


@pytest.fixture(scope="module")
def params():
    return model.init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(1), (2, SEQ + 1), 0, CFG.vocab_size)


# Jitted: eager dispatch of a scanned model is far slower than compiling it.
forward = jax.jit(model.forward, static_argnums=(2, 3))
loss_and_grad = jax.jit(jax.value_and_grad(model.loss), static_argnums=(2, 3, 4))


def naive_causal_attention(q, k, v):
    scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(q.shape[-1])
    n = q.shape[1]
    scores = jnp.where(jnp.tril(jnp.ones((n, n), bool)), scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(scores, -1), v)


def test_segment_attention_with_offset_matches_full_causal_attention():
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 10, 3, 8)) for i in range(3))
    full = naive_causal_attention(q, k, v)
    # Queries 6..9 against keys 0..9: fewer queries than keys, where a top-left mask fails.
    part = segment_attention(q[:, 6:], k[:, :6], v[:, :6], k[:, 6:], v[:, 6:])
    np.testing.assert_allclose(part, full[:, 6:], rtol=1e-5, atol=1e-6)
    first = segment_attention(q[:, :6], k[:, :0], v[:, :0], k[:, :6], v[:, :6])
    np.testing.assert_allclose(first, full[:, :6], rtol=1e-5, atol=1e-6)


def test_segment_attention_gradients_match_autodiff_of_naive_attention():
    """The hand-written backward against autodiff of plain masked softmax attention."""
    q, k, v, g = (jax.random.normal(jax.random.key(i), (2, 10, 3, 8)) for i in range(4))

    def by_segments(q, k, v):
        bounds = [(0, 3), (3, 4), (4, 10)]  # unequal, one of length 1
        outs = [
            segment_attention(q[:, a:b], k[:, :a], v[:, :a], k[:, a:b], v[:, a:b])
            for a, b in bounds
        ]
        return jnp.concatenate(outs, axis=1)

    got = jax.grad(lambda *a: jnp.sum(g * by_segments(*a)), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: jnp.sum(g * naive_causal_attention(*a)), argnums=(0, 1, 2))(q, k, v)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)  # (dq, dk, dv)


def test_segment_attention_keeps_its_probabilities_once():
    """Beyond its inputs, the vjp keeps one [B, H, Q, P + Q] block of probabilities."""
    b, p_len, q_len, h, e = 2, 6, 4, 3, 8
    args = [jnp.zeros((b, n, h, e)) for n in (q_len, p_len, p_len, q_len, q_len)]
    kept = []

    def probe(*args):
        _, vjp = jax.vjp(segment_attention, *args)
        inputs = {id(x) for x in args}
        kept.extend(x.size for x in jax.tree.leaves(vjp) if id(x) not in inputs)

    jax.eval_shape(probe, *args)
    assert sum(kept) == b * h * q_len * (p_len + q_len)


def test_segment_attention_rejects_inconsistent_key_range():
    q, kv = jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 5, 2, 8))
    with pytest.raises(ValueError, match="expected the segment's own 4"):
        segment_attention(q, kv, kv, kv, kv)


@pytest.mark.parametrize(
    "lengths",
    [(12, 12), (8, 8, 8), (6, 6, 6, 6), (11, 7, 4, 2), (1, 23), (20, 3, 1), (1,) * 8 + (16,)],
)
def test_segmented_logits_equal_whole(params, tokens, lengths):
    whole = forward(params, tokens[:, :-1], CFG)
    segmented = forward(params, tokens[:, :-1], CFG, lengths)
    np.testing.assert_allclose(segmented, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lengths", [(6, 6, 6, 6), (11, 7, 4, 2), (3, 5, 16)])
def test_segmented_gradients_equal_whole(params, tokens, lengths):
    loss_whole, grads_whole = loss_and_grad(params, tokens, CFG)
    loss_seg, grads_seg = loss_and_grad(params, tokens, CFG, lengths)
    np.testing.assert_allclose(loss_seg, loss_whole, rtol=1e-6)
    assert_tree_close(grads_seg, grads_whole)


def test_rope_uses_absolute_positions(params, tokens):
    """A segment run at the wrong offset must give different logits (the test can fail)."""
    x = model.embed(params, tokens[:, :8], CFG)
    k_prefix, v_prefix = model.empty_kv(CFG, CFG.num_layers, 2)
    y0, *_ = model.layers(params["layers"], x, k_prefix, v_prefix, 0, CFG)
    x_shift = model.embed(params, tokens[:, :8], CFG)
    k1 = jnp.zeros((CFG.num_layers, 2, 4, CFG.num_heads, CFG.head_dim))
    y1, *_ = model.layers(params["layers"], x_shift, k1, k1, 4, CFG)
    assert not np.allclose(y0, y1, atol=1e-4)


@pytest.mark.parametrize("policy", sorted(model.CHECKPOINT_POLICIES))
def test_checkpoint_policies_change_nothing(params, tokens, policy):
    _, g0 = loss_and_grad(params, tokens, CFG)
    _, g1 = loss_and_grad(params, tokens, CFG, (8, 16), policy)
    assert_tree_close(g1, g0)


def test_gelu_derivative_is_the_tanh_forms():
    x = jnp.linspace(-6.0, 6.0, 101)
    ours = jax.vmap(jax.grad(model.gelu))(x)
    exact = jax.vmap(jax.grad(lambda y: jax.nn.gelu(y, approximate=True)))(x)
    np.testing.assert_allclose(ours, exact, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.gelu(x), jax.nn.gelu(x, approximate=True), rtol=1e-6)


def test_initial_loss_is_near_uniform(params, tokens):
    assert abs(float(model.loss(params, tokens, CFG)) - np.log(CFG.vocab_size)) < 0.1


def test_bfloat16_compute_keeps_float32_params(tokens):
    cfg = GPTConfig(**{**CFG.__dict__, "dtype": "bfloat16"})
    p = model.init_params(cfg, jax.random.key(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(p))
    loss, grads = loss_and_grad(p, tokens, cfg)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    assert np.isfinite(float(loss))


def _unchunked_loss(params, x, targets, cfg):
    """The cross-entropy as it was before chunking: whole logits, then the loss."""
    return model.token_loss_sum(model.logits(params, x, cfg), targets)


@pytest.mark.parametrize("chunk", [0, 16, 5, 48, 1000])  # one, exact, padded, 1 row, > all
def test_chunked_head_loss_matches_whole_logits(params, chunk):
    """The chunked cross-entropy equals the whole-logits one: loss, and gradients of the
    norm, the head and the input (its gradients are computed in its forward)."""
    cfg = dataclasses.replace(CFG, loss_chunk=chunk)
    x = jax.random.normal(jax.random.key(2), (2, SEQ, CFG.d_model))
    targets = jax.random.randint(jax.random.key(3), (2, SEQ), 0, CFG.vocab_size)
    shared = {k: params[k] for k in ("final_norm", "head")}
    want = jax.value_and_grad(_unchunked_loss, argnums=(0, 1))(shared, x, targets, CFG)
    got = jax.jit(jax.value_and_grad(model.head_loss_sum, argnums=(0, 1)), static_argnums=3)(
        shared, x, targets, cfg
    )
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert_tree_close(got[1], want[1])
    # Without gradients (evaluation) the primal loop gives the same loss.
    np.testing.assert_allclose(
        jax.jit(model.head_loss_sum, static_argnums=3)(shared, x, targets, cfg), want[0], rtol=1e-6
    )


def test_chunked_head_loss_keeps_no_whole_logits():
    """gpt_1b's head on 8 x 2048 tokens: with 2048-token chunks XLA's temporaries hold less
    than half of one [B, L, V] float32 logits array; unchunked they hold more than one."""
    cfg = GPTConfig(vocab_size=50304, num_layers=1, d_model=2048, num_heads=16, d_ff=64)
    sds = jax.ShapeDtypeStruct
    shared = {"final_norm": sds((2048,), jnp.float32), "head": sds((2048, 50304), jnp.float32)}
    x, targets = sds((8, 2048, 2048), jnp.float32), sds((8, 2048), jnp.int32)
    logits_bytes = 8 * 2048 * 50304 * 4
    temp = {}
    for chunk in (0, 2048):
        c = dataclasses.replace(cfg, loss_chunk=chunk)
        fn = jax.jit(jax.grad(model.head_loss_sum, argnums=(0, 1)), static_argnums=3)
        temp[chunk] = fn.lower(shared, x, targets, c).compile().memory_analysis().temp_size_in_bytes
    assert temp[2048] < logits_bytes / 2 < logits_bytes < temp[0], temp


def test_rms_norm_backward_is_autodiffs():
    """The hand-written backward (it keeps x and the reciprocal rms) equals autodiff of the
    float32 formula, in float32 and from bfloat16 inputs."""

    def plain(x, w):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        return (y * w.astype(jnp.float32)).astype(x.dtype)

    x = jax.random.normal(jax.random.key(0), (2, 5, 16)) * 3
    w = 1 + 0.1 * jax.random.normal(jax.random.key(1), (16,))
    dy = jax.random.normal(jax.random.key(2), (2, 5, 16))
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
        args = (x.astype(dtype), w.astype(dtype))
        ours, ours_vjp = jax.vjp(model.rms_norm, *args)
        want, want_vjp = jax.vjp(plain, *args)
        np.testing.assert_allclose(np.float32(ours), np.float32(want), rtol=tol, atol=tol)
        for a, b in zip(ours_vjp(dy.astype(dtype)), want_vjp(dy.astype(dtype)), strict=True):
            np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol, atol=tol * 10)


@pytest.mark.parametrize(
    "name, billions",
    # The public checkpoints' parameter counts (transformers' num_parameters()): Llama 3.2
    # 1B ties its head, Qwen 2.5 has Q/K/V biases; the mixtures count every expert.
    [
        ("llama3_2_1b", 1.235814400),
        ("llama3_1_8b", 8.030261248),
        ("qwen2_5_7b", 7.615616512),
        ("mixtral_8x7b", 46.702792704),
        ("qwen3_30b_a3b", 30.532122624),
    ],
)
def test_public_model_configs_have_their_parameter_counts(name, billions):
    from seqpipe.run import config as config_lib

    cfg = GPTConfig.from_config(config_lib.load(name).model)
    shapes = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    assert model.num_params(shapes) == round(billions * 1e9)
