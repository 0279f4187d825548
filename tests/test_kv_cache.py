"""The K/V cotangent cache's window updates: what a backward adds, and what it clears."""

import jax
import jax.numpy as jnp
import numpy as np

from seqpipe import kv_cache


def _words(shape, seed):
    x = jax.random.normal(jax.random.key(seed), shape, jnp.bfloat16)
    return x, kv_cache.to_words(x)


def test_a_window_add_adds_there_and_nowhere_else():
    base, words = _words((2, 3, 4, 16, 2, 8), 0)
    delta, _ = _words((1, 1, 4, 6, 2, 8), 1)
    at = (jnp.int32(1), jnp.int32(2), 0, 5, 0, 0)
    expected = np.asarray(base).copy()
    expected[1:2, 2:3, :, 5:11] = np.asarray(base[1:2, 2:3, :, 5:11] + delta)
    add = jax.jit(lambda w, d, *a: kv_cache.add_window(w, a, d, jnp.bfloat16))
    out = kv_cache.from_words(add(words, delta.astype(jnp.float32), *at), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out), expected)  # bit for bit


def test_a_backward_adds_its_prefix_clears_its_own_window_and_leaves_the_rest():
    # [slots, layers, b, Lkv, H, E]; segment with prefix 3 and own length 2 at slot 1,
    # layer 0: positions 0-2 get its cotangents, 3-4 are cleared, 5-7 stay as they were.
    base, words = _words((2, 2, 1, 8, 2, 4), 2)
    d, _ = _words((1, 5, 2, 4), 3)  # a prefix cotangent as long as the sinks (>= 3)
    co = kv_cache.Cotangents(words, words, jnp.int32(1), 3, np.dtype(jnp.bfloat16), 2)
    out = kv_cache.from_words(co.add_layer(jnp.int32(0), d, d).words_k, jnp.bfloat16)
    expected = np.asarray(base).copy()
    expected[1, 0, :, :3] = np.asarray(base[1, 0, :, :3] + d[:, :3])
    expected[1, 0, :, 3:5] = 0
    np.testing.assert_array_equal(np.asarray(out), expected)
    # The last segment: its own window lies past the cache, nothing is cleared.
    last = kv_cache.Cotangents(words, words, jnp.int32(0), 8, np.dtype(jnp.bfloat16), 4)
    d8, _ = _words((1, 8, 2, 4), 4)
    out = kv_cache.from_words(last.add_layer(jnp.int32(1), d8, d8).words_v, jnp.bfloat16)
    expected = np.asarray(base).copy()
    expected[0, 1] = np.asarray(base[0, 1] + d8)
    np.testing.assert_array_equal(np.asarray(out), expected)
