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
    return sa.make_splash_mha_single_device(mask, block_sizes=sizes, interpret=interpret)


def splash_attention(
    q_BxQxHxE: jax.Array,
    k_prefix_BxPxHxE: jax.Array,
    v_prefix_BxPxHxE: jax.Array,
    k_seg_BxQxHxE: jax.Array,
    v_seg_BxQxHxE: jax.Array,
    block: int = BLOCK,
    interpret: bool = False,
) -> jax.Array:
    """`attention.segment_attention`'s contract by the splash kernel. `interpret` (Pallas
    interpret mode, for tests off TPU) is never chosen by the backend: compiling for a TPU
    slice from a CPU machine must compile the real kernel."""
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
    out_BxHxQxE = jax.vmap(kernel)(q, k, v)
    return jnp.swapaxes(out_BxHxQxE[:, :, :q_len], 1, 2)


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
