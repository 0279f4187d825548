"""Segment attention in blocks (FlashAttention-2 in plain JAX): O(block_q x block_k) scores.

The contract of `attention.segment_attention`: queries at absolute positions [P, P + Q)
see the prefix's P keys unmasked and their own Q keys up to the diagonal. The forward
loops over query blocks; for each, over the prefix's key blocks and then its own key blocks
up to the diagonal (the ones above it are never visited), with an online softmax in
float32. It keeps the output and the rows' log-sum-exp; the hand-written backward
recomputes each block's probabilities from them (autodiff of the loops would store every
block). The backward loops over key blocks outside, query blocks inside, accumulating dq.

No array is padded or concatenated, so the prefix is read where it lives: a length that
is not a multiple of the block gets a last block that starts earlier (it overlaps the one
before), and a mask drops the overlap. Overlapping query rows are computed twice, to the
same values (written twice in the forward, masked out of the backward's sums).

Grouped-query attention: the H query heads are viewed as [K, G] (K K/V heads, G = H/K
query heads each) and every block product runs per K/V head over its group, so K/V are
never repeated; dK and dV sum over the group inside the products.

Letters: b rows, Q queries (the segment), P prefix keys, H query heads of width E (as
[K, G] inside), K K/V heads; bq, bk the block sizes (capped by the lengths).
"""

import functools

import jax
import jax.numpy as jnp

from seqpipe import kv_cache

BLOCK_Q = 512
BLOCK_K = 512


