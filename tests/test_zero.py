"""The sharded optimizer (ZeRO-1, `train.shard_optimizer`): each data replica keeps 1/data
of the moments, the step reduce-scatters gradients and all-gathers parameters outside the
tick loop, and training takes the same steps as with the optimizer state replicated."""

import jax
import numpy as np
import pytest
from helpers import run_of
from jax.sharding import PartitionSpec as P
from oracle import make_config

from seqpipe.parallel import sharding
from seqpipe.parallel.sharding import DATA, STAGE
from seqpipe.run import config as config_lib
from seqpipe.targets import hlo
from seqpipe.train import optim
from seqpipe.train import step as step_lib

LAYERS, EMBED = (jax.tree_util.DictKey("layers"),), (jax.tree_util.DictKey("embed"),)


def test_the_split_dimension():
    """The largest dimension data divides, never the layer axis; None where none does."""
    assert sharding.data_split_dim(EMBED, (61, 16), 2) == 1  # 61 is odd
    assert sharding.data_split_dim(EMBED, (64, 16), 2) == 0  # the largest
    assert sharding.data_split_dim(LAYERS, (8, 16, 24), 4) == 2  # not the layers' 8
    assert sharding.data_split_dim(LAYERS, (8, 6), 4) is None  # kept whole: nothing divides
    assert sharding.data_split_dim((), (), 4) is None  # a count
    assert sharding.data_split_dim(EMBED, (64, 16), 1) is None  # one replica: nothing to split
    assert sharding.leaf_spec(LAYERS, (8, 16, 24), 4) == P(STAGE, None, DATA)
    assert sharding.leaf_spec(LAYERS, (8, 6), 4) == P(STAGE)


def test_auto_is_on_with_more_than_one_replica():
    c = config_lib.base_config()
    for mode, data, on in [
        ("auto", 1, False),
        ("auto", 2, True),
        ("off", 2, False),
        ("on", 2, True),
    ]:
        c.train.shard_optimizer, c.mesh.data = mode, data
        assert config_lib.shards_optimizer(c) is on


def _config(data, stage, mode):
    if stage == 1:
        c = make_config("seq1f1b", (data, 2), 2, "uniform", "equal", 1)
        c.pipeline.update(schedule="none", microbatches=1, segments=1)
        c.mesh.stage = 1
    else:
        c = make_config("seq1f1b", (data, stage), 2, "uniform", "equal", 1)
    c.train.update(shard_optimizer=mode, steps=4, warmup_steps=1)
    config_lib.validate(c)
    return c


def _train(config, batches, state):
    """Losses, final state and the compiled step's collectives (inside the tick loop,
    outside it) of len(batches) steps from `state`, put in this config's shardings."""
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.stage)
    tx = optim.make_optimizer(config.train)
    on = config_lib.shards_optimizer(config)
    step = step_lib.make_train_step(
        step_lib.make_grad_fn(run_of(config), mesh), tx, optim.lr_schedule(config.train), mesh, on
    )
    shardings = jax.tree.map(
        lambda x: x.sharding, step_lib.abstract_state(run_of(config), mesh, tx)
    )
    state = jax.device_put(state, shardings)
    batches = [jax.device_put(b, sharding.batch_sharding(mesh)) for b in batches]
    compiled = step.lower(state, batches[0]).compile()
    losses = []
    for tokens in batches:
        state, metrics = compiled(state, tokens)
        losses.append(float(metrics["loss"]))
    comps = hlo.computations(compiled.as_text())
    inside = hlo.inside_loops(comps)
    count = lambda names: hlo.count_collectives("\n".join(comps[k] for k in names))  # noqa: E731
    return losses, state, (count(inside), count(set(comps) - inside))


@pytest.mark.parametrize(
    "data, stage",
    [
        (2, 2),
        pytest.param(4, 1, marks=pytest.mark.slow),
        pytest.param(2, 4, marks=pytest.mark.slow),
    ],
)
def test_sharded_steps_equal_replicated_ones(data, stage):
    """Four AdamW steps with the moments split over data equal those with them whole on
    every replica, loss by loss and weight by weight; each replica holds 1/data of every
    moment that splits, the parameters stay whole on every replica, and the step's
    collectives over data are outside the tick loop: one reduce-scatter and one all-gather
    per parameter in place of the gradients' all-reduce."""
    off, on = _config(data, stage, "off"), _config(data, stage, "on")
    shape = (off.train.global_batch_size, off.train.seq_len + 1)
    batches = [
        np.asarray(jax.random.randint(jax.random.key(i), shape, 0, off.model.vocab_size))
        for i in range(4)
    ]
    mesh = sharding.make_mesh(data, stage)
    state = step_lib.init_state(run_of(off), mesh, optim.make_optimizer(off.train))
    state = jax.tree.map(np.asarray, state)  # the same start for both, on the host
    losses_off, state_off, (loop_off, outside_off) = _train(off, batches, state)
    losses_on, state_on, (loop_on, outside_on) = _train(on, batches, state)
    np.testing.assert_allclose(losses_on, losses_off, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(state_on), jax.tree.leaves(state_off), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    split = 0
    for path, x in jax.tree_util.tree_leaves_with_path(state_on):
        local = x.addressable_shards[0].data.shape
        whole = list(x.shape)
        if sharding.in_layers(path):
            whole[0] //= stage
        dim = sharding.data_split_dim(path, x.shape, data) if sharding.in_optimizer(path) else None
        if dim is not None:
            whole[dim] //= data
            split += 1
        assert list(local) == whole, jax.tree_util.keystr(path)
    params = len(jax.tree.leaves(state_on["params"]))
    assert split == 2 * params  # mu and nu of every parameter: here every one splits
    assert loop_on == loop_off
    if stage == 1:
        return  # no pipeline: XLA places the replicas' reductions itself (in the layer scan)
    assert loop_on["reduce-scatter"] == loop_on["all-gather"] == loop_on["all-reduce"] == 0
    assert outside_off["reduce-scatter"] == outside_off["all-gather"] == 0
    assert outside_on["reduce-scatter"] == outside_on["all-gather"] == params
