"""Tensor parallelism inside a pipeline stage (Megatron-LM's, with sequence parallelism).

Over the mesh axis `tensor` of t devices, a layer's attention heads and MLP columns are
split (`DIMS`), and between its matmuls the activations are split along the
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

AXIS = "tensor"

# The dimension tensor parallelism splits, per parameter (as `init_params` shapes them,
# layers with their leading axis): heads of the QKV (column-parallel) and output
# (row-parallel) projections and of their biases, the MLP's hidden columns, the
# vocabulary of the embedding and the head. Norm gains are whole on every tensor device;
# so are the K/V projections where the tensor devices outnumber their heads (`KV_PARAMS`).
DIMS = {
    "wq": 2,
    "wk": 2,
    "wv": 2,
    "wo": 1,
    "bq": 1,
    "bk": 1,
    "bv": 1,
    "w_gate": 2,
    "w_in": 2,
    "w_out": 1,
    "e_gate": 3,  # experts [X, D, F]: each expert's columns, as a dense MLP's
    "e_in": 3,
    "e_out": 2,
    "s_gate": 2,  # the shared expert [D, F]: as a dense MLP's
    "s_in": 2,
    "s_out": 1,
    "embed": 0,
    "head": 1,
}
KV_PARAMS = ("wk", "wv", "bk", "bv")


def param_dim(name: str, shape=None, tensor: int = 1) -> int | None:
    """The dimension of parameter `name` split over the tensor axis, or None. With its
    (whole) `shape` and `tensor` devices: None for K/V heads `tensor` does not divide,
    which every device then holds whole (`model.GPTConfig.kv_replicated`)."""
    dim = DIMS.get(name)
    if dim is not None and name in KV_PARAMS and shape is not None and shape[dim] % tensor:
        return None
    return dim


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def all_gather(x, name: str, axis: int):
    """x's blocks of every device along mesh axis `name`, concatenated on `axis`; its
    transpose is the reduce-scatter (each device's cotangent of the whole is partial)."""
    return jax.lax.all_gather(x, name, axis=axis, tiled=True)


def _all_gather_fwd(x, name, axis):
    return all_gather(x, name, axis), None


def _all_gather_bwd(name, axis, _, g):
    return (jax.lax.psum_scatter(g, name, scatter_dimension=axis, tiled=True),)


all_gather.defvjp(_all_gather_fwd, _all_gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def reduce_scatter(x, name: str, axis: int):
    """This device's block along `axis` of the sum over mesh axis `name`; its transpose is
    the all-gather."""
    return jax.lax.psum_scatter(x, name, scatter_dimension=axis, tiled=True)


def _reduce_scatter_fwd(x, name, axis):
    return reduce_scatter(x, name, axis), None


def _reduce_scatter_bwd(name, axis, _, g):
    return (jax.lax.all_gather(g, name, axis=axis, tiled=True),)


reduce_scatter.defvjp(_reduce_scatter_fwd, _reduce_scatter_bwd)


def gather(x_BxQxD: jax.Array, tensor: int) -> jax.Array:
    """This device's positions [b, Q/t, ...] -> the whole segment's [b, Q, ...]."""
    return x_BxQxD if tensor == 1 else all_gather(x_BxQxD, AXIS, 1)


def scatter(partial_BxQxD: jax.Array, tensor: int) -> jax.Array:
    """Partial sums over the whole segment [b, Q, ...] -> this device's positions
    [b, Q/t, ...] of their total."""
    return partial_BxQxD if tensor == 1 else reduce_scatter(partial_BxQxD, AXIS, 1)


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
