"""Segment attention as a Pallas kernel that lowers through Triton (`model.attention=pallas_gpu`).

The contract of `attention.segment_attention`: queries at absolute positions [P, P + Q)
see the prefix's P keys unmasked and their own Q keys up to the diagonal (own key j for
query i iff j <= i). FlashAttention-2, written for this mask:

- forward: one program per (query block, batch row, head); it loops over the prefix's key
  blocks, then its own key blocks up to the diagonal with an online softmax in float32.
  Only blocks that cross the diagonal get the causal mask; blocks above it are never
  visited. It returns the output and the rows' float32 log-sum-exp.
- backward (a `jax.custom_vjp`): D = rowsum(dO * O) in XLA, then three kernels that
  recompute P = exp(S - lse) tile by tile: dK, dV of the prefix (one program per prefix
  key block, every query block, no mask), dK, dV of the segment's own keys (from the first
  query block that reaches the key block, masked while crossing the diagonal), and dq
  (one program per query block, the forward's key loop).

The prefix and the segment's own K/V are two inputs, not one concatenated array: a
concatenation would copy the prefix (which grows to the whole context) on every call and
for every layer, and would keep the copy for the backward. `cached_attention` goes
further: its kernels take the K/V cache's storage words whole, with the slot and layer as
a small int32 input, and slice each prefix tile from there (bitcast from uint16 words to
bf16 in the kernel), so the prefix is never copied, nor kept for the backward.

Layout: every array stays as the model holds it, [b, L, H, E]; a program reads its
[block, E] tiles with a stride of H * E, so nothing is transposed or padded in memory.
Lengths that are not a multiple of a block get a last, partial block: its loads are
masked (zeros past the end), its stores are masked, and past-the-end prefix keys are
masked out of the scores. Past-the-end query rows need no mask in dK, dV: their q, dO,
lse and D load as zeros, so P is 1 there and dP, D and dO are 0: they add exactly 0.

Grouped-query attention (K K/V heads for H query heads, G = H/K each): the forward and
dq programs of query head h read K/V head h // G where it lies (their block specs' index
maps), so K/V are never repeated. The dK/dV programs run per K/V head and loop over its
group's G query heads, summing in float32: they write the K/V heads' cotangents directly,
with no per-query-head partials.

Documents (`documents=(q_ids, kv_ids)`, packed rows): query i sees key j iff j <= P + i and
both lie in the same run of equal ids (ids are non-decreasing along a row, so a document is
one run). XLA turns the ids into two int32 bounds (`document_bounds`): each query row's
document start (an absolute key) and, for each key, the end of the query rows of its
document. The kernels read them as loop bounds: the forward and dq start each query block at
its first row's document start, so key blocks before it (a whole prefix, for a segment that
starts a document) are never read; dK/dV stop each key block at the last query block that
can see it. The bounds mask only the blocks that straddle a document start.

`interpret=True` runs the kernels in Pallas interpret mode (any backend; the CPU tests).
Triton wants power-of-two tiles, at least 16 in every matmul dimension on a GPU: the head
width E must be a power of two (16 or more on a GPU), and the blocks are powers of two.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from seqpipe.kernels import attention_residuals, kv_cache

# A finite "minus infinity" for masked scores: exp(MASKED - m) is 0, and a row's maximum
# is never -inf, so no inf - inf turns into NaN.
MASKED = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes (query block, key block) of the three kernels, and Triton's launch
    settings. Untuned: chosen to fit an H100/H200's shared memory at E = 128."""

    forward: tuple[int, int] = (128, 64)
    dkv: tuple[int, int] = (64, 64)
    dq: tuple[int, int] = (64, 64)
    num_warps: int | None = None  # None: 4 for E <= 64, else 8
    num_stages: int = 2


BLOCKS = Blocks()


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _fit(block: int, length: int) -> int:
    """A block no longer than needed: a short segment gets a shorter (power of two,
    >= 16 for Triton's matmuls) block, an explicit smaller block stays."""
    return min(block, max(16, _pow2_at_least(length)))


@dataclasses.dataclass(frozen=True)
class _Static:
    """What a kernel is compiled for: lengths, head width, its tiles."""

    q_len: int
    prefix_len: int
    width: int
    bq: int
    bk: int
    dtype: np.dtype  # the compute dtype; float32: no TF32 in the matmuls
    group: int = 1  # query heads per K/V head

    @property
    def scale(self) -> float:
        return self.width**-0.5

    def dot(self, a, b, trans_a=False, trans_b=False):
        allow_tf32 = False if self.dtype == np.float32 else None
        return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, allow_tf32=allow_tf32)


