"""A GPT decoder as pure functions of a params pytree.

Layer parameters are stacked with a leading layer axis N so a pipeline can reshape
them to [S, N/S, ...]. Every layer function works on one sequence *segment* and the
keys/values of the positions before it, which is the identity Seq1F1B rests on:
running a sequence segment by segment, carrying the KV prefix, equals running it whole.
"""

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from seqpipe.attention import attend, attend_cached, rope

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Static model shape (hashable, so it can be a jit static argument)."""

    vocab_size: int
    num_layers: int
    d_model: int
    num_heads: int
    d_ff: int
    dtype: str = "float32"
    param_dtype: str = "float32"
    rope_base: float = 10000.0
    init_std: float = 0.02
    attention: str = "auto"  # a name in attention.IMPLEMENTATIONS
    loss_chunk: int = 0  # tokens per cross-entropy chunk (`head_loss_sum`); 0: one chunk

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @classmethod
    def from_config(cls, model_cfg) -> "GPTConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in model_cfg.items() if k in names})


def init_params(cfg: GPTConfig, key: jax.Array) -> Params:
    """Normal(0, init_std) matrices, output projections scaled by 1/sqrt(2N), unit norms."""
    n, d, h, e, f, v = (
        cfg.num_layers,
        cfg.d_model,
        cfg.num_heads,
        cfg.head_dim,
        cfg.d_ff,
        cfg.vocab_size,
    )
    dt = jnp.dtype(cfg.param_dtype)
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * n)
    keys = iter(jax.random.split(key, 8))

    def normal(shape, s):
        return (s * jax.random.normal(next(keys), shape, jnp.float32)).astype(dt)

    return {
        "embed": normal((v, d), std),
        "layers": {
            "attn_norm": jnp.ones((n, d), dt),
            "wq": normal((n, d, h, e), std),
            "wk": normal((n, d, h, e), std),
            "wv": normal((n, d, h, e), std),
            "wo": normal((n, h, e, d), out_std),
            "mlp_norm": jnp.ones((n, d), dt),
            "w_in": normal((n, d, f), std),
            "w_out": normal((n, f, d), out_std),
        },
        "final_norm": jnp.ones((d,), dt),
        "head": normal((d, v), std),
    }


def num_params(params: Params) -> int:
    return sum(x.size for x in jax.tree.leaves(params))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float = 1e-6) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


GELU_SCOPE = "gelu"  # marks its equations for `flops.breakdown` (see attention.NAME_SCOPE)


@jax.custom_jvp
def gelu(x: jax.Array) -> jax.Array:
    """GELU (tanh form), with a hand-written derivative so that a backward keeping
    residuals stores one array (the slope at x) instead of each intermediate of the tanh."""
    return jax.nn.gelu(x, approximate=True)


@gelu.defjvp
@jax.named_scope(GELU_SCOPE)
def _gelu_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    c = math.sqrt(2 / math.pi)
    inner = c * (x + 0.044715 * x**3)
    th = jnp.tanh(inner)
    slope = 0.5 * (1 + th) + 0.5 * x * (1 - th * th) * c * (1 + 3 * 0.044715 * x * x)
    return 0.5 * x * (1 + th), slope * t


def embed(params: Params, tokens_BxQ: jax.Array, cfg: GPTConfig) -> jax.Array:
    return params["embed"].astype(cfg.dtype)[tokens_BxQ]


# A layer's weight matmuls: (einsum, the input it reads). A split backward (zero bubble)
# leaves their weight gradients to its W, which needs only these inputs and the matmuls'
# output cotangents (`weight_grads`).
MATMULS = {
    "wq": ("bqd,dhe->bqhe", "attn_in"),
    "wk": ("bqd,dhe->bqhe", "attn_in"),
    "wv": ("bqd,dhe->bqhe", "attn_in"),
    "wo": ("bqhe,hed->bqd", "attn_out"),
    "w_in": ("bqd,df->bqf", "mlp_in"),
    "w_out": ("bqf,fd->bqd", "mlp_act"),
}


def layer(
    p: Params,
    x_BxQxD: jax.Array,
    k_prefix_BxPxHxE: jax.Array,
    v_prefix_BxPxHxE: jax.Array,
    offset: int,
    cfg: GPTConfig,
    taps: Params | None = None,
    cache=None,
):
    """One pre-norm decoder layer on a segment: (x_seg, kv_prefix, offset) -> (y_seg, kv_seg).

    With `cache` (a `kv_cache.Prefix` at this layer) the prefix's first `offset` positions
    are read from the KV cache where they lie, and `k_prefix`, `v_prefix` are zero sinks
    that take its cotangents (`attention.attend_cached`).

    `taps` (a split backward): {matmul: zeros of its output}, added to the outputs so that
    their cotangents are the matmuls' output cotangents; the layer then also returns the
    matmuls' inputs ({MATMULS input name: array})."""
    p = jax.tree.map(lambda w: w.astype(cfg.dtype), p)
    inputs = {}

    def mm(name, a):
        spec, input_name = MATMULS[name]
        inputs[input_name] = a
        y = jnp.einsum(spec, a, p[name])
        return y if taps is None else y + taps[name]

    h_BxQxD = rms_norm(x_BxQxD, p["attn_norm"])
    q = rope(mm("wq", h_BxQxD), offset, cfg.rope_base)
    k_seg = rope(mm("wk", h_BxQxD), offset, cfg.rope_base)
    v_seg = mm("wv", h_BxQxD)
    if cache is None:
        attn_BxQxHxE = attend(
            cfg.attention,
            q,
            k_prefix_BxPxHxE.astype(k_seg.dtype),
            v_prefix_BxPxHxE.astype(v_seg.dtype),
            k_seg,
            v_seg,
        )
    else:
        attn_BxQxHxE = attend_cached(
            cfg.attention, q, cache, k_prefix_BxPxHxE, v_prefix_BxPxHxE, offset, k_seg, v_seg
        )
    x_BxQxD = x_BxQxD + mm("wo", attn_BxQxHxE)
    h_BxQxD = rms_norm(x_BxQxD, p["mlp_norm"])
    ff_BxQxF = gelu(mm("w_in", h_BxQxD))
    x_BxQxD = x_BxQxD + mm("w_out", ff_BxQxF)
    if taps is None:
        return x_BxQxD, k_seg, v_seg
    return x_BxQxD, k_seg, v_seg, inputs


