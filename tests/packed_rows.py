"""Packed rows for tests (the data contract's, `seqpipe.models.document_mask`): documents crossing
segment and micro-batch boundaries, one-token documents, a row that is one document,
padding at a row's end."""

import jax
import jax.numpy as jnp
import numpy as np

from seqpipe.models import document_mask

# Document lengths of a row of 17 (seq_len 16 + 1), cycled over a batch's rows.
LAYOUTS_17 = (
    (5, 1, 7, 4),  # a one-token document; the others cross segment boundaries
    (17,),  # the row is one document
    (3, 6, 1, 1, 2),  # two one-token documents, then 4 positions of padding
    (9, 8),
    (2, 11),  # then 4 of padding
    (1, 16),
)


def layouts(rows: int, row_len: int) -> list[tuple[int, ...]]:
    """`rows` rows' document lengths: LAYOUTS_17 cycled, scaled to rows of `row_len`."""
    out = []
    for b in range(rows):
        lengths = LAYOUTS_17[b % len(LAYOUTS_17)]
        scaled = [max(1, n * row_len // 17) for n in lengths]
        while sum(scaled) > row_len:
            scaled[int(np.argmax(scaled))] -= 1
        out.append(tuple(scaled))
    return out


def packed_batch(rows: int, seq_len: int, vocab: int, key=1) -> dict:
    """{"tokens", "documents", "positions"} int32 [rows, seq_len + 1] (numpy)."""
    docs, pos = document_mask.pack_rows(layouts(rows, seq_len + 1), seq_len + 1)
    tokens = jax.random.randint(jax.random.key(key), docs.shape, 0, vocab)
    return {"tokens": np.asarray(tokens, np.int32), "documents": docs, "positions": pos}


def on_device(batch: dict, sharding) -> dict:
    return {k: jax.device_put(jnp.asarray(v), sharding) for k, v in batch.items()}