def _rows(ref, start, size: int, length: int, head=None):
    """Rows [start, start + size) of a [length, E] ref (of head `head` of a [length, G, E]
    one), zeros past the end."""
    window = ref.at[pl.ds(start, size), :] if head is None else ref.at[pl.ds(start, size), head, :]
    if length % size == 0:  # every block is whole: no mask
        return plgpu.load(window)
    valid = start + jnp.arange(size) < length
    return plgpu.load(window, mask=valid[:, None], other=0.0)


def _entries(ref, start, size: int, length: int, head=None):
    """Entries [start, start + size) of a [length] ref (of head `head` of a [G, length]
    one), zeros past the end."""
    window = ref.at[pl.ds(start, size)] if head is None else ref.at[head, pl.ds(start, size)]
    if length % size == 0:
        return plgpu.load(window)
    return plgpu.load(window, mask=start + jnp.arange(size) < length, other=0.0)


def _bounds(ref, start, size: int, end: int):
    """Entries [start, start + size) of an int32 bounds ref, zeros from `end` on (`start`
    need not be a multiple of `size`)."""
    return plgpu.load(ref.at[pl.ds(start, size)], mask=start + jnp.arange(size) < end, other=0)


def _cdiv(n, size: int):
    return lax.div(n + size - 1, size)


def _split_loop(lo, mid, hi, before, after, carry):
    """Loop bodies over blocks [lo, hi): `before` on those below `mid`, `after` on the rest
    (either range may be empty; the bounds are dynamic)."""
    carry = lax.fori_loop(lo, jnp.minimum(mid, hi), before, carry)
    return lax.fori_loop(jnp.maximum(lo, mid), hi, after, carry)


def _both(mask_a, mask_b):
    return lambda index: mask_a(index) & mask_b(index)


def _store_rows(ref, start, value, length: int):
    size = value.shape[0]
    valid = start + jnp.arange(size) < length
    if value.ndim == 1:
        plgpu.store(ref.at[pl.ds(start, size)], value, mask=valid)
    else:
        plgpu.store(ref.at[pl.ds(start, size), :], value, mask=valid[:, None])


def _array_reader(kv_refs, size: int, length: int):
    """read(which, start): rows [start, start + size) of K (which 0) or V (1), [length, E]
    refs of one (batch row, head)."""
    return lambda which, start: _rows(kv_refs[which], start, size, length)


def _prefix_reader(s: _Static, kind: str, refs):
    """(read, the refs after the prefix's) for a prefix given as `kind`: None (empty),
    "array" ([P, E] K and V refs) or "cache" (the K/V cache's words, whole, after an int32
    [slot, layer] ref: tiles are read from the cache where they lie and bitcast from the
    storage words to the compute dtype)."""
    if kind is None:
        return None, refs
    if kind == "array":
        return _array_reader(refs[:2], s.bk, s.prefix_len), refs[2:]
    where_ref, words_k_ref, words_v_ref = refs[:3]
    slot, layer = where_ref[0], where_ref[1]
    row, head = pl.program_id(1), lax.div(pl.program_id(2), s.group)

    def read(which, start):
        words = (words_k_ref, words_v_ref)[which]
        window = words.at[slot, layer, row, pl.ds(start, s.bk), head, :]
        if s.prefix_len % s.bk == 0:
            tile = plgpu.load(window)
        else:
            valid = start + jnp.arange(s.bk) < s.prefix_len
            tile = plgpu.load(window, mask=valid[:, None], other=0)
        return kv_cache.from_words(tile, s.dtype)

    return read, refs[3:]


def _own_key_range(s: _Static, first_row):
    """Own key blocks a query block starting at `first_row` visits: [0, full) whole (all
    their keys at or before the block's first row) and [full, seen) crossing the diagonal."""
    full = lax.div(first_row + 1, s.bk)
    seen = jnp.minimum(pl.cdiv(s.q_len, s.bk), lax.div(first_row + s.bq - 1, s.bk) + 1)
    return full, seen


def _query_block(s: _Static):
    """This program's query block, the last first: they have the most keys to visit."""
    return pl.cdiv(s.q_len, s.bq) - 1 - pl.program_id(0)


