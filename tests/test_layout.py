"""Stage order: each stage's block of the layers is its own V chunks, so the step moves no
parameters or gradients between stages; V = 1 changes nothing."""

import numpy as np

from seqpipe import layout


def test_stage_order_puts_each_stages_chunks_in_its_block():
    S, V, n = 4, 2, 3
    perm = layout.stage_order(S * V * n, S, V)
    for r in range(S):
        for c in range(V):
            for i in range(n):
                assert perm[(r * V + c) * n + i] == (c * S + r) * n + i
    tree = {"layers": {"w": np.arange(S * V * n * 2).reshape(S * V * n, 2)}, "count": 7}
    staged = layout.to_stage_order(tree, S, V)
    np.testing.assert_array_equal(staged["layers"]["w"], tree["layers"]["w"][perm])
    assert staged["count"] == 7  # not under "layers": left alone
    back = layout.to_canonical(staged, S, V)
    np.testing.assert_array_equal(back["layers"]["w"], tree["layers"]["w"])


def test_one_virtual_stage_is_the_canonical_order():
    np.testing.assert_array_equal(layout.stage_order(12, 4, 1), np.arange(12))
    tree = {"layers": {"w": np.arange(12)}}
    assert layout.to_stage_order(tree, 4, 1) is tree
    assert layout.to_canonical(tree, 4, 1) is tree
