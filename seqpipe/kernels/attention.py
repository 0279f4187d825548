"""Causal attention of one sequence segment against the keys and values before it.

A segment of queries at absolute positions [offset, offset + Q) attends to keys at
[0, offset + Q): the cached prefix [0, offset) plus its own. The causal mask is
bottom-right aligned by construction: query i sees key j iff j <= offset + i (every
prefix key, and its own segment's keys up to the diagonal). A top-left-aligned flag
would be wrong here whenever Q < number of keys.

`attend` runs the implementation `model.attention` names (`IMPLEMENTATIONS`):
`segment_attention` here (`xla`: einsums over whole score matrices, the tests' oracle),
`seqpipe.kernels.blockwise` (score blocks with an online softmax, O(block) memory),
`seqpipe.kernels.splash` (the Pallas TPU kernel) or `seqpipe.kernels.pallas_gpu` (`pallas_gpu`, the
Pallas Triton kernel for NVIDIA GPUs). `auto` picks per backend (`resolve`), once, before
the step is traced (`seqpipe.run.run_config`); `attend` refuses it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from seqpipe.kernels import blockwise
from seqpipe.kernels.rope import NO_SCALING, RopeScaling
from seqpipe.kernels.rope import tables as rope_tables


def rope(
    x_BxQxHxE: jax.Array,
    offset: int,
    base: float,
    scaling: RopeScaling = NO_SCALING,
    positions_BxQ: jax.Array | None = None,
) -> jax.Array:
    """Rotary position embedding at absolute positions offset .. offset + Q - 1 (or, given
    `positions_BxQ`, at those: packed rows restart them per document), the first half of
    each head paired with the second (HF Llama's `rotate_half`), the frequencies as
    `scaling` extends them (`seqpipe.kernels.rope`).

    Without positions the angles depend only on static shapes, so they are NumPy
    constants: a backward that keeps residuals never has to store them. With positions
    they are gathered from a NumPy table of the offset + Q positions a segment can hold
    (a position never exceeds its index in the row), the static path's values exactly.
    """
    _, q_len, _, head_dim = x_BxQxHxE.shape
    if positions_BxQ is not None:
        return _rope_at(x_BxQxHxE, positions_BxQ, offset + q_len, base, scaling)
    pos = np.arange(q_len, dtype=np.int64) + offset
    tables = rope_tables(pos, head_dim, base, scaling, accumulation(x_BxQxHxE.dtype))
    cos, sin = (t[None, :, None, :] for t in tables)
    return rotate(x_BxQxHxE, cos, sin)


def accumulation(dtype) -> np.dtype:
    """The dtype RoPE, softmax, norms, logits and the loss are computed in: float32 for
    float32 and narrower models, float64 for a float64 one (the exact reference
    `seqpipe.models.noise` measures against)."""
    return np.dtype(jnp.promote_types(dtype, jnp.float32))


def rotate(x, cos, sin):
    x1, x2 = jnp.split(x.astype(accumulation(x.dtype)), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def _angles_at(positions_BxQ, table_len: int, head_dim: int, base, scaling, dtype):
    """(cos, sin) [b, Q, 1, E/2] gathered at the positions from the static tables."""
    tables = rope_tables(np.arange(table_len), head_dim, base, scaling, accumulation(dtype))
    at = jnp.clip(positions_BxQ, 0, table_len - 1)
    return tuple(jnp.asarray(t)[at][:, :, None, :] for t in tables)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rope_at(x, positions_BxQ, table_len: int, base: float, scaling: RopeScaling):
    """`rope` at run-time positions. Its backward (the rotation by minus the angles) keeps
    the positions alone, not the gathered cos and sin."""
    cos, sin = _angles_at(positions_BxQ, table_len, x.shape[-1], base, scaling, x.dtype)
    return rotate(x, cos, sin)


def _rope_at_fwd(x, positions_BxQ, table_len, base, scaling):
    return _rope_at(x, positions_BxQ, table_len, base, scaling), positions_BxQ


def _rope_at_bwd(table_len, base, scaling, positions_BxQ, d_out):
    cos, sin = _angles_at(positions_BxQ, table_len, d_out.shape[-1], base, scaling, d_out.dtype)
    return rotate(d_out, cos, -sin), None


_rope_at.defvjp(_rope_at_fwd, _rope_at_bwd)


NAME_SCOPE = "segment_attention"
IMPLEMENTATIONS = ("auto", "xla", "blockwise", "splash", "pallas_gpu")
# What `auto` runs on each JAX platform: the fused kernel where there is one; elsewhere
# blockwise, exact like `xla` but without its [b, H, Q, P + Q] float32 scores. GPUs stay
# on blockwise until a device run measures `pallas_gpu` faster (it has not run on one).
# A TPU step compiled with a memory budget falls back to blockwise where splash's does not
# fit (`seqpipe.run.attention_auto`).
AUTO = {"tpu": "splash", "gpu": "blockwise", "cuda": "blockwise", "rocm": "blockwise"}
AUTO_DEFAULT = "blockwise"
# The Pallas kernels and the platforms they compile for.
KERNEL_PLATFORMS = {"splash": ("tpu",), "pallas_gpu": ("gpu", "cuda")}


def resolve(name: str, platform: str | None = None) -> str:
    """The implementation `name` runs as on `platform` (default: JAX's default backend)."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attention {name!r} is not one of {list(IMPLEMENTATIONS)}")
    return AUTO.get(platform or jax.default_backend(), AUTO_DEFAULT) if name == "auto" else name


def _implementation(name: str) -> str:
    """`name`, which must be an implementation: `auto` is resolved before a step is traced
    (`seqpipe.pipeline.spec.attention_on`, for the platform the step runs on)."""
    if name == "auto" or name not in IMPLEMENTATIONS:
        raise ValueError(
            f"attention {name!r} is not an implementation of {list(IMPLEMENTATIONS[1:])}; "
            "`auto` is resolved before tracing (seqpipe.run.run_config.resolve)"
        )
    return name


def reads_cache_in_place(name: str) -> bool:
    """Whether `attend_cached` by `name` reads the prefix where it lies in the K/V cache;
    else (`xla`, `splash`: an einsum and a kernel that take arrays) it copies it out."""
    return _implementation(name) in ("blockwise", "pallas_gpu")


def attend(
    name: str,
    q_BxQxHxE: jax.Array,
    k_prefix_BxPxHxE: jax.Array,
    v_prefix_BxPxHxE: jax.Array,
    k_seg_BxQxHxE: jax.Array,
    v_seg_BxQxHxE: jax.Array,
    documents: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Segment attention (the contract of `segment_attention`) by implementation `name`;
    `documents` (q ids [b, Q], kv ids [b, P + Q]; `seqpipe.models.document_mask`): the document
    mask."""
    args = (q_BxQxHxE, k_prefix_BxPxHxE, v_prefix_BxPxHxE, k_seg_BxQxHxE, v_seg_BxQxHxE)
    _check(*args[:4])
    _check_documents(documents, q_BxQxHxE.shape[1], k_prefix_BxPxHxE.shape[1])
    extra = {} if documents is None else {"documents": documents}
    impl = _implementation(name)
    if impl == "blockwise":
        return blockwise.blockwise_attention(*args, **extra)
    if impl == "splash":
        from seqpipe.kernels import splash  # here: Pallas's TPU kernels load only where picked

        return splash.splash_attention(*args, **extra)
    if impl == "pallas_gpu":
        from seqpipe.kernels import pallas_gpu  # here: Pallas's GPU kernels load only where picked

        return pallas_gpu.pallas_gpu_attention(*args, **extra)
    return segment_attention(*args, documents)


def attend_cached(
    name: str, q_BxQxHxE, prefix, sink_k, sink_v, prefix_len: int, k_seg, v_seg, documents=None
):
    """`attend` with the prefix's first `prefix_len` positions read from the KV cache where
    they lie (`prefix`: a `kv_cache.Prefix`); the prefix's dK and dV come back as the
    cotangents of `sink_k`, `sink_v` ([b, >= prefix_len, H, E], values unread: zeros).
    `blockwise` and `pallas_gpu` read the cache block by block; `xla` and `splash` (whose
    kernel takes the prefix as an array) get it copied out of the cache (per layer) and
    add the sinks to it, so their gradients flow as before. `documents`: as `attend`'s,
    the kv ids over the prefix's `prefix_len` positions and the segment's."""
    impl = _implementation(name)
    _check_documents(documents, q_BxQxHxE.shape[1], prefix_len)
    extra = {} if documents is None else {"documents": documents}
    if impl == "blockwise":
        return blockwise.cached_attention(
            q_BxQxHxE, prefix, sink_k, sink_v, k_seg, v_seg, prefix_len, **extra
        )
    if impl == "pallas_gpu":
        from seqpipe.kernels import pallas_gpu  # here: Pallas's GPU kernels load only where picked

        return pallas_gpu.cached_attention(
            q_BxQxHxE, prefix, sink_k, sink_v, k_seg, v_seg, prefix_len, **extra
        )
    dtype = q_BxQxHxE.dtype
    k_prefix, v_prefix = (
        prefix.block(which, 0, prefix_len, dtype) + sink[:, :prefix_len]
        for which, sink in ((0, sink_k), (1, sink_v))
    )
    return attend(name, q_BxQxHxE, k_prefix, v_prefix, k_seg, v_seg, documents)


def _check_documents(documents, q_len: int, prefix_len: int):
    if documents is None:
        return
    q_ids, kv_ids = documents
    if q_ids.shape[1] != q_len or kv_ids.shape[1] != prefix_len + q_len:
        raise ValueError(
            f"document ids cover {q_ids.shape[1]} queries and {kv_ids.shape[1]} keys; "
            f"expected {q_len} and {prefix_len} prefix + {q_len} segment"
        )


def _check(q_BxQxHxE, k_prefix_BxPxHxE, v_prefix_BxPxHxE, k_seg_BxQxKxE):
    q_len, prefix_len = q_BxQxHxE.shape[1], k_prefix_BxPxHxE.shape[1]
    if k_seg_BxQxKxE.shape[1] != q_len or v_prefix_BxPxHxE.shape[1] != prefix_len:
        raise ValueError(
            f"keys cover {prefix_len} prefix + {k_seg_BxQxKxE.shape[1]} segment positions; "
            f"expected the segment's own {q_len}"
        )
    heads, kv_heads = q_BxQxHxE.shape[2], k_seg_BxQxKxE.shape[2]
    if heads % kv_heads or k_prefix_BxPxHxE.shape[2] != kv_heads:
        raise ValueError(
            f"{heads} query heads do not group over {kv_heads} K/V heads "
            f"(prefix {k_prefix_BxPxHxE.shape[2]})"
        )


def grouped(q_BxQxHxE: jax.Array, kv_heads: int) -> jax.Array:
    """Query heads [b, Q, H, E] as [b, Q, K, H/K, E]: query head h reads K/V head
    h // (H/K), as HF's `repeat_kv` pairs them, without repeating K/V in memory."""
    b, q_len, heads, width = q_BxQxHxE.shape
    return q_BxQxHxE.reshape(b, q_len, kv_heads, heads // kv_heads, width)


def ungrouped(x_BxQxKxGxE: jax.Array) -> jax.Array:
    b, q_len, kv, group, width = x_BxQxKxGxE.shape
    return x_BxQxKxGxE.reshape(b, q_len, kv * group, width)


def _probs(q, k_prefix, k_seg, documents=None):
    """Softmax probabilities [b, K, G, Q, *] of the segment's (grouped) queries over
    (prefix, own) keys, as two blocks.

    The diagonal block's mask is an additive NumPy constant (0 on and below, -inf above).
    The row maximum over the own block is finite (the diagonal is never masked), so an
    empty prefix needs no special case. `documents` (q ids, kv ids) also masks every key
    of another document (`document_mask.mask`); the diagonal stays unmasked.
    """
    scale, f32 = q.shape[-1] ** -0.5, accumulation(q.dtype)

    def scores(k):
        s = jnp.einsum("bqhge,bkhe->bhgqk", q, k, preferred_element_type=f32)
        return s * scale

    q_len = q.shape[1]
    diagonal = np.where(np.tril(np.ones((q_len, q_len), bool)), 0.0, -np.inf).astype(np.float32)
    s_prefix, s_seg = scores(k_prefix), scores(k_seg) + diagonal
    if documents is not None:
        q_ids, kv_ids = documents
        same = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None, None]  # [b, 1, 1, Q, P+Q]
        prefix_len = k_prefix.shape[1]
        s_prefix = jnp.where(same[..., :prefix_len], s_prefix, -np.inf)
        s_seg = jnp.where(same[..., prefix_len:], s_seg, -np.inf)
    row_max = jnp.maximum(
        s_prefix.max(-1, keepdims=True, initial=-np.inf), s_seg.max(-1, keepdims=True)
    )
    e_prefix, e_seg = jnp.exp(s_prefix - row_max), jnp.exp(s_seg - row_max)
    total = e_prefix.sum(-1, keepdims=True) + e_seg.sum(-1, keepdims=True)
    return (e_prefix / total).astype(q.dtype), (e_seg / total).astype(q.dtype)


def _weighted_values(p_prefix, p_seg, v_prefix, v_seg):
    return jnp.einsum("bhgqk,bkhe->bqhge", p_prefix, v_prefix) + jnp.einsum(
        "bhgqk,bkhe->bqhge", p_seg, v_seg
    )


@jax.custom_vjp
def segment_attention(
    q_BxQxHxE: jax.Array,
    k_prefix_BxPxKxE: jax.Array,
    v_prefix_BxPxKxE: jax.Array,
    k_seg_BxQxKxE: jax.Array,
    v_seg_BxQxKxE: jax.Array,
    documents: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Softmax attention of a segment's queries over the cached prefix and themselves.

    The queries sit at absolute positions [P, P + Q), P = prefix length, and see every
    prefix key plus their own segment's keys up to the diagonal. Shapes are static, so
    each segment compiles to exactly its causal key range. H query heads share K K/V
    heads in groups of H/K (`grouped`; K = H is multi-head attention).

    The prefix and the segment's K/V enter as separate blocks, and the backward is
    written by hand, so that what a unit keeps for its backward is its inputs (the
    prefix by reference: it already lives in the KV cache, never copied per unit) and
    the probabilities once, in the compute dtype. Autodiff of a softmax followed by
    sliced PV products would keep them twice: the softmax output and the slices.

    `documents` (q ids [b, Q], kv ids [b, P + Q], never decreasing along a row;
    `seqpipe.models.document_mask`): a query also sees only keys of its own document (the oracle of
    every implementation's document mask); masked keys get exact zero cotangents.
    """
    args = (q_BxQxHxE, k_prefix_BxPxKxE, v_prefix_BxPxKxE, k_seg_BxQxKxE, v_seg_BxQxKxE)
    return _attention_fwd(*args, documents)[0]


# The name scope marks the attention's equations for `flops.breakdown`: once autodiff
# inlines a custom_vjp's rules, their source frames are the caller's.
@jax.named_scope(NAME_SCOPE)
def _attention_fwd(q, k_prefix, v_prefix, k_seg, v_seg, documents=None):
    _check(q, k_prefix, v_prefix, k_seg)
    p_prefix, p_seg = _probs(grouped(q, k_seg.shape[2]), k_prefix, k_seg, documents)
    out = ungrouped(_weighted_values(p_prefix, p_seg, v_prefix, v_seg))
    return out, (q, k_prefix, v_prefix, k_seg, v_seg, p_prefix, p_seg, documents)


@jax.named_scope(NAME_SCOPE)
def _attention_bwd(residuals, d_out):
    """The softmax backward per block: dS = P * (dP - rowsum(P * dP)) * scale; each K/V
    head's cotangent sums over the query heads of its group."""
    q, k_prefix, v_prefix, k_seg, v_seg, p_prefix, p_seg, documents = residuals
    f32, scale = accumulation(q.dtype), q.shape[-1] ** -0.5
    q, d_out = grouped(q, k_seg.shape[2]), grouped(d_out, k_seg.shape[2])

    def d_probs(v):
        return jnp.einsum("bqhge,bkhe->bhgqk", d_out, v, preferred_element_type=f32)

    dp_prefix, dp_seg = d_probs(v_prefix), d_probs(v_seg)
    row = (p_prefix * dp_prefix).sum(-1, keepdims=True, dtype=f32) + (p_seg * dp_seg).sum(
        -1, keepdims=True, dtype=f32
    )
    ds_prefix = (p_prefix * (dp_prefix - row) * scale).astype(q.dtype)
    ds_seg = (p_seg * (dp_seg - row) * scale).astype(q.dtype)
    dq = jnp.einsum("bhgqk,bkhe->bqhge", ds_prefix, k_prefix) + jnp.einsum(
        "bhgqk,bkhe->bqhge", ds_seg, k_seg
    )

    def d_keys(ds):
        return jnp.einsum("bhgqk,bqhge->bkhe", ds, q)

    def d_values(p):
        return jnp.einsum("bhgqk,bqhge->bkhe", p, d_out)

    grads = (ungrouped(dq), d_keys(ds_prefix), d_values(p_prefix), d_keys(ds_seg), d_values(p_seg))
    return (*grads, None if documents is None else (None, None))


segment_attention.defvjp(_attention_fwd, _attention_bwd)