class _Blocks:
    """Block `i` of a length cut into blocks of `size`: the last one is moved back to end
    at the length (so it overlaps its neighbour), and `fresh` masks what earlier blocks
    covered."""

    def __init__(self, length: int, size: int):
        self.length, self.size = length, min(size, length)
        self.count = -(-length // self.size) if length else 0

    def start(self, i):
        return jnp.minimum(i * self.size, self.length - self.size)

    def positions(self, i):
        return self.start(i) + jnp.arange(self.size)

    def fresh(self, i):
        return self.positions(i) >= i * self.size


def _slice(x_BxLxHxE, start, size):
    return jax.lax.dynamic_slice_in_dim(x_BxLxHxE, start, size, axis=1)


def _scores(q_b, k_b):
    """[b, K, G, bq, bk] float32 scores of grouped queries [b, bq, K, G, E]."""
    scale = q_b.shape[-1] ** -0.5
    return jnp.einsum("bqhge,bkhe->bhgqk", q_b, k_b, preferred_element_type=jnp.float32) * scale


def _grouped(x_BxQxHxE, kv_heads: int):
    b, q_len, heads, e = x_BxQxHxE.shape
    return x_BxQxHxE.reshape(b, q_len, kv_heads, heads // kv_heads, e)


def _rows_last(x_BxQxKxG):
    """[b, Q, K, G] -> [b, K, G, Q] (and back with `_rows_second`)."""
    return jnp.moveaxis(x_BxQxKxG, 1, 3)


def _rows_second(x_BxKxGxQ):
    return jnp.moveaxis(x_BxKxGxQ, 3, 1)


def _own_blocks_seen(qb: _Blocks, kb: _Blocks, i):
    """How many own key blocks query block i visits: up to its last row's diagonal."""
    last = qb.start(i) + qb.size - 1
    return jnp.minimum(kb.count, last // kb.size + 1)


def _first_query_block(qb: _Blocks, kb: _Blocks, j):
    """The first query block whose rows reach own key block j's first key."""
    return jnp.minimum(kb.start(j) // qb.size, qb.count - 1)


def _reader(k_prefix, v_prefix):
    """(read, prefix length) of prefix arrays: read(which, start, size) is block
    [b, size, H, E] of K (which 0) or V (1)."""
    return (lambda which, start, size: _slice((k_prefix, v_prefix)[which], start, size)), (
        k_prefix.shape[1]
    )


def _forward(q, prefix, k_seg, v_seg, block_q, block_k):
    """(out [b, Q, H, E], log-sum-exp [b, K, G, Q] float32)."""
    read, prefix_len = prefix
    b, q_len, heads, e = q.shape
    h = k_seg.shape[2]
    g = heads // h
    q = _grouped(q, h)
    qb, pb, kb = (
        _Blocks(q_len, block_q),
        _Blocks(prefix_len, block_k),
        _Blocks(q_len, block_k),
    )

    def query_block(i, carry):
        out, lse = carry
        q_i = _slice(q, qb.start(i), qb.size)
        rows = qb.positions(i)

        def visit(state, k_j, v_j, mask_QxK):
            m, total, acc = state
            s = jnp.where(mask_QxK, _scores(q_i, k_j), -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum(
                "bhgqk,bkhe->bqhge", p.astype(v_j.dtype), v_j, preferred_element_type=jnp.float32
            )
            acc = acc * _rows_second(alpha)[..., None] + pv
            return m_new, total * alpha + p.sum(-1), acc

        def prefix_block(j, state):
            k_j, v_j = (read(which, pb.start(j), pb.size) for which in (0, 1))
            return visit(state, k_j, v_j, pb.fresh(j)[None, :])

        def own_block(j, state):
            k_j, v_j = (_slice(x, kb.start(j), kb.size) for x in (k_seg, v_seg))
            cols = kb.positions(j)
            return visit(state, k_j, v_j, kb.fresh(j)[None, :] & (cols[None, :] <= rows[:, None]))

        state = (
            jnp.full((b, h, g, qb.size), -jnp.inf, jnp.float32),
            jnp.zeros((b, h, g, qb.size), jnp.float32),
            jnp.zeros((b, qb.size, h, g, e), jnp.float32),
        )
        if pb.count:  # an empty prefix has no blocks to trace
            state = jax.lax.fori_loop(0, pb.count, prefix_block, state)
        m, total, acc = jax.lax.fori_loop(0, _own_blocks_seen(qb, kb, i), own_block, state)
        o_i = (acc / _rows_second(total)[..., None]).astype(out.dtype)
        out = jax.lax.dynamic_update_slice_in_dim(out, o_i, qb.start(i), axis=1)
        lse = jax.lax.dynamic_update_slice_in_dim(lse, m + jnp.log(total), qb.start(i), axis=3)
        return out, lse

    init = (jnp.zeros_like(q), jnp.zeros((b, h, g, q_len), jnp.float32))
    out, lse = jax.lax.fori_loop(0, qb.count, query_block, init)
    return out.reshape(b, q_len, heads, e), lse


def _backward(q, prefix, k_seg, v_seg, out, lse, d_out, block_q, block_k, out_len=None):
    """(dq, prefix dK, prefix dV, own dK, own dV) in q's dtype, the prefix's `out_len` long
    (default: the prefix's length; zeros past it).

    Each key block's dK, dV are whole once its query loop ends: they are cast then and
    written into storage words (`kv_cache`), so no float32 [b, P, H, E] accumulator lives
    (1 GiB per layer at P = 126976 on gpt_1b), and on CPU no bf16 update is widened."""
    read, prefix_len = prefix
    dtype = q.dtype
    f32 = jnp.float32
    b, q_len, heads, e = q.shape
    h = k_seg.shape[2]
    q, out, d_out = (_grouped(x, h) for x in (q, out, d_out))
    qb, pb, kb = (
        _Blocks(q_len, block_q),
        _Blocks(prefix_len, block_k),
        _Blocks(q_len, block_k),
    )
    # D = rowsum(dO * O): the softmax backward's row term, once for all blocks.
    delta = _rows_last(jnp.sum(d_out.astype(f32) * out.astype(f32), -1))

    def key_pass(blocks: _Blocks, read_kv, first_query_block, causal):
        """dK, dV of one key range (float32) and what its blocks add to dq."""

        def key_block(j, carry):
            dq, dk, dv = carry
            k_j, v_j = (read_kv(which, blocks.start(j), blocks.size) for which in (0, 1))
            cols, fresh = blocks.positions(j), blocks.fresh(j)

            def query_block(i, inner):
                dq, dk_j, dv_j = inner
                start = qb.start(i)
                q_i, do_i = _slice(q, start, qb.size), _slice(d_out, start, qb.size)
                lse_i = jax.lax.dynamic_slice_in_dim(lse, start, qb.size, axis=3)
                delta_i = jax.lax.dynamic_slice_in_dim(delta, start, qb.size, axis=3)
                rows = qb.positions(i)
                # Rows an earlier query block already covered add nothing here.
                mask = fresh[None, :] & (rows >= i * qb.size)[:, None]
                if causal:
                    mask &= cols[None, :] <= rows[:, None]
                p = jnp.where(mask, jnp.exp(_scores(q_i, k_j) - lse_i[..., None]), 0.0)
                dv_j += jnp.einsum(
                    "bhgqk,bqhge->bkhe", p.astype(q.dtype), do_i, preferred_element_type=f32
                )
                dp = jnp.einsum("bqhge,bkhe->bhgqk", do_i, v_j, preferred_element_type=f32)
                ds = (p * (dp - delta_i[..., None]) * q.shape[-1] ** -0.5).astype(q.dtype)
                dk_j += jnp.einsum("bhgqk,bqhge->bkhe", ds, q_i, preferred_element_type=f32)
                dq_i = jnp.einsum("bhgqk,bkhe->bqhge", ds, k_j, preferred_element_type=f32)
                dq = jax.lax.dynamic_update_slice_in_dim(
                    dq, _slice(dq, start, qb.size) + dq_i, start, axis=1
                )
                return dq, dk_j, dv_j

            zeros = jnp.zeros((b, blocks.size, h, e), f32)
            lo = first_query_block(j)
            dq, dk_j, dv_j = jax.lax.fori_loop(lo, qb.count, query_block, (dq, zeros, zeros))

            def add(words, block):  # an overlapping last block keeps what the one before wrote
                start = blocks.start(j)
                old = kv_cache.from_words(_slice(words, start, blocks.size), dtype)
                new = jnp.where(fresh[None, :, None, None], block.astype(dtype), old)
                return jax.lax.dynamic_update_slice_in_dim(
                    words, kv_cache.to_words(new), start, axis=1
                )

            return dq, add(dk, dk_j), add(dv, dv_j)

        return key_block

    def words(length):
        return jnp.zeros((b, length, h, e), kv_cache.storage_dtype(dtype))

    dq = jnp.zeros(q.shape, f32)
    dkp = dvp = words(prefix_len if out_len is None else out_len)
    prefix_pass = key_pass(pb, read, lambda j: 0, causal=False)
    if pb.count:
        dq, dkp, dvp = jax.lax.fori_loop(0, pb.count, prefix_pass, (dq, dkp, dvp))
    dks = dvs = words(q_len)
    own_kv = _reader(k_seg, v_seg)[0]
    own = key_pass(kb, own_kv, functools.partial(_first_query_block, qb, kb), causal=True)
    dq, dks, dvs = jax.lax.fori_loop(0, kb.count, own, (dq, dks, dvs))
    dq = dq.reshape(b, q_len, heads, e).astype(dtype)
    return (dq, *(kv_cache.from_words(g, dtype) for g in (dkp, dvp, dks, dvs)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def blockwise_attention(
    q_BxQxHxE: jax.Array,
    k_prefix_BxPxHxE: jax.Array,
    v_prefix_BxPxHxE: jax.Array,
    k_seg_BxQxHxE: jax.Array,
    v_seg_BxQxHxE: jax.Array,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
) -> jax.Array:
    """`attention.segment_attention`'s contract, one [b, H, bq, bk] score block at a time."""
    prefix = _reader(k_prefix_BxPxHxE, v_prefix_BxPxHxE)
    return _forward(q_BxQxHxE, prefix, k_seg_BxQxHxE, v_seg_BxQxHxE, block_q, block_k)[0]


def _fwd(q, k_prefix, v_prefix, k_seg, v_seg, block_q, block_k):
    out, lse = _forward(q, _reader(k_prefix, v_prefix), k_seg, v_seg, block_q, block_k)
    return out, (q, k_prefix, v_prefix, k_seg, v_seg, out, lse)


def _bwd(block_q, block_k, residuals, d_out):
    q, k_prefix, v_prefix, k_seg, v_seg, out, lse = residuals
    prefix = _reader(k_prefix, v_prefix)
    grads = _backward(q, prefix, k_seg, v_seg, out, lse, d_out, block_q, block_k)
    like = (q, k_prefix, v_prefix, k_seg, v_seg)
    return tuple(g.astype(x.dtype) for g, x in zip(grads, like, strict=True))


blockwise_attention.defvjp(_fwd, _bwd)


# ------------------------------------------------------------------ prefix in a KV cache


def _cache_reader(cache, prefix_len: int, dtype):
    """(read, prefix length) of a prefix that stays in the executor's KV cache
    (`kv_cache.Prefix`): each block is sliced from the cache's words where they lie."""
    return (lambda which, start, size: cache.block(which, start, size, dtype)), prefix_len


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def cached_attention(
    q_BxQxHxE: jax.Array,
    cache,
    sink_k_BxPxHxE: jax.Array,
    sink_v_BxPxHxE: jax.Array,
    k_seg_BxQxHxE: jax.Array,
    v_seg_BxQxHxE: jax.Array,
    prefix_len: int,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
) -> jax.Array:
    """`blockwise_attention` with the prefix's first `prefix_len` positions read block by
    block from `cache` (a `kv_cache.Prefix`: the cache's storage words, the slot and the
    layer), so no copy of the prefix is made, nor kept for the backward. The cache carries
    no gradient (its words may be integers); the prefix's dK and dV are returned as the
    cotangents of the sinks, arrays [b, >= prefix_len, H, E] whose values are never read
    (zeros, as the executor passes them; positions past the prefix get zero cotangents)."""
    prefix = _cache_reader(cache, prefix_len, q_BxQxHxE.dtype)
    return _forward(q_BxQxHxE, prefix, k_seg_BxQxHxE, v_seg_BxQxHxE, block_q, block_k)[0]


def _cached_fwd(q, cache, sink_k, sink_v, k_seg, v_seg, prefix_len, block_q, block_k):
    prefix = _cache_reader(cache, prefix_len, q.dtype)
    out, lse = _forward(q, prefix, k_seg, v_seg, block_q, block_k)
    # The sinks are not kept, only their length: their values are never read.
    sink_len = jnp.zeros((0, sink_k.shape[1]), jnp.int8)
    return out, (q, cache, k_seg, v_seg, out, lse, sink_len)


def _cached_bwd(prefix_len, block_q, block_k, residuals, d_out):
    q, cache, k_seg, v_seg, out, lse, sink_len = residuals
    prefix = _cache_reader(cache, prefix_len, q.dtype)
    grads = _backward(q, prefix, k_seg, v_seg, out, lse, d_out, block_q, block_k, sink_len.shape[1])
    dq, dkp, dvp, dks, dvs = grads
    return dq, cache.no_gradient(), dkp, dvp, dks, dvs


cached_attention.defvjp(_cached_fwd, _cached_bwd)


def executed_flops(q_len: int, prefix_len: int, width: int, block_q=BLOCK_Q, block_k=BLOCK_K):
    """Forward matmul FLOPs (QK and PV, per row) the loops run for one segment, `width` =
    H * E: the blocks visited, each whole (the diagonal's masked half and an overlapping
    last block included)."""
    qb, pb, kb = _Blocks(q_len, block_q), _Blocks(prefix_len, block_k), _Blocks(q_len, block_k)
    own = sum(int(_own_blocks_seen(qb, kb, i)) for i in range(qb.count))
    keys = qb.count * pb.count * pb.size + own * kb.size
    return 2 * 2 * qb.size * keys * width
