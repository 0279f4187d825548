"""Where the layers live: the train state keeps them in stage order, checkpoints canonically.

Canonical order: layer l at position l of every `layers` leaf [N, ...]. Global chunk
g = c * S + r (the c-th of stage r's V chunks) holds the next `layers_per_chunk[g]`
canonical layers after chunk g - 1's. Stage order: each stage's V chunks back to back,
each padded with zero layers to the deepest chunk's depth n, so positions
[(r * V + c) * n, (r * V + c + 1) * n) hold chunk c * S + r. Split over `stage` in blocks
(P(STAGE), as `seqpipe.parallel.sharding.state_shardings` splits layers), stage r then holds
exactly its own chunks: the executor's [V, n, ...] view of them is a local reshape, and
parameters and gradients never move between stages. A padding layer is never run, its
gradient is zero, so it stays zero under the optimizer (AdamW moves a zero weight with a
zero gradient nowhere).

With V = 1 and equal chunks the two orders are the same and nothing here does anything.
Checkpoints stay canonical, so a run resumes under any stage count, V or layer split.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from ml_collections import ConfigDict

from seqpipe.parallel.sharding import STAGE, in_layers
from seqpipe.schedule import partition


@dataclasses.dataclass(frozen=True)
class Placement:
    """How the layers are split into chunks and chunks onto stages."""

    stages: int
    virtual: int
    layers_per_chunk: tuple[int, ...]  # by global chunk

    @classmethod
    def even(cls, num_layers: int, stages: int, virtual: int) -> "Placement":
        chunks = stages * virtual
        return cls(stages, virtual, (num_layers // chunks,) * chunks)

    @property
    def depth(self) -> int:
        """Layers of one chunk as a stage holds it: the deepest chunk's."""
        return max(self.layers_per_chunk)

    @property
    def trivial(self) -> bool:
        """Whether stage order is the canonical order."""
        return self.virtual == 1 and len(set(self.layers_per_chunk)) == 1

    def chunks_in_stage_order(self) -> list[tuple[int, int, int]]:
        """(stage-order position of the chunk's block, canonical start, layers) by chunk."""
        S, V, n = self.stages, self.virtual, self.depth
        starts = np.cumsum((0,) + self.layers_per_chunk[:-1])
        return [
            (((g % S) * V + g // S) * n, int(starts[g]), d)
            for g, d in enumerate(self.layers_per_chunk)
        ]

    def positions(self) -> np.ndarray:
        """The canonical layer at each stage-order position; -1 for padding."""
        out = np.full(self.stages * self.virtual * self.depth, -1)
        for at, start, d in self.chunks_in_stage_order():
            out[at : at + d] = np.arange(start, start + d)
        return out


def of_config(config: ConfigDict) -> Placement:
    """The placement the train state's layers are ordered for."""
    m = config.model
    if config.pipeline.schedule == "none":
        return Placement.even(m.num_layers, 1, 1)
    p = config.pipeline
    layers = partition.stage_layers(
        p.layers_per_stage,
        m.num_layers,
        config.mesh.stage,
        p.virtual_stages,
        seq_len=config.train.seq_len,
        **partition.model_dims(m, with_layers=False),
    )
    return Placement(config.mesh.stage, p.virtual_stages, layers)


def _stage_leaf(w, placement: Placement):
    n, blocks = placement.depth, {}
    for at, start, d in placement.chunks_in_stage_order():
        pad = jnp.zeros((n - d, *w.shape[1:]), w.dtype)
        blocks[at] = jnp.concatenate([w[start : start + d], pad])
    return jnp.concatenate([blocks[at] for at in sorted(blocks)])


def _canonical_leaf(w, placement: Placement):
    return jnp.concatenate([w[at : at + d] for at, _, d in placement.chunks_in_stage_order()])


def _map_layers(leaf_fn, tree, placement: Placement):
    """leaf_fn on every leaf under a "layers" key (layer axis first); the rest as it is."""
    if placement.trivial:
        return tree
    return jax.tree_util.tree_map_with_path(
        lambda p, x: leaf_fn(x, placement) if in_layers(p) else x, tree
    )


def to_stage_order(tree, placement: Placement):
    """Canonical -> stage order, for every leaf under a "layers" key in `tree` (parameters,
    gradients, optimizer moments, a whole train state; scalar counts are not under one)."""
    return _map_layers(_stage_leaf, tree, placement)


def to_canonical(tree, placement: Placement):
    """Stage order -> canonical: the inverse of `to_stage_order` (padding dropped)."""
    return _map_layers(_canonical_leaf, tree, placement)


def _resized(sharding, length: int):
    """A layer leaf's sharding at another length (padding added or dropped): split over
    `stage` in blocks where the length divides, else its layer axis whole on every stage
    (a canonical stack of, say, 22 layers on 8 stages; only checkpoints hold one); its
    other dimensions keep their split."""
    if isinstance(sharding, NamedSharding) and length % sharding.mesh.shape[STAGE]:
        return NamedSharding(sharding.mesh, P(None, *sharding.spec[1:]))
    return sharding


def canonical_abstract(tree, placement: Placement):
    """Shape structs of `tree`'s canonical form (a checkpoint's), with shardings."""
    if placement.trivial:
        return tree
    N = sum(placement.layers_per_chunk)

    def leaf(path, x):
        if not in_layers(path):
            return x
        shape = (N, *x.shape[1:])
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=_resized(x.sharding, N))

    return jax.tree_util.tree_map_with_path(leaf, tree)


def on_arrays(fn, tree, placement: Placement, donate: bool = False):
    """`fn` (`to_canonical` or `to_stage_order`) on a tree of arrays, a leaf at a time,
    jitted, a layer leaf keeping its sharding where its new length allows (`_resized`): for
    checkpoints, not the step (the layers cross stages here). Only the layer leaves are
    copied; with `donate`, each old one is deleted as soon as its copy is made, so at most
    one leaf is held twice. (XLA's donation cannot serve: a stack padded or unpadded has
    another shape, so the old buffers stayed alive, with a warning.)"""
    if placement.trivial:
        return tree
    leaf_fn = {to_canonical: _canonical_leaf, to_stage_order: _stage_leaf}[fn]
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [x for _, x in flat]
    length = (
        sum(placement.layers_per_chunk)
        if fn is to_canonical
        else placement.stages * placement.virtual * placement.depth
    )
    for i, (path, old) in enumerate(flat):
        if not in_layers(path):
            continue
        move = jax.jit(leaf_fn, static_argnums=1, out_shardings=_resized(old.sharding, length))
        leaves[i] = move(old, placement)
        if donate:
            old.delete()
    return jax.tree_util.tree_unflatten(treedef, leaves)