def _key_loops(s: _Static, visit, carry, start, read_prefix, read_own, *bounds):
    """Run `visit(read, mask_fn)`'s loop bodies over the prefix's key blocks (a partial
    last one masked) and the own key blocks up to the diagonal (crossing ones masked
    causally): the forward's and dq's shared key order. With documents (`bounds`: the
    rows' document starts) `_document_key_loops`."""
    if bounds:
        return _document_key_loops(s, visit, carry, start, read_prefix, read_own, *bounds)
    if read_prefix is not None:
        whole = s.prefix_len // s.bk
        carry = lax.fori_loop(0, whole, visit(read_prefix, None), carry)
        if s.prefix_len % s.bk:

            def in_prefix(cols):
                return cols[None, :] < s.prefix_len

            # A loop of one, not a call: its start must stay dynamic (a static one past
            # the end of the ref fails Pallas's bounds check; the load is masked).
            partial = visit(read_prefix, in_prefix)
            carry = lax.fori_loop(whole, whole + 1, partial, carry)
    full, seen = _own_key_range(s, start)
    carry = lax.fori_loop(0, full, visit(read_own, None), carry)
    rows = start + jnp.arange(s.bq)

    def causal(cols):
        return cols[None, :] <= rows[:, None]

    return lax.fori_loop(full, seen, visit(read_own, causal), carry)


def _document_key_loops(s: _Static, visit, carry, start, read_prefix, read_own, starts_ref):
    """`_key_loops` for packed documents: row r sees keys [starts[r], P + r] (absolute).
    Blocks before the block's first row's document start are skipped (a prefix wholly
    before it is never read); blocks before its last row's start get the document mask,
    those after it none (besides the partial prefix block's and the diagonal's masks)."""
    last = jnp.minimum(start + s.bq, s.q_len) - 1
    lo, hi = starts_ref[start], starts_ref[last]  # rows' starts are non-decreasing
    row_starts = _bounds(starts_ref, start, s.bq, s.q_len)

    def in_document(base: int):  # keys [base, ...) of the row's document, by key index
        return lambda cols: base + cols[None, :] >= row_starts[:, None]

    if read_prefix is not None:
        whole, count = s.prefix_len // s.bk, pl.cdiv(s.prefix_len, s.bk)
        first = jnp.where(lo < s.prefix_len, lax.div(lo, s.bk), count)
        doc = in_document(0)
        carry = _split_loop(
            first, _cdiv(hi, s.bk), whole, visit(read_prefix, doc), visit(read_prefix, None), carry
        )
        if s.prefix_len % s.bk:

            def in_prefix(cols):
                return cols[None, :] < s.prefix_len

            partial = visit(read_prefix, _both(in_prefix, doc))
            carry = lax.fori_loop(jnp.maximum(first, whole), count, partial, carry)
    full, seen = _own_key_range(s, start)
    own_first = lax.div(jnp.maximum(lo - s.prefix_len, 0), s.bk)
    own_masked = _cdiv(jnp.maximum(hi - s.prefix_len, 0), s.bk)
    doc = in_document(s.prefix_len)
    carry = _split_loop(
        own_first, own_masked, full, visit(read_own, doc), visit(read_own, None), carry
    )
    rows = start + jnp.arange(s.bq)

    def causal(cols):
        return cols[None, :] <= rows[:, None]

    crossing = visit(read_own, _both(causal, doc))
    return lax.fori_loop(jnp.maximum(own_first, full), seen, crossing, carry)


# ------------------------------------------------------------------------------ forward


def _forward_kernel(q_ref, *refs, s: _Static, prefix: str | None):
    read_prefix, (ks_ref, vs_ref, *bounds, o_ref, lse_ref) = _prefix_reader(s, prefix, refs)
    start = _query_block(s) * s.bq
    q = _rows(q_ref, start, s.bq, s.q_len)

    def visit(read, mask_fn):
        def body(j, carry):
            acc, m, total = carry
            k, v = read(0, j * s.bk), read(1, j * s.bk)
            scores = s.dot(q, k, trans_b=True) * s.scale
            if mask_fn is not None:
                scores = jnp.where(mask_fn(j * s.bk + jnp.arange(s.bk)), scores, MASKED)
            m_new = jnp.maximum(m, scores.max(axis=-1))
            p = jnp.exp(scores - m_new[:, None])
            alpha = jnp.exp(m - m_new)
            acc = acc * alpha[:, None] + s.dot(p.astype(v.dtype), v)
            return acc, m_new, total * alpha + p.sum(axis=-1)

        return body

    init = (
        jnp.zeros((s.bq, s.width), jnp.float32),
        jnp.full((s.bq,), -jnp.inf, jnp.float32),
        jnp.zeros((s.bq,), jnp.float32),
    )
    read_own = _array_reader((ks_ref, vs_ref), s.bk, s.q_len)
    acc, m, total = _key_loops(s, visit, init, start, read_prefix, read_own, *bounds)
    _store_rows(o_ref, start, (acc / total[:, None]).astype(o_ref.dtype), s.q_len)
    _store_rows(lse_ref, start, m + jnp.log(total), s.q_len)


