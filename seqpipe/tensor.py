"""Tensor parallelism inside a pipeline stage (Megatron-LM's, with sequence parallelism).

Over the mesh axis `tensor` of t devices, a layer's attention heads and MLP columns are
split (`model.TENSOR_DIMS`), and between its matmuls the activations are split along the
segment's positions: each device holds L/t of them for the norms, the residual stream,
the messages between stages and the stash. A column-parallel matmul reads the whole
segment (`gather`: an all-gather over positions), a row-parallel one leaves partial sums
(`scatter`: a reduce-scatter over positions). The embedding and the head split the
vocabulary: `embed` looks up the ids in this device's rows, and the cross-entropy
(`model.chunked_xent`) combines the devices' logsumexps without gathering the logits.

The collectives have hand-written transposes (all-gather <-> reduce-scatter), so every
gradient is exact whatever JAX infers about replication (the executor's shard_map runs
with `check_vma=False`). With t = 1 every function here is the identity.

Convention for cotangents: a value every tensor device holds whole (the gathered
segment) gets from each device its own partial cotangent; the transpose of the
collective that made it whole (`gather`'s reduce-scatter) sums them.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

AXIS = "tensor"


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather(x, axis: int):
    return jax.lax.all_gather(x, AXIS, axis=axis, tiled=True)


def _gather_fwd(x, axis):
    return _gather(x, axis), None


def _gather_bwd(axis, _, g):
    return (jax.lax.psum_scatter(g, AXIS, scatter_dimension=axis, tiled=True),)


_gather.defvjp(_gather_fwd, _gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _scatter(x, axis: int):
    return jax.lax.psum_scatter(x, AXIS, scatter_dimension=axis, tiled=True)


def _scatter_fwd(x, axis):
    return _scatter(x, axis), None


def _scatter_bwd(axis, _, g):
    return (jax.lax.all_gather(g, AXIS, axis=axis, tiled=True),)


_scatter.defvjp(_scatter_fwd, _scatter_bwd)


def gather(x_BxQxD: jax.Array, tensor: int) -> jax.Array:
    """This device's positions [b, Q/t, ...] -> the whole segment's [b, Q, ...]."""
    return x_BxQxD if tensor == 1 else _gather(x_BxQxD, 1)


def scatter(partial_BxQxD: jax.Array, tensor: int) -> jax.Array:
    """Partial sums over the whole segment [b, Q, ...] -> this device's positions
    [b, Q/t, ...] of their total."""
    return partial_BxQxD if tensor == 1 else _scatter(partial_BxQxD, 1)


def index(tensor: int) -> jax.Array | int:
    """This device's place along `tensor` (0 without tensor parallelism)."""
    return 0 if tensor == 1 else jax.lax.axis_index(AXIS)


def embed(table_VxD: jax.Array, tokens_BxQ: jax.Array, tensor: int) -> jax.Array:
    """Token embeddings [b, Q/t, D] from this device's rows [V/t, D] of the table: ids
    outside them look up zeros, and the reduce-scatter sums the devices' rows."""
    if tensor == 1:
        return table_VxD[tokens_BxQ]
    rows = table_VxD.shape[0]
    local = tokens_BxQ - index(tensor) * rows
    mine = (local >= 0) & (local < rows)
    found = table_VxD[jnp.clip(local, 0, rows - 1)]
    # A multiply by a [b, Q, 1] mask, not a where: its backward keeps the mask, not a
    # [b, Q, D] one.
    return scatter(found * mine[..., None].astype(found.dtype), tensor)


def psum(x, tensor: int):
    """The sum over the tensor devices (of a scalar or a small array, in the forward only:
    callers differentiate by hand)."""
    return x if tensor == 1 else jax.lax.psum(x, AXIS)


def pmax(x, tensor: int):
    return x if tensor == 1 else jax.lax.pmax(x, AXIS)


def bound(fn, tensor: int):
    """`fn`, traceable where the tensor axis is not bound (a shape probe outside the step,
    from the tools): under an abstract mesh of `tensor` devices, inputs and outputs whole."""
    if tensor == 1 or AXIS in jax.sharding.get_abstract_mesh().axis_names:
        return fn
    mesh = jax.sharding.AbstractMesh((tensor,), (AXIS,))
    return jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
