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

Packed documents (`documents`: q ids [b, Q], kv ids [b, P + Q], never decreasing along a
row; `seqpipe.models.document_mask`): a query also sees only its own document's keys. Key blocks
wholly before the first key any row of a query block sees (its first query's document start,
the earliest of the block's rows) are not visited: the loops start past them (run-time
bounds), forward and backward, so a segment whose queries all start new documents reads
no prefix block at all. Within the blocks visited the ids mask the scores.

Letters: b rows, Q queries (the segment), P prefix keys, H query heads of width E (as
[K, G] inside), K K/V heads; bq, bk the block sizes (capped by the lengths).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from seqpipe.kernels import attention_residuals, kv_cache

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


class _Skips:
    """Where each query block's key loops start, from the document ids (None: at 0): the
    first prefix block and own block holding a key any of its rows sees."""

    def __init__(self, documents, qb: _Blocks, pb: _Blocks, kb: _Blocks):
        q_ids, kv_ids = documents
        self.q_ids, self.kv_ids, self.prefix_len = q_ids, kv_ids, pb.length
        starts = np.minimum(np.arange(qb.count) * qb.size, qb.length - qb.size)
        # The first key each row's first query sees: ids never decrease along a row.
        first = jax.vmap(jnp.searchsorted)(kv_ids, q_ids[:, starts]).min(0)  # [query blocks]
        wholly_before = jnp.where(first >= pb.length, pb.count, first // max(pb.size, 1))
        self.prefix = wholly_before.astype(jnp.int32)  # first prefix block, per query block
        self.own = (jnp.maximum(first - pb.length, 0) // kb.size).astype(jnp.int32)

    def query_ids(self, start, size):
        return jax.lax.dynamic_slice_in_dim(self.q_ids, start, size, axis=1)

    def key_ids(self, start, size, own: bool):
        at = start + (self.prefix_len if own else 0)
        return jax.lax.dynamic_slice_in_dim(self.kv_ids, at, size, axis=1)

    def readers_end(self, first_blocks, j):
        """The query blocks that visit key block j: those before this end (their first
        blocks never decrease)."""
        return jnp.sum(first_blocks <= j).astype(jnp.int32)


def _same_document(q_ids_b, k_ids_b):
    """[b, 1, 1, bq, bk]: whether each query and key lie in one document."""
    return (q_ids_b[:, :, None] == k_ids_b[:, None, :])[:, None, None]


def _reader(k_prefix, v_prefix):
    """(read, prefix length) of prefix arrays: read(which, start, size) is block
    [b, size, H, E] of K (which 0) or V (1)."""
    return (lambda which, start, size: _slice((k_prefix, v_prefix)[which], start, size)), (
        k_prefix.shape[1]
    )


def _forward(q, prefix, k_seg, v_seg, block_q, block_k, documents=None):
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
    skips = None if documents is None else _Skips(documents, qb, pb, kb)

    def query_block(i, carry):
        out, lse = carry
        q_i = _slice(q, qb.start(i), qb.size)
        rows = qb.positions(i)
        q_ids = None if skips is None else skips.query_ids(qb.start(i), qb.size)

        def visit(state, k_j, v_j, mask_QxK, k_ids=None):
            m, total, acc = state
            if k_ids is not None:
                same = _same_document(q_ids, k_ids)
                mask_QxK = same if mask_QxK is None else mask_QxK & same
            s = _scores(q_i, k_j)
            s = s if mask_QxK is None else jnp.where(mask_QxK, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            if k_ids is not None:  # a row may have seen no key yet: no -inf - -inf
                m_new = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum(
                "bhgqk,bkhe->bqhge", p.astype(v_j.dtype), v_j, preferred_element_type=jnp.float32
            )
            acc = acc * _rows_second(alpha)[..., None] + pv
            return m_new, total * alpha + p.sum(-1), acc

        def key_ids(blocks, j, own):
            return None if skips is None else skips.key_ids(blocks.start(j), blocks.size, own)

        def prefix_block(j, state):
            k_j, v_j = (read(which, pb.start(j), pb.size) for which in (0, 1))
            whole = pb.length % pb.size == 0  # no block overlaps its neighbour: none masked
            mask = None if whole else pb.fresh(j)[None, :]
            return visit(state, k_j, v_j, mask, key_ids(pb, j, False))

        def own_block(j, state):
            k_j, v_j = (_slice(x, kb.start(j), kb.size) for x in (k_seg, v_seg))
            cols = kb.positions(j)
            causal = kb.fresh(j)[None, :] & (cols[None, :] <= rows[:, None])
            return visit(state, k_j, v_j, causal, key_ids(kb, j, True))

        state = (
            jnp.full((b, h, g, qb.size), -jnp.inf, jnp.float32),
            jnp.zeros((b, h, g, qb.size), jnp.float32),
            jnp.zeros((b, qb.size, h, g, e), jnp.float32),
        )
        # Key blocks before the first key the block's rows see are skipped, not masked.
        prefix_from, own_from = (0, 0) if skips is None else (skips.prefix[i], skips.own[i])
        if pb.count:  # an empty prefix has no blocks to trace
            state = jax.lax.fori_loop(prefix_from, pb.count, prefix_block, state)
        seen = _own_blocks_seen(qb, kb, i)
        m, total, acc = jax.lax.fori_loop(own_from, seen, own_block, state)
        o_i = (acc / _rows_second(total)[..., None]).astype(out.dtype)
        out = jax.lax.dynamic_update_slice_in_dim(out, o_i, qb.start(i), axis=1)
        lse = jax.lax.dynamic_update_slice_in_dim(lse, m + jnp.log(total), qb.start(i), axis=3)
        return out, lse

    init = (jnp.zeros_like(q), jnp.zeros((b, h, g, q_len), jnp.float32))
    out, lse = jax.lax.fori_loop(0, qb.count, query_block, init)
    # Named for `remat=dots` to keep: the backward reads them besides the inputs.
    return attention_residuals.mark(out.reshape(b, q_len, heads, e), lse)


class _Cotangents(NamedTuple):
    """What every score block of the backward reads: q, dO (grouped by K/V head), the
    forward's logsumexp, D = rowsum(dO * O), the query blocks and the document skips."""

    q: jax.Array
    d_out: jax.Array
    lse: jax.Array
    delta: jax.Array
    qb: _Blocks
    skips: _Skips | None


def _block_grads(q_i, do_i, lse_i, delta_i, k_j, v_j, mask, dk_j, dv_j):
    """One [b, H, bq, bk] score block's backward: (its dq, dk_j and dv_j with its part
    added), float32; masked-out scores get probability 0."""
    f32 = jnp.float32
    p = jnp.where(mask, jnp.exp(_scores(q_i, k_j) - lse_i[..., None]), 0.0)
    dv_j += jnp.einsum("bhgqk,bqhge->bkhe", p.astype(q_i.dtype), do_i, preferred_element_type=f32)
    dp = jnp.einsum("bqhge,bkhe->bhgqk", do_i, v_j, preferred_element_type=f32)
    ds = (p * (dp - delta_i[..., None]) * q_i.shape[-1] ** -0.5).astype(q_i.dtype)
    dk_j += jnp.einsum("bhgqk,bqhge->bkhe", ds, q_i, preferred_element_type=f32)
    dq_i = jnp.einsum("bhgqk,bkhe->bqhge", ds, k_j, preferred_element_type=f32)
    return dq_i, dk_j, dv_j


def _write_block(words, block, blocks: _Blocks, j, fresh, dtype):
    """Key block j's finished dK or dV cast to `dtype` into its storage words; an
    overlapping last block keeps what the one before wrote."""
    start = blocks.start(j)
    old = kv_cache.from_words(_slice(words, start, blocks.size), dtype)
    new = jnp.where(fresh[None, :, None, None], block.astype(dtype), old)
    return jax.lax.dynamic_update_slice_in_dim(words, kv_cache.to_words(new), start, axis=1)


def _key_pass(c: _Cotangents, blocks: _Blocks, read_kv, first_query_block, causal, own):
    """The loop body over one key range's blocks: (dq, dK words, dV words) -> the same with
    key block j's dK, dV written and what it adds to dq. With documents, only the query
    blocks whose rows see key block j visit it."""
    qb, skips, f32 = c.qb, c.skips, jnp.float32

    def key_block(j, carry):
        dq, dk, dv = carry
        k_j, v_j = (read_kv(which, blocks.start(j), blocks.size) for which in (0, 1))
        cols, fresh = blocks.positions(j), blocks.fresh(j)
        k_ids = None if skips is None else skips.key_ids(blocks.start(j), blocks.size, own)

        def query_block(i, inner):
            dq, dk_j, dv_j = inner
            start = qb.start(i)
            q_i, do_i = _slice(c.q, start, qb.size), _slice(c.d_out, start, qb.size)
            lse_i = jax.lax.dynamic_slice_in_dim(c.lse, start, qb.size, axis=3)
            delta_i = jax.lax.dynamic_slice_in_dim(c.delta, start, qb.size, axis=3)
            rows = qb.positions(i)
            # Rows an earlier query block already covered add nothing here.
            mask = fresh[None, :] & (rows >= i * qb.size)[:, None]
            if causal:
                mask &= cols[None, :] <= rows[:, None]
            if k_ids is not None:
                mask = mask & _same_document(skips.query_ids(start, qb.size), k_ids)
            dq_i, dk_j, dv_j = _block_grads(q_i, do_i, lse_i, delta_i, k_j, v_j, mask, dk_j, dv_j)
            dq = jax.lax.dynamic_update_slice_in_dim(
                dq, _slice(dq, start, qb.size) + dq_i, start, axis=1
            )
            return dq, dk_j, dv_j

        b, _, h, _, e = c.q.shape
        zeros = jnp.zeros((b, blocks.size, h, e), f32)
        lo, hi = first_query_block(j), qb.count
        if skips is not None:
            hi = skips.readers_end(skips.own if own else skips.prefix, j)
        dq, dk_j, dv_j = jax.lax.fori_loop(lo, hi, query_block, (dq, zeros, zeros))
        write = functools.partial(_write_block, blocks=blocks, j=j, fresh=fresh, dtype=c.q.dtype)
        return dq, write(dk, dk_j), write(dv, dv_j)

    return key_block


def _backward(
    q, prefix, k_seg, v_seg, out, lse, d_out, block_q, block_k, out_len=None, documents=None
):
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
    skips = None if documents is None else _Skips(documents, qb, pb, kb)
    c = _Cotangents(q, d_out, lse, delta, qb, skips)

    def words(length):
        return jnp.zeros((b, length, h, e), kv_cache.storage_dtype(dtype))

    dq = jnp.zeros(q.shape, f32)
    dkp = dvp = words(prefix_len if out_len is None else out_len)
    prefix_pass = _key_pass(c, pb, read, lambda j: 0, causal=False, own=False)
    # Key blocks no query block visits (before the first one's first) are skipped: their
    # cotangents stay zero.
    prefix_from, own_from = (0, 0) if skips is None else (skips.prefix[0], skips.own[0])
    if pb.count:
        dq, dkp, dvp = jax.lax.fori_loop(prefix_from, pb.count, prefix_pass, (dq, dkp, dvp))
    dks = dvs = words(q_len)
    own_kv = _reader(k_seg, v_seg)[0]
    first = functools.partial(_first_query_block, qb, kb)
    own = _key_pass(c, kb, own_kv, first, causal=True, own=True)
    dq, dks, dvs = jax.lax.fori_loop(own_from, kb.count, own, (dq, dks, dvs))
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
    documents: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """`attention.segment_attention`'s contract, one [b, H, bq, bk] score block at a time;
    `documents` (q ids, kv ids): the document mask, key blocks before it skipped."""
    prefix = _reader(k_prefix_BxPxHxE, v_prefix_BxPxHxE)
    args = (q_BxQxHxE, prefix, k_seg_BxQxHxE, v_seg_BxQxHxE, block_q, block_k, documents)
    return _forward(*args)[0]


def _fwd(q, k_prefix, v_prefix, k_seg, v_seg, block_q, block_k, documents=None):
    prefix = _reader(k_prefix, v_prefix)
    out, lse = _forward(q, prefix, k_seg, v_seg, block_q, block_k, documents)
    return out, (q, k_prefix, v_prefix, k_seg, v_seg, out, lse, documents)


def _bwd(block_q, block_k, residuals, d_out):
    q, k_prefix, v_prefix, k_seg, v_seg, out, lse, documents = residuals
    prefix = _reader(k_prefix, v_prefix)
    args = (q, prefix, k_seg, v_seg, out, lse, d_out, block_q, block_k, None, documents)
    grads = _backward(*args)
    like = (q, k_prefix, v_prefix, k_seg, v_seg)
    grads = tuple(g.astype(x.dtype) for g, x in zip(grads, like, strict=True))
    return (*grads, None if documents is None else (None, None))


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
    documents: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """`blockwise_attention` with the prefix's first `prefix_len` positions read block by
    block from `cache` (a `kv_cache.Prefix`: the cache's storage words, the slot and the
    layer), so no copy of the prefix is made, nor kept for the backward. The cache carries
    no gradient (its words may be integers); the prefix's dK and dV are returned as the
    cotangents of the sinks, arrays [b, >= prefix_len, H, E] whose values are never read
    (zeros, as the executor passes them; positions past the prefix get zero cotangents).
    `documents`: as `blockwise_attention`'s (kv ids over the prefix's `prefix_len` keys and
    the segment's)."""
    prefix = _cache_reader(cache, prefix_len, q_BxQxHxE.dtype)
    args = (q_BxQxHxE, prefix, k_seg_BxQxHxE, v_seg_BxQxHxE, block_q, block_k, documents)
    return _forward(*args)[0]


def _cached_fwd(
    q, cache, sink_k, sink_v, k_seg, v_seg, prefix_len, block_q, block_k, documents=None
):
    prefix = _cache_reader(cache, prefix_len, q.dtype)
    out, lse = _forward(q, prefix, k_seg, v_seg, block_q, block_k, documents)
    # The sinks are not kept, only their length: their values are never read.
    sink_len = jnp.zeros((0, sink_k.shape[1]), jnp.int8)
    return out, (q, cache, k_seg, v_seg, out, lse, sink_len, documents)


def _cached_bwd(prefix_len, block_q, block_k, residuals, d_out):
    q, cache, k_seg, v_seg, out, lse, sink_len, documents = residuals
    prefix = _cache_reader(cache, prefix_len, q.dtype)
    args = (q, prefix, k_seg, v_seg, out, lse, d_out, block_q, block_k, sink_len.shape[1])
    dq, dkp, dvp, dks, dvs = _backward(*args, documents)
    grads = (dq, cache.no_gradient(), dkp, dvp, dks, dvs)
    return (*grads, None if documents is None else (None, None))


cached_attention.defvjp(_cached_fwd, _cached_bwd)


def executed_flops(
    q_len: int, prefix_len: int, width: int, block_q=BLOCK_Q, block_k=BLOCK_K, documents=None
):
    """Forward matmul FLOPs (QK and PV, per row) the loops run for one segment, `width` =
    H * E: the blocks visited, each whole (the diagonal's masked half and an overlapping
    last block included). `documents` (q ids [1, Q], kv ids [1, P + Q]): the packed row's,
    whose skipped key blocks are not counted (the backward visits the same blocks)."""
    qb, pb, kb = _Blocks(q_len, block_q), _Blocks(prefix_len, block_k), _Blocks(q_len, block_k)
    seen = np.array([int(_own_blocks_seen(qb, kb, i)) for i in range(qb.count)])
    prefix_from = own_from = np.zeros(qb.count, int)
    if documents is not None:
        skips = _Skips(tuple(jnp.asarray(x) for x in documents), qb, pb, kb)
        prefix_from, own_from = np.asarray(skips.prefix), np.asarray(skips.own)
    prefix_blocks = int(np.sum(pb.count - prefix_from)) if pb.count else 0
    own_blocks = int(np.sum(np.maximum(seen - own_from, 0)))
    keys = prefix_blocks * pb.size + own_blocks * kb.size
    return 2 * 2 * qb.size * keys * width
