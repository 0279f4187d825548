"""Stage order: each stage's block of the layers is its own V chunks, so the step moves no
parameters or gradients between stages; V = 1 changes nothing."""

import jax
import numpy as np
from helpers import run_of
from oracle import make_config

from seqpipe.parallel import layout, sharding
from seqpipe.run import config as config_lib
from seqpipe.targets import hlo
from seqpipe.train import optim
from seqpipe.train import step as step_lib


def test_stage_order_puts_each_stages_chunks_in_its_block():
    S, V, n = 4, 2, 3
    placement = layout.Placement.even(S * V * n, S, V)
    perm = placement.positions()
    for r in range(S):
        for c in range(V):
            for i in range(n):
                assert perm[(r * V + c) * n + i] == (c * S + r) * n + i
    tree = {"layers": {"w": np.arange(S * V * n * 2).reshape(S * V * n, 2)}, "count": 7}
    staged = layout.to_stage_order(tree, placement)
    np.testing.assert_array_equal(staged["layers"]["w"], tree["layers"]["w"][perm])
    assert staged["count"] == 7  # not under "layers": left alone
    back = layout.to_canonical(staged, placement)
    np.testing.assert_array_equal(back["layers"]["w"], tree["layers"]["w"])


def test_one_virtual_stage_is_the_canonical_order():
    placement = layout.Placement.even(12, 4, 1)
    np.testing.assert_array_equal(placement.positions(), np.arange(12))
    tree = {"layers": {"w": np.arange(12)}}
    assert layout.to_stage_order(tree, placement) is tree
    assert layout.to_canonical(tree, placement) is tree


def test_an_uneven_split_pads_each_stage_to_the_deepest():
    placement = layout.Placement(4, 1, (2, 3, 2, 1))
    np.testing.assert_array_equal(placement.positions(), [0, 1, -1, 2, 3, 4, 5, 6, -1, 7, -1, -1])
    w = np.arange(8 * 2, dtype=np.float32).reshape(8, 2) + 1
    staged = layout.to_stage_order({"layers": w}, placement)["layers"]
    assert staged.shape == (12, 2)
    at = placement.positions()
    np.testing.assert_array_equal(staged[at >= 0], w[at[at >= 0]])
    assert not np.asarray(staged[at < 0]).any()  # padding layers are zeros
    back = layout.to_canonical({"layers": staged}, placement)["layers"]
    np.testing.assert_array_equal(back, w)


def _step_collectives(config) -> tuple[dict, dict]:
    """Collectives of the compiled train step: inside the tick loop, and outside it."""
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.stage)
    tx = optim.make_optimizer(config.train)
    state = step_lib.abstract_state(run_of(config), mesh, tx)
    batch = jax.ShapeDtypeStruct(
        (config.train.global_batch_size, config.train.seq_len + 1),
        np.int32,
        sharding=sharding.batch_sharding(mesh),
    )
    step = step_lib.make_train_step(
        step_lib.make_grad_fn(run_of(config), mesh),
        tx,
        optim.lr_schedule(config.train),
        mesh,
        config_lib.shards_optimizer(config),
    )
    comps = hlo.computations(step.lower(state, batch).compile().as_text())
    inside = hlo.inside_loops(comps)
    count = lambda names: hlo.count_collectives("\n".join(comps[k] for k in names))  # noqa: E731
    return count(inside), count(set(comps) - inside)


def test_interleaved_step_sends_only_the_tick_loops_messages():
    """With V = 2 the step's collectives are those of V = 1: parameters and gradients stay
    on their stage (in canonical order, the step resharded them both ways: all-to-all)."""
    interleaved = make_config("seq1f1b_interleaved", (1, 4), 2, "uniform", "equal", 2)
    plain = make_config("seq1f1b", (1, 4), 2, "uniform", "equal", 1)
    plain.model.num_layers = interleaved.model.num_layers
    loop2, outside2 = _step_collectives(interleaved)
    loop1, outside1 = _step_collectives(plain)
    assert outside2["all-to-all"] == loop2["all-to-all"] == 0
    assert outside2["collective-permute"] == 0 and loop2["collective-permute"] > 0
    assert (loop2, outside2) == (loop1, outside1)
