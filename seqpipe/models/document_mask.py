"""Packed documents: which targets count, which keys a query sees, where RoPE is.

A packed row (`data.packing` concat or best_fit) carries, besides its tokens [B, L+1],
`documents` (real documents numbered 1, 2, ... in row order, padding 0 at the row's end)
and `positions` (each token's index within its document's run in the row, or its index in
the row). With the document mask, query i sees key j iff j <= i and both lie in one
document. The attention implementations get the ids as `kernel_ids`: padding is one last
document (2**30), so ids never decrease along a row and every query sees at least itself.

`Packing` is what one segment's layers read: the kernel ids of the prefix and the segment
(or None: the plain causal mask) and the segment's RoPE positions (or None: its offset's).
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

PADDING_ID = 2**30  # padding's kernel id: after every real document's


def kernel_ids(documents: jax.Array) -> jax.Array:
    """Document ids as the attention implementations take them: padding (0) -> PADDING_ID."""
    return jnp.where(documents == 0, PADDING_ID, documents).astype(jnp.int32)


def counted_targets(documents_BxL1: jax.Array) -> jax.Array:
    """[B, L] bool: whether input i's target (token i + 1) counts in the loss: it is no
    padding and lies in input i's document (nothing is predicted across a boundary)."""
    d = documents_BxL1
    return (d[:, 1:] != 0) & (d[:, 1:] == d[:, :-1])


def first_key(q_ids_BxQ: jax.Array, kv_ids_BxK: jax.Array) -> jax.Array:
    """[B] the first key any of the segment's queries sees: the start of its first query's
    document (ids never decrease along a row, so no later query's starts earlier)."""
    return jnp.sum(kv_ids_BxK < q_ids_BxQ[:, :1], axis=1).astype(jnp.int32)


def mask(q_ids_BxQ: jax.Array, kv_ids_BxK: jax.Array) -> jax.Array:
    """[B, Q, K] bool: the block-diagonal causal mask of queries at the last Q of K keys."""
    q_len, k_len = q_ids_BxQ.shape[1], kv_ids_BxK.shape[1]
    causal = np.tril(np.ones((q_len, k_len), bool), k_len - q_len)
    return causal & (q_ids_BxQ[:, :, None] == kv_ids_BxK[:, None, :])


@struct.dataclass
class Packing:
    """How one segment's positions lie: `kv_ids` [b, P + Q] the kernel ids of the prefix
    and the segment's own keys (None: no document mask), `positions` [b, Q] its RoPE
    positions (None: offset, offset + 1, ...); under context parallelism, `context` (a
    `seqpipe.parallel.context.Split`): which of the sequence's positions this device
    holds, P and Q being its own (None: all of them)."""

    kv_ids: jax.Array | None = None
    positions: jax.Array | None = None
    context: object = struct.field(pytree_node=False, default=None)

    def documents(self, q_len: int):
        """The `documents=` argument of `attention.attend`: (q ids, kv ids) or None."""
        if self.kv_ids is None:
            return None
        return self.kv_ids[:, self.kv_ids.shape[1] - q_len :], self.kv_ids


def of_rows(documents_BxL, positions_BxL, offset: int, length: int, mask_documents: bool):
    """The `Packing` of the segment [offset, offset + length) of rows whose inputs carry
    `documents_BxL` (raw ids; None: unpacked) and `positions_BxL` (None: the row's)."""
    if documents_BxL is None and positions_BxL is None:
        return None
    ids = None
    if mask_documents and documents_BxL is not None:
        ids = kernel_ids(documents_BxL[:, : offset + length])
    pos = None if positions_BxL is None else positions_BxL[:, offset : offset + length]
    if ids is None and pos is None:
        return None
    return Packing(ids, pos)


def pack_rows(lengths_per_row, row_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(documents, positions) int32 [B, row_len] of rows holding documents of the given
    lengths in order, padding (id 0) after them: the data contract's rows, for tests and
    tools. Positions restart at 0 at each document and at the padding."""
    docs = np.zeros((len(lengths_per_row), row_len), np.int32)
    pos = np.zeros_like(docs)
    for b, lengths in enumerate(lengths_per_row):
        at = 0
        for i, n in enumerate(lengths):
            if at + n > row_len:
                raise ValueError(f"row {b}: documents {lengths} exceed {row_len} tokens")
            docs[b, at : at + n], pos[b, at : at + n] = i + 1, np.arange(n)
            at += n
        pos[b, at:] = np.arange(row_len - at)
    return docs, pos