# ----------------------------------------------------------------------------- backward


def _dkv_kernel(q_ref, *refs, s: _Static, keys: str, group: int):
    """dK, dV of key block program_id(0) of K/V head program_id(2), of the segment's own
    keys (`keys` "own", masked causally) or of the prefix (`keys` a `_prefix_reader` kind),
    summed over the query blocks that see it and, with `group` > 1, over the group's query
    heads (q, dO [Q, G, E], lse, D [G, Q])."""
    causal = keys == "own"
    if causal:
        read, length = _array_reader(refs[:2], s.bk, s.q_len), s.q_len
        refs = refs[2:]
    else:
        (read, refs), length = _prefix_reader(s, keys, refs), s.prefix_len
    do_ref, lse_ref, d_ref, *bounds, dk_ref, dv_ref = refs
    start = pl.program_id(0) * s.bk
    cols = start + jnp.arange(s.bk)
    k, v = read(0, start), read(1, start)

    def visit(mask_fn):
        def body(i, carry):
            rows = i * s.bq + jnp.arange(s.bq)

            def query_head(head, carry):
                dk, dv = carry
                q, do = (_rows(r, i * s.bq, s.bq, s.q_len, head) for r in (q_ref, do_ref))
                lse, delta = (_entries(r, i * s.bq, s.bq, s.q_len, head) for r in (lse_ref, d_ref))
                p = jnp.exp(s.dot(q, k, trans_b=True) * s.scale - lse[:, None])
                if mask_fn is not None:
                    p = jnp.where(mask_fn(rows), p, 0.0)
                dv += s.dot(p.astype(do.dtype), do, trans_a=True)
                ds = p * (s.dot(do, v, trans_b=True) - delta[:, None]) * s.scale
                dk += s.dot(ds.astype(q.dtype), q, trans_a=True)
                return dk, dv

            if group == 1:
                return query_head(None, carry)
            return lax.fori_loop(0, group, query_head, carry)

        return body

    def below_diagonal(rows):
        return cols[None, :] <= rows[:, None]

    q_blocks = pl.cdiv(s.q_len, s.bq)
    carry = (jnp.zeros((s.bk, s.width), jnp.float32),) * 2
    # Query blocks before `first` end above this key block; from `whole` on, every row is
    # at or below its last key. The prefix's keys are below every row.
    first = lax.div(start, s.bq) if causal else 0
    whole = jnp.minimum(q_blocks, lax.div(start + s.bk - 1 + s.bq - 1, s.bq)) if causal else 0
    if bounds:
        carry = _document_query_loops(s, visit, carry, bounds[0], keys, length, first, whole)
    else:
        if causal:
            carry = lax.fori_loop(first, whole, visit(below_diagonal), carry)
        carry = lax.fori_loop(whole, q_blocks, visit(None), carry)
    dk, dv = carry
    _store_rows(dk_ref, start, dk.astype(dk_ref.dtype), length)
    _store_rows(dv_ref, start, dv.astype(dv_ref.dtype), length)


def _document_query_loops(s: _Static, visit, carry, ends_ref, keys: str, length, first, whole):
    """The dK/dV query loop for packed documents: the rows that see key c are
    [c - P, ends[c]) (`ends`, by absolute key). Query blocks from the one holding the
    block's last key's end on are skipped; those past its first key's end get the
    document mask."""
    base = s.prefix_len if keys == "own" else 0  # this stream's first absolute key
    start = pl.program_id(0) * s.bk
    key_ends = _bounds(ends_ref, base + start, s.bk, base + length)
    first_end = ends_ref[base + start]
    last_end = ends_ref[base + jnp.minimum(start + s.bk, length) - 1]
    end = jnp.minimum(pl.cdiv(s.q_len, s.bq), _cdiv(last_end, s.bq))

    def in_document(rows):
        return rows[:, None] < key_ends[None, :]

    if keys == "own":
        cols = start + jnp.arange(s.bk)

        def crossing(rows):
            return (cols[None, :] <= rows[:, None]) & in_document(rows)

        carry = lax.fori_loop(first, jnp.minimum(whole, end), visit(crossing), carry)
    masked_from = lax.div(first_end, s.bq)
    lo = jnp.maximum(first, whole)
    return _split_loop(lo, masked_from, end, visit(None), visit(in_document), carry)


