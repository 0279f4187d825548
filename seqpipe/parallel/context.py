"""Context parallelism: every segment's positions split over the mesh axis `context`.

Of every segment of L positions, cut into 2C pieces of h = L / 2C, context device c of C
holds pieces c and 2C - 1 - c (zigzag, as Llama 3 and torchtitan split a sequence):
under the causal mask the early piece sees few keys and the late one many, and their sum
is the same on every device, in every segment. A device's *local row* is its two pieces
of every segment, in segment order (`row_order`). The executor runs units on local rows
as it would on shorter sequences: messages, stashes and the K/V cache hold this device's
positions alone, so each device keeps 1/C of the prefix.

Attention is the one place that sees the whole sequence (`attend`): this device's keys
and values of the prefix and of the segment are all-gathered over `context`, per layer,
and put in sequence order; each of its two query pieces then attends to the keys before
it plus its own piece, the contract of `seqpipe.kernels.attention.attend`, so every
implementation runs as it is, document masks and their block skipping included. Which
pieces a device holds is known only at run time (its place on the axis), so the two
calls with that device's prefix lengths are its branch of a `lax.switch`. The gather's
transpose is a reduce-scatter: each prefix cotangent returns to the device that holds
its position. RoPE rotates each position at its place in the sequence (`rope`).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from seqpipe.kernels import attention, attention_residuals, kv_cache
from seqpipe.kernels.rope import NO_SCALING, RopeScaling, inverse_frequencies
from seqpipe.kernels.rope import tables as rope_tables
from seqpipe.parallel.sharding import CONTEXT

AXIS = CONTEXT


@dataclasses.dataclass(frozen=True)
class Split:
    """The last of the segments a device holds `local_lengths` of (L_j / C each, two
    pieces of L_j / 2C), its positions split over `size` context devices."""

    size: int
    local_lengths: tuple[int, ...]

    @property
    def piece(self) -> int:
        """h: the positions of one piece of the segment."""
        return self.local_lengths[-1] // 2

    @property
    def offset(self) -> int:
        """Where the segment starts in the sequence."""
        return sum(self.local_lengths[:-1]) * self.size

    def pieces(self, device) -> tuple:
        """The segment's pieces `device` holds, early then late."""
        return device, 2 * self.size - 1 - device

    def starts(self, device) -> tuple:
        """Where `device`'s two pieces start in the sequence."""
        return tuple(self.offset + p * self.piece for p in self.pieces(device))

    # What a layer runs across the split (`model.layer` reads the split off the segment's
    # `Packing`, and so needs no import of this module).
    def attend(self, impl: str, q, k_prefix, v_prefix, k_seg, v_seg, kv_ids=None, cache=None):
        return attend(impl, q, k_prefix, v_prefix, k_seg, v_seg, self, kv_ids, cache)

    def rope(self, x, base: float, scaling: RopeScaling = NO_SCALING, positions=None):
        return rope(x, self, base, scaling, positions)


def row_order(lengths, size: int) -> np.ndarray:
    """[C, L / C]: the sequence position of each position of each device's local row,
    for segments of `lengths` (whole, in sequence order)."""
    rows, offset = [[] for _ in range(size)], 0
    for length in lengths:
        h = length // (2 * size)
        for c in range(size):
            for p in (c, 2 * size - 1 - c):
                rows[c].append(np.arange(offset + p * h, offset + (p + 1) * h))
        offset += length
    return np.stack([np.concatenate(r) for r in rows])


def index(size: int):
    """This device's place along `context` (0 without context parallelism)."""
    return 0 if size == 1 else jax.lax.axis_index(AXIS)


def local_rows(x_BxL: jax.Array, lengths, size: int) -> jax.Array:
    """This device's local rows of whole rows [b, L] (segments of `lengths`)."""
    if size == 1:
        return x_BxL
    order = jnp.asarray(row_order(lengths, size))
    return jnp.take(x_BxL, order[index(size)], axis=1)


@jax.custom_vjp
def _gather(x):
    return jax.lax.all_gather(x, AXIS, axis=0)


def _gather_fwd(x):
    return _gather(x), None


