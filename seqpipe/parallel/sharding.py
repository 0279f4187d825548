"""Mesh axes and shardings, declared in one place."""

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from seqpipe.parallel import tensor as tensor_lib

DATA = "data"
STAGE = "stage"
CONTEXT = "context"  # `seqpipe.parallel.context`
TENSOR = tensor_lib.AXIS
AXES = (DATA, STAGE, CONTEXT, TENSOR)
# A mixture's experts [N, X, ...] (`seqpipe.models.moe`): split over `data` on their
# expert dimension (expert parallelism) wherever the mesh has data replicas.
EXPERT_PARAMS = ("e_gate", "e_in", "e_out")  # as `seqpipe.models.moe.EXPERTS`


def make_mesh(
    data: int,
    stage: int,
    devices: Sequence[jax.Device] | None = None,
    tensor: int = 1,
    context: int = 1,
) -> Mesh:
    """A (data, stage, context, tensor) mesh over the first data * stage * context * tensor
    of `devices` (default: this process's backend; for a TPU slice without one,
    `seqpipe.targets.topology.devices`). Later axes vary faster, by how much each moves:
    a tensor-parallel group is adjacent devices (one host, one NVLink domain), as its
    collectives run at every matmul; a context group next (an all-gather of K/V per
    layer); pipeline stages (one message a tick) and data replicas (one reduction a step)
    may span hosts.

    Auto axes: outside shard_map XLA propagates shardings (the reference model needs
    no annotations); inside it, the pipeline is explicit anyway.
    """
    shape = (data, stage, context, tensor)
    devices = list(jax.devices() if devices is None else devices)[: math.prod(shape)]
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    try:
        return jax.make_mesh(shape, AXES, axis_types=auto, devices=devices)
    except NotImplementedError:
        # A TPU torus whose axes do not factor into these sizes (tensor 8 on 4x4x4):
        # split a physical axis rather than refuse.
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return Mesh(grid, AXES, axis_types=auto)


