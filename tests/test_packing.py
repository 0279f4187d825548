"""Packing's invariants (`seqpipe.data.packing`), on streams of random document lengths."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpipe.data import packing

# Document lengths: one-token documents, documents longer than a row, a stream of one.
LENGTHS = st.lists(st.integers(1, 40), min_size=1, max_size=30)
SEQ_LEN = st.integers(1, 17)


def stream(lengths):
    """Tokens that name their place (token i is i), and the documents' starts."""
    lengths = np.array(lengths, np.int64)
    return np.arange(lengths.sum(), dtype=np.int64), packing.document_starts(lengths)


def check_rows(rows, seq_len, reset):
    """What every packed row satisfies (PACKING.md): int32 [R, L+1]; ids 1, 2, ... in row
    order, non-decreasing, padding (0) only at the end; positions restart at each document."""
    docs, pos = rows["documents"], rows["positions"]
    for key in ("tokens", "documents", "positions"):
        assert rows[key].dtype == np.int32 and rows[key].shape[1] == seq_len + 1
    for d, p in zip(docs, pos, strict=True):
        real = d[d > 0]
        assert d[0] == 1 and np.all(np.diff(real) >= 0) and np.all(np.diff(real) <= 1)
        assert np.all(d[len(real) :] == 0)  # padding only at the end
        new = np.flatnonzero(np.diff(d, prepend=-1))  # each run's first token
        for a, b in zip(new, [*new[1:], len(d)], strict=True):
            want = np.arange(b - a) if reset or d[a] == 0 else np.arange(a, b)
            np.testing.assert_array_equal(p[a:b], want)


@settings(max_examples=60, deadline=None)
@given(LENGTHS, SEQ_LEN, st.booleans())
def test_concat_rows_are_the_unpacked_windows_with_their_documents(lengths, seq_len, reset):
    tokens, starts = stream(lengths)
    n = (tokens.size - 1) // seq_len
    if n < 1:
        return
    ids = np.random.default_rng(0).permutation(n)
    rows = packing.window_rows(tokens, starts, seq_len, ids, reset)
    windows = ids[:, None] * seq_len + np.arange(seq_len + 1)
    np.testing.assert_array_equal(rows["tokens"], windows)  # today's stream, bit for bit
    check_rows(rows, seq_len, reset)
    assert np.all(rows["documents"] > 0)  # concat never pads
    # A new document id exactly where a document of the stream starts (or the row does).
    doc_of = np.searchsorted(starts, windows, side="right")
    np.testing.assert_array_equal(np.diff(rows["documents"]), np.diff(doc_of))


@settings(max_examples=60, deadline=None)
@given(LENGTHS, SEQ_LEN, st.booleans())
def test_best_fit_holds_every_token_once_documents_whole_when_they_fit(lengths, seq_len, reset):
    tokens, starts = stream(lengths)
    capacity = seq_len + 1
    layout = packing.best_fit(starts, tokens.size, capacity)
    rows = packing.packed_rows(tokens, layout, np.arange(layout.num_rows), reset)
    check_rows(rows, seq_len, reset)
    real = rows["tokens"][rows["documents"] > 0]
    np.testing.assert_array_equal(np.sort(real), tokens)  # every token exactly once
    doc_of = np.searchsorted(starts, np.arange(tokens.size), side="right") - 1
    for t, d in zip(rows["tokens"], rows["documents"], strict=True):
        for i in range(1, d.max() + 1):
            run = t[d == i]
            assert np.all(np.diff(run) == 1)  # a piece is contiguous, in order
            assert len(set(doc_of[run])) == 1  # of one document
            length = lengths[doc_of[run[0]]]
            if length <= capacity:
                assert len(run) == length  # a document that fits stays whole
    # Best fit wastes little: no two rows could be merged.
    used = np.sort((rows["documents"] > 0).sum(1))
    assert len(used) < 2 or used[0] + used[1] > capacity


def test_best_fit_places_each_piece_in_the_fullest_row_that_holds_it():
    # Rows of 10; pieces longest first: 6 opens row 0 (room 4), 6 opens row 1 (room 4), 3
    # goes to a row with room 4 (row 1), and 1 to the fullest row that holds it: row 1
    # (room 1), where first fit would take row 0 (room 4).
    tokens, starts = stream([6, 6, 3, 1])
    layout = packing.best_fit(starts, tokens.size, 10)
    rows = packing.packed_rows(tokens, layout, np.arange(layout.num_rows), True)
    np.testing.assert_array_equal(
        rows["tokens"], [[0, 1, 2, 3, 4, 5, 0, 0, 0, 0], [6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
    )
    np.testing.assert_array_equal(rows["documents"], [[1] * 6 + [0] * 4, [1] * 6 + [2] * 3 + [3]])
    np.testing.assert_array_equal(
        rows["positions"], [[*range(6), *range(4)], [*range(6), 0, 1, 2, 0]]
    )


def test_a_document_longer_than_a_row_is_cut_into_full_rows_and_a_rest():
    tokens, starts = stream([23])
    layout = packing.best_fit(starts, tokens.size, 10)
    rows = packing.packed_rows(tokens, layout, np.arange(layout.num_rows), False)
    np.testing.assert_array_equal(rows["tokens"][:2], [np.arange(10), np.arange(10, 20)])
    np.testing.assert_array_equal(rows["tokens"][2, :3], [20, 21, 22])
    np.testing.assert_array_equal(rows["positions"][2], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6])


def test_split_starts_begins_the_second_part_with_the_cut_document():
    starts = np.array([0, 5, 9, 14])
    head, tail = packing.split_starts(starts, 11)
    assert head.tolist() == [0, 5, 9] and tail.tolist() == [0, 3]
    head, tail = packing.split_starts(starts, 9)  # the split on a document start
    assert head.tolist() == [0, 5] and tail.tolist() == [0, 5]
