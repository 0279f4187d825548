"""The K/V cotangent cache's window updates: what a backward adds and clears, the same
through the words (CPU) and through the whole-buffer view (accelerators), and in place
on a GPU."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from test_gpu_topology import needs_plugin

from seqpipe import kv_cache

REPO = Path(__file__).resolve().parent.parent


def _words(shape, seed):
    x = jax.random.normal(jax.random.key(seed), shape, jnp.bfloat16)
    return x, kv_cache.to_words(x)


def test_a_window_add_is_the_same_through_the_words_and_through_the_view():
    base, words = _words((2, 3, 4, 16, 2, 8), 0)
    delta, _ = _words((1, 1, 4, 6, 2, 8), 1)
    at = (jnp.int32(1), jnp.int32(2), 0, 5, 0, 0)
    expected = np.asarray(base).copy()
    expected[1:2, 2:3, :, 5:11] = np.asarray(base[1:2, 2:3, :, 5:11] + delta)
    for update in (kv_cache.update_through_words, kv_cache.update_through_view):
        out = jax.jit(lambda w, d, *a, f=update: f(w, d, *a, combine=jnp.add, dtype=jnp.bfloat16))(
            words, delta, *at
        )
        got = kv_cache.from_words(out, jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(got), expected)  # bit for bit
    out = kv_cache.add_window(words, at, delta.astype(jnp.float32), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(kv_cache.from_words(out, jnp.bfloat16)), expected)


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


@needs_plugin
def test_on_a_gpu_the_cotangent_add_reads_no_window_copy():
    """Compiled for an H200, a layer loop adding into a [1, 24, 4, 1536, 16, 128]
    cotangent cache updates it in place: no separate window slice, no temporaries. Read
    through the words' bitcast (the CPU's way), XLA copies each window first (48 MiB)."""
    script = textwrap.dedent(
        """
        import json, re
        from seqpipe import gpu_topology
        target = gpu_topology.parse("h200"); target.prepare_env()
        import jax, jax.numpy as jnp, numpy as np
        from seqpipe import kv_cache
        on = jax.sharding.SingleDeviceSharding(target.devices()[0])
        sds = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=on)
        n, b, L, H, E = 24, 4, 1536, 16, 128
        def step(wk, wv, d):
            def body(i, c):
                co = kv_cache.Cotangents(*c, jnp.int32(0), L, np.dtype(jnp.bfloat16), 0)
                co = co.add_layer(n - 1 - i, d[i], d[i])
                return co.words_k, co.words_v
            return jax.lax.fori_loop(0, n, body, (wk, wv))
        cache = sds((1, n, b, L, H, E), jnp.uint16)
        lowered = jax.jit(step, donate_argnums=(0, 1)).trace(
            cache, cache, sds((n, b, L, H, E), jnp.bfloat16)
        ).lower(lowering_platforms=("cuda",))
        compiled = lowered.compile()
        text = compiled.as_text()
        print(json.dumps({
            "slices": len(re.findall(r"calls=%fused_dynamic_slice", text)),
            "temp": compiled.memory_analysis().temp_size_in_bytes,
        }))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found == {"slices": 0, "temp": found["temp"]} and found["temp"] < 2**20, found
