"""Where the layers live: the train state keeps them in stage order, checkpoints canonically.

Canonical order: layer l at position l of every `layers` leaf [N, ...]. Global chunk
g = c * S + r (the c-th of stage r's V chunks) holds canonical layers [g * n, (g + 1) * n).
Stage order: each stage's V chunks back to back, so position (r * V + c) * n + i holds
canonical layer (c * S + r) * n + i. Split over `stage` in blocks (P(STAGE), as
`seqpipe.sharding.state_shardings` splits layers), stage r then holds exactly its own
chunks: the executor's [V, n, ...] view of them is a local reshape, and parameters and
gradients never move between stages.

With V = 1 the two orders are the same and nothing here does anything. Checkpoints stay
canonical, so a run resumes under any stage count or V.
"""

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict

from seqpipe.sharding import in_layers


def of_config(config: ConfigDict) -> tuple[int, int]:
    """(stages, virtual stages) the train state's layers are ordered for."""
    if config.pipeline.schedule == "none":
        return 1, 1
    return config.mesh.stage, config.pipeline.virtual_stages


def stage_order(num_layers: int, stages: int, virtual: int) -> np.ndarray:
    """perm[p]: the canonical layer at stage-order position p."""
    n = num_layers // (stages * virtual)
    return np.arange(num_layers).reshape(virtual, stages, n).transpose(1, 0, 2).reshape(-1)


def _stage_leaf(w, stages: int, virtual: int):
    n = w.shape[0] // (stages * virtual)
    w = jnp.swapaxes(w.reshape(virtual, stages, n, *w.shape[1:]), 0, 1)
    return w.reshape(-1, *w.shape[3:])


def _canonical_leaf(w, stages: int, virtual: int):
    n = w.shape[0] // (stages * virtual)
    w = jnp.swapaxes(w.reshape(stages, virtual, n, *w.shape[1:]), 0, 1)
    return w.reshape(-1, *w.shape[3:])


def _map_layers(leaf_fn, tree, stages: int, virtual: int):
    """leaf_fn on every leaf under a "layers" key (layer axis first); the rest as it is."""
    if virtual == 1:
        return tree
    return jax.tree_util.tree_map_with_path(
        lambda p, x: leaf_fn(x, stages, virtual) if in_layers(p) else x, tree
    )


def to_stage_order(tree, stages: int, virtual: int):
    """Canonical -> stage order, for every leaf under a "layers" key in `tree` (parameters,
    gradients, optimizer moments, a whole train state; scalar counts are not under one)."""
    return _map_layers(_stage_leaf, tree, stages, virtual)


def to_canonical(tree, stages: int, virtual: int):
    """Stage order -> canonical: the inverse of `to_stage_order`."""
    return _map_layers(_canonical_leaf, tree, stages, virtual)


def _jitted_leaves(leaf_fn, leaves, stages: int, virtual: int):
    return [leaf_fn(w, stages, virtual) for w in leaves]


def on_arrays(fn, tree, stages: int, virtual: int, donate: bool = False):
    """`fn` (`to_canonical` or `to_stage_order`) on a tree of arrays, jitted, every leaf
    keeping its sharding: for checkpoints, not the step (the layers cross stages here).
    Only the layer leaves are copied; with `donate`, their old buffers are given up."""
    if virtual == 1:
        return tree
    leaf_fn = {to_canonical: _canonical_leaf, to_stage_order: _stage_leaf}[fn]
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    picked = [i for i, (path, _) in enumerate(flat) if in_layers(path)]
    leaves = [x for _, x in flat]
    jitted = jax.jit(
        _jitted_leaves,
        static_argnums=(0, 2, 3),
        out_shardings=[leaves[i].sharding for i in picked],
        donate_argnums=(1,) if donate else (),
    )
    moved = jitted(leaf_fn, [leaves[i] for i in picked], stages, virtual)
    for i, w in zip(picked, moved, strict=True):
        leaves[i] = w
    return jax.tree_util.tree_unflatten(treedef, leaves)
