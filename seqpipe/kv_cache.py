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

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


def storage_dtype(dtype) -> np.dtype:
    """What a cache of activations in `dtype` is stored as: uint16 words for 16-bit floats."""
    dtype = np.dtype(dtype)
    return np.dtype(np.uint16) if dtype.itemsize == 2 else dtype


def to_words(x: jax.Array) -> jax.Array:
    word = storage_dtype(x.dtype)
    return x if word == x.dtype else jax.lax.bitcast_convert_type(x, word)


def from_words(w: jax.Array, dtype) -> jax.Array:
    return w if w.dtype == np.dtype(dtype) else jax.lax.bitcast_convert_type(w, dtype)


@struct.dataclass
class Prefix:
    """Layer `layer`'s prefix in slot `slot` of the caches `words_k`, `words_v`
    ([slots, n, b, Lkv, H, E] storage words). It carries no gradient: the executor
    differentiates zero sinks in its place (`blockwise.cached_attention`)."""

    words_k: jax.Array
    words_v: jax.Array
    slot: jax.Array
    layer: jax.Array

    def at_layer(self, layer) -> "Prefix":
        return self.replace(layer=layer)

    def block(self, which: int, start, size: int, dtype) -> jax.Array:
        """Positions [start, start + size) of K (which 0) or V (1): [b, size, H, E]."""
        words = (self.words_k, self.words_v)[which]
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