def mesh_of(config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh a (resolved) config names."""
    m = config.mesh
    return make_mesh(m.data, m.stage, devices, m.get("tensor", 1), m.get("context", 1))


def bound(
    fn,
    tensor: int = 1,
    context: int = 1,
    devices: Sequence[jax.Device] | None = None,
    data: int = 1,
):
    """`fn`, traceable where the tensor and context axes (and `data`, over which a
    mixture's experts are split) are not bound (a shape probe outside the step, from the
    tools): under an abstract mesh of those axes, inputs and outputs whole. With
    `devices`, a mesh of the first of them instead, so that `fn` compiles (a unit
    compiled alone for its memory, FLOPs or time: each device's program is the one a
    device of the step runs)."""
    sizes = {DATA: data, CONTEXT: context, TENSOR: tensor}  # in the mesh's order
    names = jax.sharding.get_abstract_mesh().axis_names
    axes = [a for a, size in sizes.items() if size > 1 and a not in names]
    if not axes:
        return fn
    shape = tuple(sizes[a] for a in axes)
    if devices is None:
        mesh = jax.sharding.AbstractMesh(shape, tuple(axes))
    else:
        grid = np.array(list(devices)[: math.prod(shape)]).reshape(shape)
        mesh = Mesh(grid, tuple(axes))
    return jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches split over data replicas, whole on every stage."""
    return NamedSharding(mesh, P(DATA))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def in_layers(path) -> bool:
    """Whether a pytree path lies under a "layers" key: the stacked, stage-split weights
    (and the optimizer moments that mirror them)."""
    return any(getattr(k, "key", None) == "layers" for k in path)


def in_optimizer(path) -> bool:
    """Whether a train-state path lies under its "opt_state" key."""
    return bool(path) and getattr(path[0], "key", None) == "opt_state"


def tensor_split_dim(path, shape: Sequence[int], tensor: int = 1) -> int | None:
    """The dimension of a parameter-shaped leaf (of the whole parameter's `shape`) that
    `tensor` splits (`seqpipe.parallel.tensor.param_dim`, found by the leaf's name), or None: norm
    gains, scalars, and K/V projections with fewer heads than `tensor` (held whole)."""
    keys = [getattr(k, "key", None) for k in path]
    name = keys[-1] if keys and isinstance(keys[-1], str) else None
    dim = tensor_lib.DIMS.get(name) if name else None
    if dim is None or dim >= len(shape):
        return None
    return tensor_lib.param_dim(name, shape, tensor)


def is_expert(path) -> bool:
    """Whether a parameter-shaped leaf is a mixture's experts (split over `data`)."""
    return in_layers(path) and getattr(path[-1], "key", None) in EXPERT_PARAMS


def data_split_dim(path, shape: Sequence[int], data: int, tensor: int = 1) -> int | None:
    """The dimension of a parameter-shaped leaf (a gradient, an Adam moment) that the
    sharded optimizer splits over `data`: the largest one `data` divides (the first of
    equals), never a layer leaf's layer axis, which `stage` splits, nor with `tensor` > 1
    the dimension `tensor` splits. None (the leaf stays whole on every replica) with one
    replica, for scalars (optax's counts) and for a leaf no dimension of which `data`
    divides (say a norm gain of 50 on 4 replicas)."""
    if data == 1:
        return None
    first = 1 if in_layers(path) else 0
    taken = tensor_split_dim(path, shape, tensor) if tensor > 1 else None
    dims = [d for d in range(first, len(shape)) if shape[d] % data == 0 and d != taken]
    return max(dims, key=lambda d: shape[d], default=None)


def leaf_spec(path, shape: Sequence[int], data: int = 1, tensor: int = 1, experts: int = 1) -> P:
    """A parameter-shaped leaf's spec: layers split over `stage` by blocks of layers, with
    `tensor` > 1 the heads, MLP columns or vocabulary over `tensor` (`tensor_split_dim`),
    and with `data` > 1 the dimension `data_split_dim` picks over `data` as well. With
    `experts` > 1 (the mesh's data replicas) a mixture's experts are split over `data`
    instead, whether or not the optimizer is."""
    parts = [STAGE if in_layers(path) else None] + [None] * (len(shape) - 1)
    tdim = tensor_split_dim(path, shape, tensor) if tensor > 1 else None
    if tdim is not None:
        parts[tdim] = TENSOR
    if experts > 1 and is_expert(path):
        parts[1] = DATA
    elif (dim := data_split_dim(path, shape, data, tensor)) is not None:
        parts[dim] = DATA
    while parts and parts[-1] is None:  # P(STAGE), not P(STAGE, None, ...)
        parts.pop()
    return P(*parts)


def state_shardings(state_shapes, mesh: Mesh, shard_optimizer: bool = False):
    """Layer weights (and their optimizer moments) split over `stage` by blocks of layers,
    and over `tensor` as `leaf_spec` says; everything else replicated.

    With `shard_optimizer` (ZeRO-1, Megatron's distributed optimizer) every optimizer leaf
    under "opt_state" is also split over `data` (`data_split_dim`): each replica keeps
    and updates its 1/data share of the moments; parameters stay whole on every replica."""
    data, tensor = mesh.shape[DATA], mesh.shape[TENSOR]

    def spec(path, x):
        split = shard_optimizer and in_optimizer(path)
        return NamedSharding(mesh, leaf_spec(path, x.shape, data if split else 1, tensor, data))

    return jax.tree_util.tree_map_with_path(spec, state_shapes)


def gradient_shardings(params, mesh: Mesh, shard_optimizer: bool):
    """Where the step's gradients go: the moments' shardings (each replica reduces only
    its share) with the sharded optimizer, else the parameters'."""
    data = mesh.shape[DATA] if shard_optimizer else 1
    tensor, experts = mesh.shape[TENSOR], mesh.shape[DATA]
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, leaf_spec(path, x.shape, data, tensor, experts)),
        params,
    )


def split_table(
    params, data: int, tensor: int = 1
) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(leaf, shape, dimension split over `data` or None) for every parameter: what the
    sharded optimizer does with each (`--compile_only` prints the leaves kept whole)."""
    return [
        (jax.tree_util.keystr(path), tuple(x.shape), data_split_dim(path, x.shape, data, tensor))
        for path, x in jax.tree_util.tree_leaves_with_path(params)
    ]