def _dq_kernel(q_ref, *refs, s: _Static, prefix: str | None):
    read_prefix, refs = _prefix_reader(s, prefix, refs)
    ks_ref, vs_ref, do_ref, lse_ref, d_ref, *bounds, dq_ref = refs
    start = _query_block(s) * s.bq
    q, do = (_rows(r, start, s.bq, s.q_len) for r in (q_ref, do_ref))
    lse, delta = (_entries(r, start, s.bq, s.q_len) for r in (lse_ref, d_ref))

    def visit(read, mask_fn):
        def body(j, dq):
            k, v = read(0, j * s.bk), read(1, j * s.bk)
            p = jnp.exp(s.dot(q, k, trans_b=True) * s.scale - lse[:, None])
            if mask_fn is not None:
                p = jnp.where(mask_fn(j * s.bk + jnp.arange(s.bk)), p, 0.0)
            ds = p * (s.dot(do, v, trans_b=True) - delta[:, None]) * s.scale
            return dq + s.dot(ds.astype(k.dtype), k)

        return body

    init = jnp.zeros((s.bq, s.width), jnp.float32)
    read_own = _array_reader((ks_ref, vs_ref), s.bk, s.q_len)
    dq = _key_loops(s, visit, init, start, read_prefix, read_own, *bounds)
    _store_rows(dq_ref, start, dq.astype(dq_ref.dtype), s.q_len)


# ------------------------------------------------------------------------------- calls


def _seq_spec(length: int, width: int, group: int = 1) -> pl.BlockSpec:
    """A whole [length, E] sequence of one (batch row, head) of a [b, L, H, E] array; with
    `group` > 1, of K/V head h // group of a [b, L, K, E] one (query head h's)."""
    if group == 1:
        return pl.BlockSpec((None, length, None, width), lambda _, b, h: (b, 0, h, 0))
    return pl.BlockSpec((None, length, None, width), lambda _, b, h: (b, 0, lax.div(h, group), 0))


def _bounds_spec(length: int) -> pl.BlockSpec:
    """A whole [length] row of one batch row of a [b, L] array, every head's."""
    return pl.BlockSpec((None, length), lambda _, b, h: (b, 0))


def _with_bounds(bounds, which: int, length: int) -> tuple[tuple, tuple]:
    """(inputs, specs) of document bound `which` (0: starts, 1: ends), none without."""
    if bounds is None:
        return (), ()
    return (bounds[which],), (_bounds_spec(length),)


def _row_spec(length: int) -> pl.BlockSpec:
    """A whole [length] row of one (batch row, head) of a [b, H, L] array."""
    return pl.BlockSpec((None, None, length), lambda _, b, h: (b, h, 0))


def _group_specs(length: int, width: int, group: int) -> tuple[pl.BlockSpec, pl.BlockSpec]:
    """For a grid over K/V heads: (the [length, G, E] sequences of K/V head h's query heads
    in a [b, L, H, E] array, their [G, length] rows in a [b, H, L] one); with `group` 1,
    `_seq_spec` and `_row_spec`."""
    if group == 1:
        return _seq_spec(length, width), _row_spec(length)
    seq = pl.BlockSpec((None, length, group, width), lambda _, b, h: (b, 0, h, 0))
    return seq, pl.BlockSpec((None, group, length), lambda _, b, h: (b, h, 0))


@dataclasses.dataclass(frozen=True)
class _Prefix:
    """The prefix as the kernels take it: `kind` (a `_prefix_reader` kind), its length,
    the pallas_call inputs and their block specs."""

    kind: str | None
    length: int
    inputs: tuple
    specs: tuple


def _array_prefix(k_prefix, v_prefix, group: int = 1) -> _Prefix:
    length, width = k_prefix.shape[1], k_prefix.shape[-1]
    if not length:
        return _Prefix(None, 0, (), ())
    spec = _seq_spec(length, width, group)
    return _Prefix("array", length, (k_prefix, v_prefix), (spec, spec))


