"""The K/V cache's storage and the prefix view that attention reads in place.

Storage: the executor keeps K/V (and their cotangents) of a 16-bit float dtype as raw
uint16 words, bitcast at every window read and write. A bitcast is free on every backend;
it matters on CPU, where XLA's float normalization runs each bf16 dynamic-slice and
dynamic-update-slice in float32, converting the WHOLE buffer (measured: a window add into
a bf16 [24, 1, 28672, 16, 128] cache took a 2.6 GiB copy, into the same cache as uint16
none), so a cache could never be updated in place there.

`Prefix` names where a segment's prefix lies: the cache buffers (all slots), the slot and
the layer. `blockwise.cached_attention` slices its key blocks from it directly, so the
prefix is never copied, per unit or per layer, nor kept for the backward.
"""

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental.layout import Layout, with_layout_constraint

# Which of the executor's carried buffers are pinned row-major (`row_major`), by the
# platform compiled for: "all", "whole_tiles" or "none". Measured compile-only on 2 CPU cores:
# - GPU, all: else XLA transposed the whole stash between the tick's loops and a layer scan
#   (0.66 TB moved a step, gpt_1b seq1f1b K=4 on an H200; 2026-12-05).
# - TPU, whole_tiles: the TPU tiles an array's two minor dimensions (`_whole_tiles`). A
#   buffer whose row-major minor dimensions fill whole tiles is pinned, else each loop
#   re-lays it and XLA copies whole K/V caches between them (gpt_1b on v5p-16, seq1f1b 8
#   stages M=8 K=4: 9.64 GiB a chip pinned, 11.09 free). One whose minor dimensions would be
#   padded (7 local K/V heads of 96 under tensor 8) is left to the compiler, which lays it
#   heads-major (gpt_30b at 65536 on v5p-128, seq1f1b K=4 M=16, remat none: 82.41 GiB
#   pinned, 53.76 left free or by this rule). 2026-12-07.
# - CPU, none: its layouts are row-major anyway.
PIN_ROW_MAJOR = {"gpu": "all", "cuda": "all", "rocm": "all", "tpu": "whole_tiles", "cpu": "none"}
# A TPU tile: 8 rows of 32-bit words (16 of 16-bit, 32 of 8-bit) by 128 lanes.
TPU_TILE_BYTES, TPU_LANES = 8 * 4, 128
# The platform a trace is for (`layouts_for`). A trace-time setting, as XLA's layouts are,
# rather than a flag threaded through every buffer view; unset (a unit compiled alone,
# outside the executor), buffers are pinned.
_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar("platform", default=None)


@contextlib.contextmanager
def layouts_for(platform: str):
    """Lay the executor's buffers out as suits `platform` in what is traced within."""
    token = _PLATFORM.set(platform)
    try:
        yield
    finally:
        _PLATFORM.reset(token)


def pins_row_major(x: jax.Array) -> bool:
    """Whether `row_major` pins `x`'s layout in the trace under way."""
    policy = PIN_ROW_MAJOR.get(_PLATFORM.get(), "all")
    if x.ndim < 2 or policy == "none":
        return False
    return policy == "all" or _whole_tiles(x)


def _whole_tiles(x: jax.Array) -> bool:
    """Whether `x`'s two minor dimensions, row-major, fill whole TPU tiles."""
    rows = TPU_TILE_BYTES // np.dtype(x.dtype).itemsize
    return x.shape[-2] % rows == 0 and x.shape[-1] % TPU_LANES == 0


def storage_dtype(dtype) -> np.dtype:
    """What a cache of activations in `dtype` is stored as: uint16 words for 16-bit floats."""
    dtype = np.dtype(dtype)
    return np.dtype(np.uint16) if dtype.itemsize == 2 else dtype


def to_words(x: jax.Array) -> jax.Array:
    word = storage_dtype(x.dtype)
    return x if word == x.dtype else jax.lax.bitcast_convert_type(x, word)


def from_words(w: jax.Array, dtype) -> jax.Array:
    return w if w.dtype == np.dtype(dtype) else jax.lax.bitcast_convert_type(w, dtype)


def slot_zero() -> jax.Array:
    """Slot 0 of a one-slot buffer (a unit run alone), as a value known only at run time,
    as the executor's slots are: a vjp keeps a constant index differently than a traced
    one, and a unit's residual layout must not depend on which it was traced with."""
    return jax.lax.optimization_barrier(jnp.int32(0))