def matmul_shapes(cfg: GPTConfig, lead: tuple[int, ...]) -> tuple[dict, dict]:
    """(inputs, outputs) shapes of a layer's weight matmuls, each with `lead` dimensions
    (layers, rows, positions) in front."""
    d, h, e, f = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.d_ff
    inputs = {"attn_in": (d,), "attn_out": (h, e), "mlp_in": (d,), "mlp_act": (f,)}
    outputs = {"wq": (h, e), "wk": (h, e), "wv": (h, e), "wo": (d,), "w_in": (f,), "w_out": (d,)}
    return (
        {k: lead + v for k, v in inputs.items()},
        {k: lead + v for k, v in outputs.items()},
    )


def weight_grads(inputs: Params, d_outputs: Params) -> Params:
    """The weight matmuls' gradients of a stack of layers (leading axis N), from their
    inputs and output cotangents: for y = a @ w, dw = a^T dy summed over rows and positions."""
    out = {}
    for name, (spec, input_name) in MATMULS.items():
        a_sub, rest = spec.split(",")
        w_sub, y_sub = rest.split("->")
        out[name] = jnp.einsum(f"n{a_sub},n{y_sub}->n{w_sub}", inputs[input_name], d_outputs[name])
    return out


# What a checkpointed layer keeps for its backward: `layer` only its input (the layer is
# recomputed), `dots` its matmul outputs (the element-wise work is recomputed).
CHECKPOINT_POLICIES = {
    "layer": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
}


