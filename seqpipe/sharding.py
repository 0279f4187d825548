"""Mesh axes and shardings, declared in one place."""

from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA = "data"
STAGE = "stage"


def make_mesh(data: int, stage: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, stage) mesh over the first data * stage of `devices` (default: this
    process's backend; for a TPU slice without one, `seqpipe.topology.devices`).

    Auto axes: outside shard_map XLA propagates shardings (the reference model needs
    no annotations); inside it, the pipeline is explicit anyway.
    """
    devices = list(jax.devices() if devices is None else devices)[: data * stage]
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((data, stage), (DATA, STAGE), axis_types=auto, devices=devices)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches split over data replicas, whole on every stage."""
    return NamedSharding(mesh, P(DATA))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def in_layers(path) -> bool:
    """Whether a pytree path lies under a "layers" key: the stacked, stage-split weights
    (and the optimizer moments that mirror them)."""
    return any(getattr(k, "key", None) == "layers" for k in path)


def state_shardings(state_shapes, mesh: Mesh):
    """Layer weights (and their optimizer moments) split over `stage` by blocks of layers;
    everything else replicated. With one stage this is plain replication."""

    def spec(path, _):
        return NamedSharding(mesh, P(STAGE) if in_layers(path) else P())

    return jax.tree_util.tree_map_with_path(spec, state_shapes)