def row_major(tree):
    """Each array of two or more dimensions laid out row-major (XLA's default). The
    executor's buffers are held so wherever a loop carries or reads them: a loop left to
    itself lays a buffer out as its own use prefers, and XLA transposes the whole buffer
    between loops that differ (a unit's loop and its layer scan, two units' loops). Only
    where that helps the platform compiled for (`PIN_ROW_MAJOR`)."""
    pin = lambda x: with_layout_constraint(x, Layout(tuple(range(x.ndim))))  # noqa: E731
    return jax.tree.map(lambda x: pin(x) if pins_row_major(x) else x, tree)


@struct.dataclass
class Prefix:
    """Layer `layer`'s prefix in slot `slot` of the caches `words_k`, `words_v`
    ([slots, n, b, Lkv, H, E] storage words). It carries no gradient: the executor
    differentiates zero sinks in its place (`blockwise.cached_attention`)."""

    words_k: jax.Array
    words_v: jax.Array
    slot: jax.Array
    layer: jax.Array

    @classmethod
    def holding(cls, k_prefix: jax.Array, v_prefix: jax.Array) -> "Prefix":
        """A cache of one slot holding the prefix arrays ([n, b, P, H, E]), at layer 0 (a
        unit run alone, outside the executor)."""
        words_k, words_v = (to_words(x)[None] for x in (k_prefix, v_prefix))
        return cls(words_k, words_v, slot_zero(), slot_zero())

    def at_layer(self, layer) -> "Prefix":
        return self.replace(layer=layer)

    def block(self, which: int, start, size: int, dtype) -> jax.Array:
        """Positions [start, start + size) of K (which 0) or V (1): [b, size, H, E]."""
        words = row_major((self.words_k, self.words_v)[which])
        _, _, b, _, h, e = words.shape
        at = (self.slot, self.layer, 0, start, 0, 0)
        window = jax.lax.dynamic_slice(words, at, (1, 1, b, size, h, e))
        return from_words(window.reshape(b, size, h, e), dtype)

    def no_gradient(self) -> "Prefix":
        """The zero cotangent of a Prefix (float0 for integer leaves)."""

        def zero(x):
            if jnp.issubdtype(x.dtype, jnp.inexact):
                return jnp.zeros_like(x)
            return np.zeros(x.shape, jax.dtypes.float0)

        return jax.tree.map(zero, self)


@struct.dataclass
class Cotangents:
    """The prefix K/V cotangents of one micro-batch (slot `slot` of the cotangent caches
    `words_k`, `words_v`, [slots, n, b, Lkv, H, E] storage words), which a segment's
    backward adds to: its prefix [0, prefix_len) waits for the earlier segments' backwards;
    its own window and any later one are spent, so they are cleared for the slot's next
    micro-batch. Each add touches only its window of the caches."""

    words_k: jax.Array
    words_v: jax.Array
    slot: jax.Array
    prefix_len: int = struct.field(pytree_node=False)
    dtype: np.dtype = struct.field(pytree_node=False)

    def add_layer(self, layer, dk: jax.Array, dv: jax.Array) -> "Cotangents":
        """Adds one layer's prefix cotangents ([b, >= prefix_len, H, E])."""
        return self._add((self.slot, layer), dk, dv)

    def add_chunk(self, dk: jax.Array, dv: jax.Array) -> "Cotangents":
        """Adds every layer's prefix cotangents ([n, b, >= prefix_len, H, E])."""
        return self._add((self.slot,), dk, dv)

    def _add(self, lead: tuple, dk, dv) -> "Cotangents":
        def update(words, d):
            words = row_major(words)
            shape = words.shape[len(words.shape) - d.ndim :]
            at = lead + (0,) * d.ndim
            d = jnp.pad(d[..., : self.prefix_len, :, :], _pad_positions(shape, self.prefix_len))
            old = from_words(jax.lax.dynamic_slice(words, at, (1,) * len(lead) + shape), self.dtype)
            before = (jnp.arange(shape[-3]) < self.prefix_len)[:, None, None]
            new = jnp.where(before, old + d.astype(self.dtype), 0)
            return jax.lax.dynamic_update_slice(words, to_words(new), at)

        return self.replace(words_k=update(self.words_k, dk), words_v=update(self.words_v, dv))


def _pad_positions(shape: tuple, length: int) -> list:
    """jnp.pad widths taking [..., length, H, E] to `shape` along the positions."""
    return [(0, 0)] * (len(shape) - 3) + [(0, shape[-3] - length), (0, 0), (0, 0)]
