"""Packing documents into rows of `seq_len + 1` tokens: pure functions of NumPy arrays.

A token stream is `tokens` (1-D) with `starts`, the ascending offsets where its documents
begin (`starts[0] == 0`). Every row is returned as a dict of int32 [R, L+1] arrays:

  tokens     the ids;
  documents  the document of each token within its row: 1, 2, 3, ... in row order, 0 for
             padding (only at a row's end); a document cut across rows is a new one in each;
  positions  with `reset`, each token's index within its document's run in the row (0 at
             each document's first token in the row), else its index in the row; padding
             counts from 0 where it starts.

Packings:
  concat    row w is the window tokens[w*L : w*L + L + 1] (stride L, as unpacked rows), with
            its documents' boundaries kept;
  best_fit  documents of at most L + 1 tokens stay whole, longer ones are cut into pieces of
            L + 1 (the last shorter); the pieces are placed best-fit decreasing (the longest
            first, each into the open row with the least room that holds it) and the rest of
            each row is padding. Every token of the stream lies in exactly one row.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import numpy as np

PACKINGS = ("none", "concat", "best_fit")


class Layout(NamedTuple):
    """best_fit's rows: row r holds the pieces order[offsets[r]:offsets[r+1]], piece k
    being tokens[piece_starts[k] : piece_starts[k] + piece_lengths[k]]."""

    piece_starts: np.ndarray  # int64 [P]
    piece_lengths: np.ndarray  # int64 [P]
    order: np.ndarray  # int64 [P]: pieces in row order
    offsets: np.ndarray  # int64 [R + 1]
    capacity: int  # tokens per row: seq_len + 1

    @property
    def num_rows(self) -> int:
        return len(self.offsets) - 1


def document_starts(lengths: np.ndarray) -> np.ndarray:
    """Offsets of documents of `lengths` laid end to end (the first at 0)."""
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]]).astype(np.int64)


def split_starts(starts: np.ndarray, split: int) -> tuple[np.ndarray, np.ndarray]:
    """The starts of stream[:split] and of stream[split:] (a document cut by the split
    begins the second part)."""
    head = starts[starts < split]
    tail = np.concatenate([[0], starts[starts > split] - split]).astype(np.int64)
    return head, tail


def window_rows(
    tokens: np.ndarray, starts: np.ndarray, seq_len: int, window_ids: np.ndarray, reset: bool
) -> dict[str, np.ndarray]:
    """concat: the windows `window_ids` with their documents and positions."""
    index = np.asarray(window_ids, np.int64)[:, None] * seq_len + np.arange(seq_len + 1)
    doc = np.searchsorted(starts, index, side="right") - 1  # the stream's document index
    run_start = np.maximum(starts[doc], index[:, :1])  # where its run in the row begins
    positions = index - run_start if reset else index - index[:, :1]
    return {
        "tokens": tokens[index].astype(np.int32),
        "documents": (doc - doc[:, :1] + 1).astype(np.int32),
        "positions": positions.astype(np.int32),
    }


def pieces(starts: np.ndarray, size: int, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """(piece_starts, piece_lengths): each document of the stream of `size` tokens cut into
    pieces of `capacity` tokens, the last shorter."""
    lengths = np.diff(np.append(starts, size)).astype(np.int64)
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    count = -(-lengths // capacity)
    first = np.repeat(np.cumsum(count) - count, count)  # each piece's document's first piece
    within = np.arange(count.sum()) - first
    piece_starts = np.repeat(starts, count) + within * capacity
    piece_lengths = np.minimum(capacity, np.repeat(starts + lengths, count) - piece_starts)
    return piece_starts.astype(np.int64), piece_lengths.astype(np.int64)


def best_fit(starts: np.ndarray, size: int, capacity: int) -> Layout:
    """best_fit's rows of `capacity` tokens for the stream's documents."""
    piece_starts, piece_lengths = pieces(starts, size, capacity)
    by_length = np.argsort(-piece_lengths, kind="stable")  # longest first, ties in order
    row_of = np.empty(len(piece_lengths), np.int64)
    # Rows with room left, by their room: `rooms` the distinct rooms ascending, `rows_with`
    # each room's rows (a stack). The smallest room that fits is one bisection away.
    rooms: list[int] = []
    rows_with: dict[int, list[int]] = {}
    num_rows = 0
    for k in by_length.tolist():
        n = int(piece_lengths[k])
        i = bisect.bisect_left(rooms, n)
        if i == len(rooms):
            row, room = num_rows, capacity
            num_rows += 1
        else:
            room = rooms[i]
            row = rows_with[room].pop()
            if not rows_with[room]:
                del rows_with[room], rooms[i]
        row_of[k] = row
        if left := room - n:
            if left not in rows_with:
                rows_with[left] = []
                bisect.insort(rooms, left)
            rows_with[left].append(row)
    placed = np.empty_like(row_of)
    placed[by_length] = np.arange(len(by_length))  # each piece's turn: its place in its row
    order = np.lexsort((placed, row_of))
    offsets = np.concatenate([[0], np.cumsum(np.bincount(row_of, minlength=num_rows))])
    return Layout(piece_starts, piece_lengths, order, offsets.astype(np.int64), capacity)


def packed_rows(
    tokens: np.ndarray, layout: Layout, row_ids: np.ndarray, reset: bool
) -> dict[str, np.ndarray]:
    """best_fit: rows `row_ids` of `layout`, padded at the end (token 0, document 0).
    Vectorized: a row of small documents holds thousands of pieces."""
    row_ids = np.asarray(row_ids, np.int64)
    count = (layout.offsets[1:] - layout.offsets[:-1])[row_ids]  # pieces per row, >= 1
    piece = layout.order[_ranges(layout.offsets[row_ids], count)]
    length = layout.piece_lengths[piece]
    ends = np.cumsum(length)
    first_of_row = np.cumsum(count) - count
    column = ends - length - np.repeat((ends - length)[first_of_row], count)  # where it begins
    row = np.repeat(np.repeat(np.arange(len(row_ids)), count), length)
    col = _ranges(column, length)
    capacity = layout.capacity
    out = {k: np.zeros((len(row_ids), capacity), np.int32) for k in ("tokens", "documents")}
    out["tokens"][row, col] = tokens[_ranges(layout.piece_starts[piece], length)]
    out["documents"][row, col] = np.repeat(_ranges(np.ones_like(count), count), length)
    columns = np.broadcast_to(np.arange(capacity), (len(row_ids), capacity))
    used = np.add.reduceat(length, first_of_row)[:, None] if len(row_ids) else np.zeros((0, 1))
    positions = np.where(columns < used, 0, columns - used).astype(np.int32)  # padding
    positions[row, col] = col - np.repeat(column, length) if reset else col
    return {**out, "positions": positions}


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The concatenation of range(s, s + c) for each s, c."""
    counts = np.asarray(counts, np.int64)
    offsets = np.repeat(np.asarray(starts, np.int64) - (np.cumsum(counts) - counts), counts)
    return offsets + np.arange(counts.sum())