def _cache_prefix(cache, length: int) -> _Prefix:
    """The first `length` positions of a `kv_cache.Prefix`: its words go in whole (no
    copy; each program slices its tiles at the cache's slot and layer)."""
    if not length:
        return _Prefix(None, 0, (), ())
    where = jnp.stack([cache.slot, cache.layer]).astype(jnp.int32)
    inputs = (where, cache.words_k, cache.words_v)
    return _Prefix("cache", length, inputs, (pl.no_block_spec,) * 3)


def _statics(q, prefix_len, block, group: int = 1):
    _, q_len, _, width = q.shape
    bq, bk = block
    keys = max(prefix_len, q_len)
    fit_q, fit_k = _fit(bq, q_len), _fit(bk, keys)
    return _Static(q_len, prefix_len, width, fit_q, fit_k, np.dtype(q.dtype), group)


def _group(q, k_seg) -> int:
    return q.shape[2] // k_seg.shape[2]


def _call(kernel, grid, in_specs, out_shape, out_specs, blocks: Blocks, width, interpret, name):
    warps = blocks.num_warps or (4 if width <= 64 else 8)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=list(in_specs),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name=name,
    )


def _forward(q, prefix: _Prefix, k_seg, v_seg, bounds, blocks: Blocks, interpret: bool):
    b, q_len, heads, width = q.shape
    group = _group(q, k_seg)
    s = _statics(q, prefix.length, blocks.forward, group)
    seq, kv_seq = _seq_spec(q_len, width), _seq_spec(q_len, width, group)
    starts, starts_spec = _with_bounds(bounds, 0, q_len)
    out, lse = _call(
        functools.partial(_forward_kernel, s=s, prefix=prefix.kind),
        (pl.cdiv(q_len, s.bq), b, heads),
        [seq, *prefix.specs, kv_seq, kv_seq, *starts_spec],
        [
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((b, heads, q_len), jnp.float32),
        ],
        [seq, _row_spec(q_len)],
        blocks,
        width,
        interpret,
        "segment_attention_forward",
    )(q, *prefix.inputs, k_seg, v_seg, *starts)
    # Named for `remat=dots` to keep: the backward reads them besides the inputs.
    return attention_residuals.mark(out, lse)


def _backward(q, prefix: _Prefix, k_seg, v_seg, bounds, out, lse, d_out, blocks: Blocks, interpret):
    """dq, the prefix's dK and dV ([b, P, K, E]; None for an empty prefix), own dK, dV."""
    b, q_len, heads, width = q.shape
    group, kv_heads = _group(q, k_seg), k_seg.shape[2]
    f32 = jnp.float32
    # D = rowsum(dO * O), the softmax backward's row term: [b, H, Q] float32.
    delta = jnp.einsum("bqhe,bqhe->bhq", d_out.astype(f32), out.astype(f32))
    seq, rows = _seq_spec(q_len, width), _row_spec(q_len)
    kv_seq = _seq_spec(q_len, width, group)
    starts, starts_spec = _with_bounds(bounds, 0, q_len)
    ends, ends_spec = _with_bounds(bounds, 1, prefix.length + q_len)

    # One program per (key block, batch row, K/V head): it sums over its group's query
    # heads in float32 (one rounding, as blockwise), so no per-query-head partials.
    group_seq, group_rows = _group_specs(q_len, width, group)

    def dkv(keys, length, key_inputs):
        s = _statics(q, prefix.length, blocks.dkv)  # the grid's heads are K/V heads
        spec = _seq_spec(length, width)
        key_specs = prefix.specs if keys == "cache" else (spec, spec)
        shape = jax.ShapeDtypeStruct((b, length, kv_heads, width), k_seg.dtype)
        return _call(
            functools.partial(_dkv_kernel, s=s, keys=keys, group=group),
            (pl.cdiv(length, s.bk), b, kv_heads),
            [group_seq, *key_specs, group_seq, group_rows, group_rows, *ends_spec],
            [shape, shape],
            [spec, spec],
            blocks,
            width,
            interpret,
            "segment_attention_dkv",
        )(q, *key_inputs, d_out, lse, delta, *ends)

    dk_prefix = dv_prefix = None
    if prefix.kind is not None:
        dk_prefix, dv_prefix = dkv(prefix.kind, prefix.length, prefix.inputs)
    dk_seg, dv_seg = dkv("own", q_len, (k_seg, v_seg))

    s = _statics(q, prefix.length, blocks.dq, group)
    dq = _call(
        functools.partial(_dq_kernel, s=s, prefix=prefix.kind),
        (pl.cdiv(q_len, s.bq), b, heads),
        [seq, *prefix.specs, kv_seq, kv_seq, seq, rows, rows, *starts_spec],
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        seq,
        blocks,
        width,
        interpret,
        "segment_attention_dq",
    )(q, *prefix.inputs, k_seg, v_seg, d_out, lse, delta, *starts)
    return dq, dk_prefix, dv_prefix, dk_seg, dv_seg