def layers(
    p_layers: Params,
    x_BxQxD: jax.Array,
    k_prefix_NxBxPxHxE: jax.Array,
    v_prefix_NxBxPxHxE: jax.Array,
    offset: int,
    cfg: GPTConfig,
    checkpoint: str | None = None,
    taps: Params | None = None,
    depth: jax.Array | None = None,
    cache=None,
):
    """A stack of layers (leading axis N) on one segment; returns y and the segment's K/V
    (and with `taps`, stacked per layer, each layer's matmul inputs: see `layer`).

    `checkpoint` (a key of CHECKPOINT_POLICIES, or None) wraps each layer in jax.checkpoint.
    `depth` (a run-time count, or None for all N) runs only the first `depth` layers: the
    rest pass x through and give zeros (a pipeline stage's padding, `seqpipe.layout`).
    `cache` (a `kv_cache.Prefix`): the prefix is read from the KV cache, layer by layer, and
    the K/V prefix arguments are zero sinks for its cotangents (`layer`).
    """

    def run(x, p, k_prefix, v_prefix, tap, i=None):
        at = None if cache is None else cache.at_layer(i)
        return tuple(layer(p, x, k_prefix, v_prefix, offset, cfg, tap, at))

    def skip(x, *args):
        _, *rest = jax.eval_shape(run, x, *args)
        return (x, *jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), rest))

    def body(x, per_layer):
        i, *per_layer = per_layer
        if depth is None:
            y, *rest = run(x, *per_layer, i)
        else:  # a conditional, so a skipped layer costs nothing
            y, *rest = jax.lax.cond(i < depth, run, skip, x, *per_layer, i)
        return y, tuple(rest)

    if checkpoint is not None:
        body = jax.checkpoint(body, policy=CHECKPOINT_POLICIES[checkpoint])
    elif depth is not None:
        # Saving everything, as no checkpoint does. Without it the cond's own partial
        # evaluation stashed a copy of every weight and the rope tables per unit, and the
        # executor's rebuilt vjp gave wrong q and k gradients (caught by the uneven-split
        # oracle test; the cause inside JAX was not pinned down).
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.everything_saveable)
    layer_index = jnp.arange(jax.tree.leaves(p_layers)[0].shape[0])
    xs = (layer_index, p_layers, k_prefix_NxBxPxHxE, v_prefix_NxBxPxHxE, taps)
    y, rest = jax.lax.scan(body, x_BxQxD, xs)
    return (y, *rest)


def empty_kv(cfg: GPTConfig, num_layers: int, batch: int) -> tuple[jax.Array, jax.Array]:
    shape = (num_layers, batch, 0, cfg.num_heads, cfg.head_dim)
    return jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype)


def logits(params: Params, x_BxQxD: jax.Array, cfg: GPTConfig) -> jax.Array:
    h = rms_norm(x_BxQxD, params["final_norm"].astype(cfg.dtype))
    return jnp.einsum(
        "bqd,dv->bqv", h, params["head"].astype(cfg.dtype), preferred_element_type=jnp.float32
    )


def token_loss_sum(logits_BxQxV: jax.Array, targets_BxQ: jax.Array) -> jax.Array:
    """Summed (not averaged) cross-entropy, so segments and micro-batches add up exactly."""
    logz = jax.nn.logsumexp(logits_BxQxV, axis=-1)
    target_logit = jnp.take_along_axis(logits_BxQxV, targets_BxQ[..., None], axis=-1)[..., 0]
    return jnp.sum(logz - target_logit)


def head_loss_sum(params: Params, x_BxQxD: jax.Array, targets_BxQ: jax.Array, cfg: GPTConfig):
    """`token_loss_sum(logits(params, x))`, with the [B, Q, V] float32 logits never whole:
    the tokens go through the head `cfg.loss_chunk` at a time (`chunked_xent`)."""
    h_BxQxD = rms_norm(x_BxQxD, params["final_norm"].astype(cfg.dtype))
    return chunked_xent(h_BxQxD, params["head"], targets_BxQ, cfg.dtype, cfg.loss_chunk)


