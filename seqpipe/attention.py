"""Causal attention of one sequence segment against the keys and values before it.

A segment of queries at absolute positions [offset, offset + Q) attends to keys at
[0, offset + Q): the cached prefix [0, offset) plus its own. The causal mask is
bottom-right aligned by construction: query i sees key j iff j <= offset + i. A
top-left-aligned flag would be wrong here whenever Q < number of keys.
"""

import jax
import jax.numpy as jnp


def rope(x_BxQxHxE: jax.Array, offset: int, base: float) -> jax.Array:
    """Rotary position embedding at absolute positions offset .. offset + Q - 1."""
    _, q_len, _, head_dim = x_BxQxHxE.shape
    half = head_dim // 2
    inv_freq = 1.0 / (base ** (jnp.arange(half, dtype=jnp.float32) / half))
    pos = jnp.arange(q_len, dtype=jnp.float32) + offset
    angle_QxE2 = pos[:, None] * inv_freq[None, :]
    sin = jnp.sin(angle_QxE2)[None, :, None, :]
    cos = jnp.cos(angle_QxE2)[None, :, None, :]
    x1, x2 = jnp.split(x_BxQxHxE.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x_BxQxHxE.dtype)


def segment_attention(
    q_BxQxHxE: jax.Array, k_BxKxHxE: jax.Array, v_BxKxHxE: jax.Array, offset: int
) -> jax.Array:
    """Softmax attention where the queries start at absolute position `offset`.

    The keys cover positions [0, offset + Q); `offset` is static so each segment
    shape compiles to exactly its causal key range, with no padded keys.
    """
    q_len, k_len = q_BxQxHxE.shape[1], k_BxKxHxE.shape[1]
    if k_len != offset + q_len:
        raise ValueError(
            f"keys cover {k_len} positions; expected offset + queries = {offset + q_len}"
        )
    scale = q_BxQxHxE.shape[-1] ** -0.5
    logits_BxHxQxK = jnp.einsum(
        "bqhe,bkhe->bhqk", q_BxQxHxE, k_BxKxHxE, preferred_element_type=jnp.float32
    )
    q_pos = offset + jnp.arange(q_len)[:, None]
    k_pos = jnp.arange(k_len)[None, :]
    logits_BxHxQxK = jnp.where(k_pos <= q_pos, logits_BxHxQxK * scale, -jnp.inf)
    probs = jax.nn.softmax(logits_BxHxQxK, axis=-1).astype(v_BxKxHxE.dtype)
    return jnp.einsum("bhqk,bkhe->bqhe", probs, v_BxKxHxE)
