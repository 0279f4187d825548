"""Segment attention with the Pallas TPU splash kernel (`model.attention=splash`).

Splash's `CausalMask((Q, P + Q), offset=P)` keeps key j for query i iff i + P >= j: the
contract of `attention.segment_attention`, bottom-right aligned, with q length != kv
length, and the kernel's own backward (dq, dK, dV from the saved log-sum-exp). Its blocks
must divide both lengths, so queries and keys are padded at the end: a real query never
sees a padded key (i + P < P + Q), and padded query rows are sliced off, so their
cotangent is zero and they add nothing to the gradients.

The kernel takes one K/V sequence: the prefix and the segment's own K/V are concatenated
(one copy of the prefix per call, which a KV cache that keeps each segment's K/V next to
its prefix would avoid). Splash has no scale argument: q is scaled first.

Documents (`documents=(q_ids, kv_ids)`, packed rows) go in as splash's `SegmentIds`
(q ids [Q], kv ids [P + Q]: the lengths may differ), and-ed with the causal mask. Splash
warns that no query row may be fully masked (a softmax over nothing): none is, since query
i's own key P + i carries its id (q_ids == kv_ids[:, P:]) and the causal mask keeps it. The
padded query rows get the last real id (edge padding), so each sees the last real key.
Which blocks splash skips is decided from the static causal mask alone, at trace time: with
documents it runs every block it runs without them, the whole prefix included
(`executed_flops`; docs/long-context.md says what a per-batch mask would cost).

Off TPU it runs only in Pallas interpret mode (`interpret=True`), which the tests use.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as sa

BLOCK = 512
LANES = 128  # TPU blocks are multiples of this


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@functools.cache
def _kernel(heads: int, q_len: int, kv_len: int, offset: int, bq: int, bkv: int, interpret: bool):
    mask = sa.MultiHeadMask([sa.CausalMask((q_len, kv_len), offset=offset)] * heads)
    sizes = sa.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bkv,
        block_q_dkv=bq,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv,
        block_q_dq=bq,
        block_kv_dq=bkv,
    )
    # Cached across traces: its mask info must be concrete arrays, not the tracers of the
    # trace that first asked (a second jit of the same shapes would find them leaked).
    with jax.ensure_compile_time_eval():
        return sa.make_splash_mha_single_device(mask, block_sizes=sizes, interpret=interpret)


def splash_attention(
    q_BxQxHxE: jax.Array,
    k_prefix_BxPxHxE: jax.Array,
    v_prefix_BxPxHxE: jax.Array,
    k_seg_BxQxHxE: jax.Array,
    v_seg_BxQxHxE: jax.Array,
    block: int = BLOCK,
    interpret: bool = False,
    documents: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """`attention.segment_attention`'s contract by the splash kernel, within `documents`
    (q_ids [b, Q], kv_ids [b, P + Q]) if given. `interpret` (Pallas interpret mode, for
    tests off TPU) is never chosen by the backend: compiling for a TPU slice from a CPU
    machine must compile the real kernel."""
    _, q_len, heads, width = q_BxQxHxE.shape
    prefix = k_prefix_BxPxHxE.shape[1]
    bq = min(block, _round_up(q_len, LANES))
    bkv = min(block, _round_up(prefix + q_len, LANES))
    q_pad, kv_pad = _round_up(q_len, bq), _round_up(prefix + q_len, bkv)
    kernel = _kernel(heads, q_pad, kv_pad, prefix, bq, bkv, interpret)

    def heads_first(x_BxLxHxE, length):  # [b, H, length, E], zeros after the real rows
        x = jnp.pad(x_BxLxHxE, ((0, 0), (0, length - x_BxLxHxE.shape[1]), (0, 0), (0, 0)))
        return jnp.swapaxes(x, 1, 2)

    q = heads_first(q_BxQxHxE * jnp.asarray(width**-0.5, q_BxQxHxE.dtype), q_pad)
    k = heads_first(jnp.concatenate([k_prefix_BxPxHxE, k_seg_BxQxHxE], axis=1), kv_pad)
    v = heads_first(jnp.concatenate([v_prefix_BxPxHxE, v_seg_BxQxHxE], axis=1), kv_pad)
    if documents is None:
        out_BxHxQxE = jax.vmap(kernel)(q, k, v)
    else:
        _check_documents(documents, q_BxQxHxE.shape[0], q_len, prefix + q_len)
        q_ids, kv_ids = (
            jnp.pad(ids, ((0, 0), (0, length - ids.shape[1])), mode="edge")
            for ids, length in zip(documents, (q_pad, kv_pad), strict=True)
        )

        def per_row(q, k, v, q_ids, kv_ids):
            return kernel(q, k, v, segment_ids=sa.SegmentIds(q_ids, kv_ids))

        out_BxHxQxE = jax.vmap(per_row)(q, k, v, q_ids, kv_ids)
    return jnp.swapaxes(out_BxHxQxE[:, :, :q_len], 1, 2)


def _check_documents(documents, rows: int, q_len: int, kv_len: int):
    shapes = tuple(ids.shape for ids in documents)
    if shapes != ((rows, q_len), (rows, kv_len)):
        raise ValueError(
            f"documents have ids of shapes {shapes}; expected ({rows}, {q_len}) and "
            f"({rows}, {kv_len}): the prefix, then the segment"
        )


def executed_flops(q_len: int, prefix_len: int, width: int, block: int = BLOCK) -> int:
    """Forward matmul FLOPs (QK and PV, per row) the kernel runs for one segment, `width`
    = H * E: every block of the padded grid that holds an unmasked entry, whole (splash
    skips only the blocks its mask leaves empty)."""
    bq = min(block, _round_up(q_len, LANES))
    bkv = min(block, _round_up(prefix_len + q_len, LANES))
    kv_blocks = _round_up(prefix_len + q_len, bkv) // bkv
    blocks = sum(
        min(kv_blocks, (a * bq + bq - 1 + prefix_len) // bkv + 1)
        for a in range(_round_up(q_len, bq) // bq)
    )
    return 2 * 2 * blocks * bq * bkv * width