def _gather_bwd(_, g):
    return (jax.lax.psum_scatter(g, AXIS, scatter_dimension=0),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def in_sequence(x_BxRx: jax.Array, split: Split, differentiable: bool = True) -> jax.Array:
    """Every device's local rows [b, R, ...] up to the end of `split`'s segment, gathered,
    in sequence order: [b, R * C, ...]."""
    gathered = _gather(x_BxRx) if differentiable else jax.lax.all_gather(x_BxRx, AXIS, axis=0)
    parts, start = [], 0
    for length in split.local_lengths:
        h, devices = length // 2, range(split.size)
        block = gathered[:, :, start : start + length]
        parts += [block[c, :, :h] for c in devices] + [block[c, :, h:] for c in reversed(devices)]
        start += length
    return jnp.concatenate(parts, axis=1)


def attend(impl: str, q, k_prefix, v_prefix, k_seg, v_seg, split: Split, kv_ids=None, cache=None):
    """`attention.attend` of this device's queries of the segment ([b, L/C, H, E], its two
    pieces) on its local prefix [b, P/C, K, E] and segment K/V [b, L/C, K, E]: the keys of
    the whole sequence up to each query. `kv_ids` (packed rows): the local kernel ids of
    the prefix and the segment, [b, P/C + L/C]. With `cache` (a `kv_cache.Prefix` at the
    layer) the local prefix is read out of the K/V cache and `k_prefix`, `v_prefix` are
    zero sinks for its cotangents (`attention.attend_cached`). Checkpointed but for the
    attention's own residuals: a backward reads the prefix and gathers the keys again
    rather than keep either."""

    def whole(q, k_prefix, v_prefix, k_seg, v_seg, kv_ids, cache):
        if cache is not None:  # inside the checkpoint: no residual is a copy of the prefix
            local = sum(split.local_lengths[:-1])
            k_prefix, v_prefix = (
                cache.block(which, 0, local, q.dtype) + sink[:, :local]
                for which, sink in ((0, k_prefix), (1, v_prefix))
            )
        keys = [
            in_sequence(jnp.concatenate(kv, axis=1), split)
            for kv in ((k_prefix, k_seg), (v_prefix, v_seg))
        ]
        ids = None if kv_ids is None else in_sequence(kv_ids, split, differentiable=False)
        branches = [functools.partial(_device_attention, impl, split, c) for c in range(split.size)]
        return jax.lax.switch(index(split.size), branches, q, *keys, ids)

    policy = jax.checkpoint_policies.save_only_these_names(*attention_residuals.NAMES)
    args = (q, k_prefix, v_prefix, k_seg, v_seg, kv_ids, cache)
    return jax.checkpoint(whole, policy=policy)(*args)


def _device_attention(impl: str, split: Split, device: int, q, keys_k, keys_v, ids):
    """Device `device`'s two query pieces on the keys before each and their own.

    Where the kernel reads a prefix in place (`blockwise`) it reads
    each piece's prefix out of the gathered keys, which are also the sinks its cotangents
    come back as (their values unread): no branch slices a prefix of its own length. A
    slice is a residual of the branch's attention, and a switch's residuals are the union
    of its branches' (each padded with zeros in the others): C devices' prefix copies,
    twice each, where one gathered array serves them all."""
    h, outs = split.piece, []
    # pallas_gpu's cached kernel under the switch failed in Pallas interpret mode (a
    # KeyError in its discharge, 2026-12-07): it slices its prefix until checked on a GPU.
    in_place = impl == "blockwise"
    cache = kv_cache.Prefix.holding(keys_k[None], keys_v[None]) if in_place else None
    for half, start in enumerate(split.starts(device)):
        q_piece = q[:, half * h : (half + 1) * h]
        own = slice(start, start + h)
        docs = None if ids is None else (ids[:, own], ids[:, : start + h])
        k_own, v_own = keys_k[:, own], keys_v[:, own]
        if in_place:
            out = attention.attend_cached(
                impl, q_piece, cache, keys_k, keys_v, start, k_own, v_own, docs
            )
        else:
            k_pre, v_pre = keys_k[:, :start], keys_v[:, :start]
            out = attention.attend(impl, q_piece, k_pre, v_pre, k_own, v_own, docs)
        outs.append(out)
    return jnp.concatenate(outs, axis=1)


def rope(x_BxLxHxE, split: Split, base: float, scaling: RopeScaling = NO_SCALING, positions=None):
    """`attention.rope` of this device's positions of the segment ([b, L/C, H, E]), each
    at its place in the sequence, or at `positions` [b, L/C] (packed rows)."""
    if positions is not None:  # from a table as long as the sequence up to the segment's end
        local = x_BxLxHxE.shape[1]
        end = split.offset + split.size * local
        return attention.rope(x_BxLxHxE, end - local, base, scaling, positions)
    return _rope(x_BxLxHxE, split, base, scaling)


def _angles(split: Split, width: int, base, scaling, dtype):
    """(cos, sin) [1, L/C, 1, E/2] at this device's positions: a piece's start angle
    (float64 NumPy, per device) added to the angles within a piece, exact to float
    rounding without a table as long as the sequence."""
    f = attention.accumulation(dtype)
    cos_in, sin_in = rope_tables(np.arange(split.piece), width, base, scaling, f)  # scaled
    starts = _piece_starts(split)
    inv = inverse_frequencies(width, base, scaling)
    at = jnp.asarray(np.cos(starts[..., None] * inv).astype(f))[index(split.size)]  # [2, E/2]
    st = jnp.asarray(np.sin(starts[..., None] * inv).astype(f))[index(split.size)]
    cos = at[:, None] * cos_in[None] - st[:, None] * sin_in[None]  # [2, h, E/2]
    sin = st[:, None] * cos_in[None] + at[:, None] * sin_in[None]
    shape = (1, 2 * split.piece, 1, width // 2)
    return cos.reshape(shape), sin.reshape(shape)


def _piece_starts(split: Split) -> np.ndarray:
    """[C, 2] where each device's two pieces start in the sequence."""
    return np.array([split.starts(c) for c in range(split.size)], np.float64)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _rope(x, split, base, scaling):
    cos, sin = _angles(split, x.shape[-1], base, scaling, x.dtype)
    return attention.rotate(x, cos, sin)


def _rope_fwd(x, split, base, scaling):
    return _rope(x, split, base, scaling), None


def _rope_bwd(split, base, scaling, _, d_out):  # the rotation by minus the angles
    cos, sin = _angles(split, d_out.shape[-1], base, scaling, d_out.dtype)
    return (attention.rotate(d_out, cos, -sin),)


_rope.defvjp(_rope_fwd, _rope_bwd)