def _check(q, blocks: Blocks):
    width = q.shape[-1]
    sizes = [width, *blocks.forward, *blocks.dkv, *blocks.dq]
    if any(n < 1 or n & (n - 1) for n in sizes):
        raise ValueError(
            f"pallas_gpu needs powers of two for the head width ({width}) and the blocks "
            f"({blocks}); use blockwise for other widths"
        )


def document_bounds(documents, prefix_len: int, q_len: int) -> tuple[jax.Array, jax.Array]:
    """The kernels' view of `documents` = (q_ids [b, Q], kv_ids [b, P + Q]), int32, q_ids
    equal to kv_ids[:, P:]: each query row's document start as an absolute key ([b, Q]),
    and each key's document end as a query row ([b, P + Q]): the rows that see key j are
    [j - P, ends[j]). A document is a run of equal ids (packed rows number them in order)."""
    q_ids, kv_ids = documents
    b, keys = kv_ids.shape
    if q_ids.shape != (b, q_len) or keys != prefix_len + q_len:
        raise ValueError(
            f"documents have ids of shapes {q_ids.shape} (queries) and {kv_ids.shape} (keys); "
            f"expected ({b}, {q_len}) and ({b}, {prefix_len + q_len}): the prefix, then the segment"
        )
    at = jnp.arange(keys, dtype=jnp.int32)
    change = kv_ids[:, 1:] != kv_ids[:, :-1]
    edge = jnp.ones((b, 1), bool)
    opens, closes = jnp.concatenate([edge, change], 1), jnp.concatenate([change, edge], 1)
    run_start = lax.cummax(jnp.where(opens, at, 0), axis=1)
    run_end = lax.cummin(jnp.where(closes, at + 1, keys), axis=1, reverse=True)
    return run_start[:, prefix_len:], jnp.clip(run_end - prefix_len, 0, q_len)