def _chunks(h_BxQxD, targets_BxQ, chunk: int):
    """Tokens as C chunks of T ([C, T, D] and [C, T]; the last padded) and the [C, T] mask
    of real tokens (None without padding)."""
    d = h_BxQxD.shape[-1]
    n = targets_BxQ.size
    t = n if chunk <= 0 or chunk >= n else chunk
    c = -(-n // t)
    pad = c * t - n
    h_CxTxD = jnp.pad(h_BxQxD.reshape(n, d), ((0, pad), (0, 0))).reshape(c, t, d)
    targets_CxT = jnp.pad(targets_BxQ.reshape(n), (0, pad)).reshape(c, t)
    mask = (np.arange(c * t) < n).reshape(c, t).astype(np.float32) if pad else None
    return h_CxTxD, targets_CxT, mask


def _chunk_xent(h_TxD, w_DxV, targets_T, mask_T, dtype, grads: bool):
    """(summed loss, and with `grads` dh [T, D] and dw [D, V] float32) of one chunk."""
    logits_TxV = jnp.einsum(
        "td,dv->tv", h_TxD, w_DxV.astype(dtype), preferred_element_type=jnp.float32
    )
    logz_T = jax.nn.logsumexp(logits_TxV, axis=-1)
    target_T = jnp.take_along_axis(logits_TxV, targets_T[:, None], axis=-1)[:, 0]
    per_token = logz_T - target_T
    loss = jnp.sum(per_token if mask_T is None else per_token * mask_T)
    if not grads:
        return loss
    # d loss / d logits = softmax - one_hot(target), in the compute dtype for the matmuls.
    onehot = jax.nn.one_hot(targets_T, logits_TxV.shape[-1], dtype=jnp.float32)
    d_TxV = jnp.exp(logits_TxV - logz_T[:, None]) - onehot
    if mask_T is not None:
        d_TxV = d_TxV * mask_T[:, None]
    d_TxV = d_TxV.astype(dtype)
    dh = jnp.einsum("tv,dv->td", d_TxV, w_DxV.astype(dtype), preferred_element_type=jnp.float32)
    dw = jnp.einsum("td,tv->dv", h_TxD, d_TxV, preferred_element_type=jnp.float32)
    return loss, dh.astype(h_TxD.dtype), dw


def _xent_scan(h_BxQxD, w_DxV, targets_BxQ, dtype, chunk, grads: bool):
    """Chunk by chunk: a loop when there is more than one, so one chunk's logits are live."""
    h_CxTxD, targets_CxT, mask_CxT = _chunks(h_BxQxD, targets_BxQ, chunk)
    one = lambda h, t, m: _chunk_xent(h, w_DxV, t, m, dtype, grads)  # noqa: E731
    if h_CxTxD.shape[0] == 1:  # no loop: XLA's cost analysis counts a loop body once
        out = one(h_CxTxD[0], targets_CxT[0], None if mask_CxT is None else mask_CxT[0])
        return out if not grads else (out[0], out[1][None], out[2])

    def body(carry, xs):
        out = one(*xs)
        if not grads:
            return carry + out, None
        loss, dw = carry
        return (loss + out[0], dw + out[2]), out[1]

    zero = jnp.zeros((), jnp.float32)
    init = zero if not grads else (zero, jnp.zeros(w_DxV.shape, jnp.float32))
    carry, dh_CxTxD = jax.lax.scan(body, init, (h_CxTxD, targets_CxT, mask_CxT))
    return carry if not grads else (carry[0], dh_CxTxD, carry[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def chunked_xent(h_BxQxD, w_DxV, targets_BxQ, dtype: str, chunk: int) -> jax.Array:
    """Summed cross-entropy of logits h @ w (float32, from `dtype` operands), `chunk`
    tokens at a time. Its gradients are computed in the forward, chunk by chunk (the loss's
    cotangent is a scalar that only scales them): what the backward keeps is dh and dw, not
    the logits, and no chunk's logits are recomputed."""
    return _xent_scan(h_BxQxD, w_DxV, targets_BxQ, dtype, chunk, grads=False)


def _chunked_xent_fwd(h_BxQxD, w_DxV, targets_BxQ, dtype, chunk):
    loss, dh_CxTxD, dw = _xent_scan(h_BxQxD, w_DxV, targets_BxQ, dtype, chunk, grads=True)
    dh_BxQxD = dh_CxTxD.reshape(-1, h_BxQxD.shape[-1])[: targets_BxQ.size]
    return loss, (dh_BxQxD.reshape(h_BxQxD.shape), dw.astype(w_DxV.dtype), targets_BxQ)


def _chunked_xent_bwd(dtype, chunk, saved, g):
    dh, dw, targets = saved
    zeros = np.zeros(targets.shape, jax.dtypes.float0)
    return (g * dh).astype(dh.dtype), (g * dw).astype(dw.dtype), zeros


chunked_xent.defvjp(_chunked_xent_fwd, _chunked_xent_bwd)


def hidden(
    params: Params,
    tokens_BxL: jax.Array,
    cfg: GPTConfig,
    segment_lengths: tuple[int, ...] | None = None,
    checkpoint: str | None = None,
) -> jax.Array:
    """The last layer's outputs [B, L, D]; with `segment_lengths`, segment by segment."""
    batch, seq_len = tokens_BxL.shape
    segment_lengths = segment_lengths or (seq_len,)
    if sum(segment_lengths) != seq_len:
        raise ValueError(f"segment lengths {segment_lengths} do not sum to {seq_len}")
    k_cache, v_cache = empty_kv(cfg, cfg.num_layers, batch)
    outputs, offset = [], 0
    for length in segment_lengths:
        x = embed(params, tokens_BxL[:, offset : offset + length], cfg)
        y, k_seg, v_seg = layers(params["layers"], x, k_cache, v_cache, offset, cfg, checkpoint)
        k_cache = jnp.concatenate([k_cache, k_seg], axis=2)
        v_cache = jnp.concatenate([v_cache, v_seg], axis=2)
        outputs.append(y)
        offset += length
    return jnp.concatenate(outputs, axis=1)


def forward(
    params: Params,
    tokens_BxL: jax.Array,
    cfg: GPTConfig,
    segment_lengths: tuple[int, ...] | None = None,
    checkpoint: str | None = None,
) -> jax.Array:
    """Logits of the whole model; with `segment_lengths`, computed segment by segment."""
    return logits(params, hidden(params, tokens_BxL, cfg, segment_lengths, checkpoint), cfg)


def loss(
    params: Params,
    tokens_BxL1: jax.Array,
    cfg: GPTConfig,
    segment_lengths: tuple[int, ...] | None = None,
    checkpoint: str | None = None,
) -> jax.Array:
    """Mean next-token cross-entropy of a [B, L+1] token window."""
    inputs, targets = tokens_BxL1[:, :-1], tokens_BxL1[:, 1:]
    y = hidden(params, inputs, cfg, segment_lengths, checkpoint)
    return head_loss_sum(params, y, targets, cfg) / targets.size


def flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token, PaLM convention: 6N (non-embedding matmuls and head) + 12*N_l*D*L.

    The attention term counts the full L x L score matrix as PaLM does; causal
    attention needs half of it, which `seqpipe.partition` accounts for separately.
    """
    n, d, f, v = cfg.num_layers, cfg.d_model, cfg.d_ff, cfg.vocab_size
    matmul_params = n * (4 * d * d + 2 * d * f) + d * v
    return 6.0 * matmul_params + 12.0 * n * d * seq_len