def pallas_gpu_attention(
    q_BxQxHxE: jax.Array,
    k_prefix_BxPxHxE: jax.Array,
    v_prefix_BxPxHxE: jax.Array,
    k_seg_BxQxHxE: jax.Array,
    v_seg_BxQxHxE: jax.Array,
    blocks: Blocks = BLOCKS,
    interpret: bool = False,
    documents: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """`attention.segment_attention`'s contract by the Triton kernels, within `documents`
    (q_ids [b, Q], kv_ids [b, P + Q]) if given. `interpret` (Pallas interpret mode, for
    tests off GPU) is never chosen by the backend."""
    args = (q_BxQxHxE, k_prefix_BxPxHxE, v_prefix_BxPxHxE, k_seg_BxQxHxE, v_seg_BxQxHxE)
    bounds = None
    if documents is not None:
        bounds = document_bounds(documents, k_prefix_BxPxHxE.shape[1], q_BxQxHxE.shape[1])
    return _attention(*args, bounds, blocks, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _attention(q, k_prefix, v_prefix, k_seg, v_seg, bounds, blocks, interpret):
    return _fwd(q, k_prefix, v_prefix, k_seg, v_seg, bounds, blocks, interpret)[0]


def _fwd(q, k_prefix, v_prefix, k_seg, v_seg, bounds, blocks, interpret):
    _check(q, blocks)
    prefix = _array_prefix(k_prefix, v_prefix, _group(q, k_seg))
    out, lse = _forward(q, prefix, k_seg, v_seg, bounds, blocks, interpret)
    return out, (q, k_prefix, v_prefix, k_seg, v_seg, bounds, out, lse)


def _bwd(blocks, interpret, residuals, d_out):
    q, k_prefix, v_prefix, k_seg, v_seg, bounds, out, lse = residuals
    prefix = _array_prefix(k_prefix, v_prefix, _group(q, k_seg))
    grads = _backward(q, prefix, k_seg, v_seg, bounds, out, lse, d_out, blocks, interpret)
    dq, dkp, dvp, dks, dvs = grads
    if dkp is None:
        dkp, dvp = jnp.zeros_like(k_prefix), jnp.zeros_like(v_prefix)
    return dq, dkp, dvp, dks, dvs, None


_attention.defvjp(_fwd, _bwd)


# ------------------------------------------------------------------ prefix in a KV cache


def cached_attention(
    q_BxQxHxE: jax.Array,
    cache,
    sink_k_BxPxHxE: jax.Array,
    sink_v_BxPxHxE: jax.Array,
    k_seg_BxQxHxE: jax.Array,
    v_seg_BxQxHxE: jax.Array,
    prefix_len: int,
    blocks: Blocks = BLOCKS,
    interpret: bool = False,
    documents: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """`pallas_gpu_attention` with the prefix's first `prefix_len` positions read by the
    kernels from `cache` (a `kv_cache.Prefix`) where they lie: no copy of the prefix, and
    none kept for the backward. As `blockwise.cached_attention`: the prefix's dK and dV
    are the cotangents of the sinks ([b, >= prefix_len, H, E], never read; zeros past
    prefix_len). `documents` as `pallas_gpu_attention`'s (kv_ids cover `prefix_len`)."""
    args = (q_BxQxHxE, cache, sink_k_BxPxHxE, sink_v_BxPxHxE, k_seg_BxQxHxE, v_seg_BxQxHxE)
    bounds = None
    if documents is not None:
        bounds = document_bounds(documents, prefix_len, q_BxQxHxE.shape[1])
    return _cached(*args, bounds, prefix_len, blocks, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _cached(q, cache, sink_k, sink_v, k_seg, v_seg, bounds, prefix_len, blocks, interpret):
    args = (q, cache, sink_k, sink_v, k_seg, v_seg, bounds)
    return _cached_fwd(*args, prefix_len, blocks, interpret)[0]


def _cached_fwd(q, cache, sink_k, sink_v, k_seg, v_seg, bounds, prefix_len, blocks, interpret):
    _check(q, blocks)
    prefix = _cache_prefix(cache, prefix_len)
    out, lse = _forward(q, prefix, k_seg, v_seg, bounds, blocks, interpret)
    sink_len = jnp.zeros((0, sink_k.shape[1]), jnp.int8)  # the sinks' length, not values
    return out, (q, cache, k_seg, v_seg, bounds, out, lse, sink_len)


def _cached_bwd(prefix_len, blocks, interpret, residuals, d_out):
    q, cache, k_seg, v_seg, bounds, out, lse, sink_len = residuals
    prefix = _cache_prefix(cache, prefix_len)
    grads = _backward(q, prefix, k_seg, v_seg, bounds, out, lse, d_out, blocks, interpret)
    dq, dkp, dvp, dks, dvs = grads
    b, _, _, width = q.shape
    sink_shape = (b, sink_len.shape[1], k_seg.shape[2], width)

    def to_sink(g):  # the prefix's cotangent, zeros past it
        if g is None:
            return jnp.zeros(sink_shape, k_seg.dtype)
        return jnp.pad(g, ((0, 0), (0, sink_shape[1] - prefix_len), (0, 0), (0, 0)))

    return dq, cache.no_gradient(), to_sink(dkp), to_sink(dvp), dks, dvs, None


_cached.defvjp(_cached_fwd, _cached_bwd)


def executed_flops(
    q_len: int, prefix_len: int, width: int, blocks: Blocks = BLOCKS, starts=None
) -> int:
    """Forward matmul FLOPs (QK and PV, per row) the forward kernel runs for one segment,
    `width` = H * E: every key block a query block visits, whole (padding and the
    diagonal's masked part included). `starts`: one row's document starts (`document_bounds`,
    [Q] absolute keys), from whose first row's each query block starts."""
    bq, bk = _fit(blocks.forward[0], q_len), _fit(blocks.forward[1], max(prefix_len, q_len))
    prefix_blocks = -(-prefix_len // bk)
    key_blocks = 0
    for i in range(-(-q_len // bq)):
        seen = min(-(-q_len // bk), (i * bq + bq - 1) // bk + 1)
        if starts is None:
            key_blocks += prefix_blocks + seen
            continue
        lo = int(starts[i * bq])
        key_blocks += prefix_blocks - lo // bk if lo < prefix_len else 0
        key_blocks += seen - max(lo - prefix_len, 0) // bk
    return 2 * 2 * key_blocks * bq * bk * width
