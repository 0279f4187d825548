"""The Pallas kernels (`pallas_gpu`, `splash`) on packed documents, against a dense masked
reference: query i sees key j iff j <= P + i and both carry the same document id. The
output and all five cotangents, segment by segment, with documents crossing the segment
boundary, one-token documents, a row that is one document, padding (id 2**30) and a
segment that starts a document; the key blocks the mask removes are skipped, not masked
(keys there hold NaN and nothing turns NaN)."""

import functools
import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import REPO, needs_libtpu, needs_plugin, run_python
from kernel_helpers import verify_triton_lowerings

from seqpipe.kernels import kv_cache, pallas_gpu, splash
from seqpipe.targets import compat

# Both kernels in interpret mode, float32, against the reference: measured within 4.7e-7
# (pallas_gpu) and 6.0e-7 (splash) of it, relative to 1 + |reference|.
KERNEL_TOL = 1e-6
NAMES = ("out", "dq", "dk_prefix", "dv_prefix", "dk_own", "dv_own")
PADDING = 2**30  # the model's id for padding: one last document that sees only itself
TINY_TILES = pallas_gpu.Blocks(forward=(4, 2), dkv=(4, 2), dq=(2, 4))


def packed(*rows) -> np.ndarray:
    """Document ids [b, L] of rows given as document lengths (a length of `-n`: n padding
    tokens), documents numbered 1, 2, ... along each row."""
    out = []
    for lengths in rows:
        ids = [PADDING if n < 0 else doc for doc, n in enumerate(lengths, 1) for _ in range(abs(n))]
        out.append(ids)
    return np.asarray(out, np.int32)


# Twelve positions cut into segments of 5 and 7 (prefix 0, then 5), four rows:
ROWS = packed(
    (3, 1, 4, 1, 3),  # one-token documents; the third crosses the segment boundary
    (12,),  # one document
    (2, 6, -4),  # padding in the second segment
    (5, 7),  # the second segment starts a document: it reads no prefix
)


def reference(q, kp, vp, ks, vs, documents):
    """Dense attention over the prefix and the segment with the document mask (the same
    mask `xla` gets from packcore; this test switches to it on merge)."""
    q_ids, kv_ids = documents
    b, q_len, heads, width = q.shape
    k, v = jnp.concatenate([kp, ks], 1), jnp.concatenate([vp, vs], 1)
    prefix, kv_heads = kp.shape[1], k.shape[2]
    qg = q.reshape(b, q_len, kv_heads, heads // kv_heads, width)
    scores = jnp.einsum("bqhge,bkhe->bhgqk", qg, k, precision="highest") * width**-0.5
    causal = np.arange(prefix + q_len)[None, :] <= prefix + np.arange(q_len)[:, None]
    mask = causal & (q_ids[:, :, None] == kv_ids[:, None, :])
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bhgqk,bkhe->bqhge", probs, v, precision="highest")
    return out.reshape(q.shape)


def sequence(rows, h=3, e=8, kv=None, seed=0):
    """q, k, v and an output cotangent of whole rows, [b, L, H, E] each."""
    b, length = rows.shape
    keys = jax.random.split(jax.random.key(seed), 4)
    heads = (h, kv or h, kv or h, h)
    return [jax.random.normal(key, (b, length, n, e)) for key, n in zip(keys, heads, strict=True)]


def out_and_grads(fn, args, g, documents):
    out, vjp = jax.vjp(lambda *a: fn(*a, documents=documents), *args)
    return (out, *vjp(g))


def check_segments(fn, lengths, rows=ROWS, tol=KERNEL_TOL, first=0, **shape):
    """fn against the reference on each segment of `rows` cut into `lengths`."""
    q, k, v, g = sequence(rows, **shape)
    ids = jnp.asarray(rows)
    offset = sum(lengths[:first])
    for length in lengths[first:]:
        own, seen = slice(offset, offset + length), slice(0, offset + length)
        args = (q[:, own], k[:, :offset], v[:, :offset], k[:, own], v[:, own])
        documents = (ids[:, own], ids[:, seen])
        want = jax.jit(out_and_grads, static_argnums=0)(reference, args, g[:, own], documents)
        got = jax.jit(out_and_grads, static_argnums=0)(fn, args, g[:, own], documents)
        for name, x, y in zip(NAMES, got, want, strict=True):
            np.testing.assert_allclose(
                x, y, rtol=tol, atol=tol, err_msg=f"{name}, segments {lengths} at {offset}"
            )
        offset += length


def test_the_reference_is_causal_attention_when_every_row_is_one_document():
    """The oracle's mask with one document per row is the plain causal mask."""
    from seqpipe.kernels.attention import segment_attention

    rows = packed((12,), (12,))
    q, k, v, _ = sequence(rows)
    ids = jnp.asarray(rows)
    args = (q[:, 5:], k[:, :5], v[:, :5], k[:, 5:], v[:, 5:])
    np.testing.assert_allclose(
        reference(*args, (ids[:, 5:], ids)), segment_attention(*args), rtol=1e-6, atol=1e-6
    )


tiny_pallas_gpu = functools.partial(
    pallas_gpu.pallas_gpu_attention, blocks=TINY_TILES, interpret=True
)


def in_cache(kp, vp):
    """kp, vp in slot 1, layer 2 of caches whose other positions hold 7s."""
    b, length, h, e = kp.shape
    base = jnp.full((2, 3, b, length + 5, h, e), 7.0, kp.dtype)
    words = [
        kv_cache.to_words(base.at[1, 2, :, :length].set(jax.lax.stop_gradient(x))) for x in (kp, vp)
    ]
    return kv_cache.Prefix(*words, jnp.int32(1), jnp.int32(2))


def cached_pallas_gpu(q, kp, vp, ks, vs, documents):
    """`pallas_gpu.cached_attention` reading the prefix from a cache; kp, vp are the
    sinks, so their cotangents are the prefix's."""
    fn = pallas_gpu.cached_attention
    return fn(q, in_cache(kp, vp), kp, vp, ks, vs, kp.shape[1], TINY_TILES, True, documents)


def test_pallas_gpu_with_documents_matches_the_masked_reference():
    check_segments(tiny_pallas_gpu, (5, 7))


def test_pallas_gpu_reading_the_kv_cache_with_documents():
    check_segments(cached_pallas_gpu, (5, 7), first=1)


@pytest.mark.parametrize("kv", [1, 2])
def test_grouped_pallas_gpu_with_documents(kv):
    check_segments(tiny_pallas_gpu, (5, 7), h=4, kv=kv)
    check_segments(cached_pallas_gpu, (5, 7), first=1, h=4, kv=kv)


def test_pallas_gpu_with_default_tiles_and_documents():
    """Default tiles fitted to the segment (32 queries, 64 keys: a 40-key prefix and a
    20-query segment), documents of 7 crossing every boundary, one padded row."""
    rows = packed((7,) * 8 + (4,), (30, 23, -7))
    fn = functools.partial(pallas_gpu.pallas_gpu_attention, interpret=True)
    check_segments(fn, (40, 20), rows=rows, first=1, h=2, e=16)


def poisoned(x, keys: slice):
    return x.at[:, keys].set(jnp.nan)


def test_pallas_gpu_never_reads_key_blocks_before_a_segments_documents():
    """Keys 0..7 hold NaN: a kernel that read them (even to mask them) would spread it
    (a masked probability 0 times NaN is NaN). Segment [8, 16): row 0 starts a document
    at 8 (no prefix block is read), row 1's first document starts at 4 (the blocks of keys
    0..3 are skipped). Output and cotangents match the reference on clean keys, and the
    skipped keys' dK, dV are exactly zero."""
    rows = packed((8, 8), (4, 12), (4, 3, 9))
    q, k, v, g = sequence(rows)
    ids = jnp.asarray(rows)
    skipped = jnp.asarray([8, 4, 4])  # keys before each row's first visible one
    dirty = jnp.arange(16)[None, :, None, None] < skipped[:, None, None, None]
    k_nan, v_nan = (jnp.where(dirty, jnp.nan, x) for x in (k, v))
    documents = (ids[:, 8:], ids)
    own = slice(8, 16)
    clean = (q[:, own], k[:, :8], v[:, :8], k[:, own], v[:, own])
    want = out_and_grads(reference, clean, g[:, own], documents)
    for fn in (tiny_pallas_gpu, cached_pallas_gpu):
        args = (q[:, own], k_nan[:, :8], v_nan[:, :8], k[:, own], v[:, own])
        got = jax.jit(out_and_grads, static_argnums=0)(fn, args, g[:, own], documents)
        for name, x, y in zip(NAMES, got, want, strict=True):
            np.testing.assert_allclose(x, y, rtol=KERNEL_TOL, atol=KERNEL_TOL, err_msg=name)
        assert not np.asarray(got[2])[0].any() and not np.asarray(got[2])[1, :4].any()


def test_pallas_gpu_dkv_never_reads_query_blocks_of_later_documents():
    """The output cotangent of rows 4..7 of segment [8, 16) (document 2, from key 10) is
    NaN: the dK, dV of document 1's keys (the prefix, own keys 0 and 1) skip that query
    block, so they stay finite and equal the reference's; so does dq of rows 0..3."""
    rows = packed((10, 6))
    q, k, v, g = sequence(rows)
    ids = jnp.asarray(rows)
    own = slice(8, 16)
    args = (q[:, own], k[:, :8], v[:, :8], k[:, own], v[:, own])
    documents = (ids[:, own], ids)
    want = out_and_grads(reference, args, g[:, own], documents)
    g_nan = g[:, own].at[:, 4:].set(jnp.nan)
    got = jax.jit(out_and_grads, static_argnums=0)(tiny_pallas_gpu, args, g_nan, documents)
    for name, x, y in (
        ("dq", got[1][:, :4], want[1][:, :4]),
        ("dk_prefix", got[2], want[2]),
        ("dv_prefix", got[3], want[3]),
        ("dk_own", got[4][:, :2], want[4][:, :2]),
        ("dv_own", got[5][:, :2], want[5][:, :2]),
    ):
        np.testing.assert_allclose(x, y, rtol=KERNEL_TOL, atol=KERNEL_TOL, err_msg=name)


def test_document_bounds_are_runs_of_equal_ids():
    """Each query row's document start (an absolute key) and each key's document end (a
    query row): the rows that see key j are [j - P, ends[j])."""
    ids = jnp.asarray(packed((3, 1, 4, 1, 3), (2, 6, -4)))
    starts, ends = pallas_gpu.document_bounds((ids[:, 5:], ids), 5, 7)
    np.testing.assert_array_equal(starts, [[4, 4, 4, 8, 9, 9, 9], [2, 2, 2, 8, 8, 8, 8]])
    np.testing.assert_array_equal(
        ends, [[0, 0, 0, 0, 3, 3, 3, 3, 4, 7, 7, 7], [0, 0, 3, 3, 3, 3, 3, 3, 7, 7, 7, 7]]
    )
    with pytest.raises(ValueError, match=r"expected \(2, 7\) and \(2, 12\): the prefix, then"):
        pallas_gpu.document_bounds((ids[:, 5:], ids[:, 5:]), 5, 7)


splash_kernel = functools.partial(splash.splash_attention, interpret=True)


def test_splash_with_documents_matches_the_masked_reference():
    """Splash's SegmentIds (q ids [Q], kv ids [P + Q]) and-ed with CausalMask(offset=P), in
    interpret mode: segments of 130 and 6 (queries padded to 256 and 128, keys 136 to 256),
    documents crossing the boundary, one-token ones, padding, a row of one document. No
    row is fully masked (each sees its own key), so nothing is NaN."""
    rows = packed((60, 1, 1, 70, 4), (136,), (129, 1, 2, 2, 1, 1), (100, 30, -6))
    check_segments(splash_kernel, (130, 6), rows=rows, h=2)


def test_grouped_splash_with_documents():
    rows = packed((60, 1, 1, 70, 4), (100, 30, -6))
    check_segments(splash_kernel, (130, 6), rows=rows, first=1, h=4, kv=2)


def test_pallas_gpu_with_documents_lowers_to_verified_triton_modules(monkeypatch):
    """Compiled for an H100 (not interpreted), bf16 at gpt_1b's head width, GQA (8 query
    heads on 2 K/V heads): the four kernels with their document bounds (dynamic loop
    bounds, scalar loads), the prefix as arrays and in the K/V cache, lower to Triton
    modules that pass MLIR's verifier."""
    verified = verify_triton_lowerings(monkeypatch)
    shape = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bfloat16)
    q, kv, prefix = shape((2, 100, 8, 128)), shape((2, 100, 2, 128)), shape((2, 300, 2, 128))
    q_ids, kv_ids = (jax.ShapeDtypeStruct((2, n), jnp.int32) for n in (100, 400))

    def arrays(q, kp, vp, ks, vs, g, q_ids, kv_ids):
        fn = functools.partial(pallas_gpu.pallas_gpu_attention, documents=(q_ids, kv_ids))
        out, vjp = jax.vjp(fn, q, kp, vp, ks, vs)
        return (out, *vjp(g))

    words = jax.ShapeDtypeStruct((2, 3, 2, 400, 2, 128), jnp.uint16)
    index = jax.ShapeDtypeStruct((), jnp.int32)

    def cached(words_k, words_v, slot, layer, q, ks, vs, g, q_ids, kv_ids):
        cache = kv_cache.Prefix(words_k, words_v, slot, layer)
        sink = jnp.zeros((2, 350, 2, 128), jnp.bfloat16)

        def fn(q, sk, sv, ks, vs):
            call = pallas_gpu.cached_attention
            return call(q, cache, sk, sv, ks, vs, 300, documents=(q_ids, kv_ids))

        out, vjp = jax.vjp(fn, q, sink, sink, ks, vs)
        return (out, *vjp(g))

    with compat.gpu_target("NVIDIA H100 80GB HBM3"):
        for fn, args in (
            (arrays, (q, prefix, prefix, kv, kv, q, q_ids, kv_ids)),
            (cached, (words, words, index, index, q, kv, kv, q, q_ids, kv_ids)),
        ):
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("__gpu$xla.gpu.triton") == 4
    assert verified == [True] * 8


# Compiled for real chips from this CPU machine (compile-only devices: JAX's CUDA plugin
# for an H100, libtpu for a TPU v5p), in a fresh process: each platform's setup must
# precede jax's import. bf16, E = 128, GQA (8 query heads on 2 K/V heads), a 3072-key
# prefix and 1024 queries, the vjp (forward and backward kernels).
COMPILE = """
import functools, json, re, sys
from seqpipe.targets import gpu_topology, topology
target = sys.argv[1]
if target == "h100":
    system = gpu_topology.parse("h100")
    system.prepare_env()
    devices = system.devices()
else:
    system = topology.parse("v5p-8")
    topology.prepare_env(system)
    devices = topology.devices(system)
import jax, jax.numpy as jnp
from seqpipe.kernels import pallas_gpu, splash
on = jax.sharding.SingleDeviceSharding(devices[0])
def shape(dims, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(dims, dtype, sharding=on)
q, kv, prefix = shape((2, 1024, 8, 128)), shape((2, 1024, 2, 128)), shape((2, 3072, 2, 128))
ids = shape((2, 1024), jnp.int32), shape((2, 4096), jnp.int32)
kernel = pallas_gpu.pallas_gpu_attention if target == "h100" else splash.splash_attention
def out_and_grads(q, kp, vp, ks, vs, g, q_ids, kv_ids):
    out, vjp = jax.vjp(functools.partial(kernel, documents=(q_ids, kv_ids)), q, kp, vp, ks, vs)
    return (out, *vjp(g))
# jax 0.12 asks the mesh in context which GPU a Triton kernel is for (train.py's shard_map
# gives it one); 0.10.2 ignores it.
mesh = jax.sharding.Mesh(devices[:1], ("one",))
with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    lowered = jax.jit(out_and_grads).lower(q, prefix, prefix, kv, kv, q, *ids)
text = lowered.compile().as_text()
print(json.dumps(sorted(set(re.findall(r"splash_mha_\\w+", text)))))
"""


def _compile(target: str, env_extra=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(env_extra or {})
    return run_python("-c", COMPILE, target, env=env)


@needs_plugin
def test_pallas_gpu_with_documents_compiles_to_ptx_for_an_h100(tmp_path):
    """What interpret mode cannot show: Triton lowers the kernels with their document
    bounds for sm_90, and the PTX holds the forward, dK/dV (prefix and own) and dq."""
    dump = tmp_path / "dump"
    # jax 0.12's XLA dumps the PTX only of the emitters named (0.10.2 takes the flag too).
    flags = f"--xla_dump_to={dump} --xla_dump_emitter_re=ptx"
    proc = _compile("h100", {"XLA_FLAGS": flags})
    assert proc.returncode == 0, proc.stderr
    entries = [
        line.split()[2].split("(")[0]
        for ptx in dump.glob("*.ptx")
        for line in ptx.read_text().splitlines()
        if line.startswith(".visible .entry segment_attention")
    ]
    assert sorted(entries) == [
        "segment_attention_dkv",
        "segment_attention_dkv__1",
        "segment_attention_dq",
        "segment_attention_forward",
    ]


@needs_libtpu
def test_splash_with_documents_compiles_for_a_tpu():
    """libtpu compiles splash's segmented kernels (SegmentIds of different q and kv
    lengths) for a TPU v5p chip: the forward, dq and dK/dV."""
    proc = _compile("v5p")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [
        "splash_mha_dkv_segmented_no_residuals",
        "splash_mha_dq_segmented_no_residuals",
        "splash_mha_fwd_segmented_residuals",
    ]


@pytest.mark.parametrize("q_len, prefix_len", [(7, 0), (9, 13), (12, 12), (16, 8)])
def test_pallas_gpu_flops_with_documents_count_the_blocks_it_visits(q_len, prefix_len):
    """executed_flops with documents against the (query block, key block) pairs where some
    row sees some key: real rows see [start, P + row]; past-the-end rows, which the kernel
    computes, see from the last real row's start up to their diagonal. The skipped pairs
    are those wholly before a block's first document start."""
    bq, bk = 4, 2
    blocks = pallas_gpu.Blocks(forward=(bq, bk))
    rng = np.random.default_rng(q_len + prefix_len)
    ids = np.sort(rng.integers(0, 5, prefix_len + q_len)).astype(np.int32)
    starts, _ = pallas_gpu.document_bounds(
        (jnp.asarray(ids[None, prefix_len:]), jnp.asarray(ids[None])), prefix_len, q_len
    )
    starts = np.asarray(starts[0])
    pairs = set()
    for row in range(-(-q_len // bq) * bq):
        lo = starts[min(row, q_len - 1)]
        for key in range(lo, min(prefix_len + row, prefix_len + q_len - 1) + 1):
            own = key >= prefix_len
            pairs.add((row // bq, own, (key - prefix_len if own else key) // bk))
    got = pallas_gpu.executed_flops(q_len, prefix_len, 6, blocks, starts=starts)
    assert got == 4 * len(pairs) * bq * bk * 6
    assert got <= pallas_gpu.executed_flops(q_len, prefix_len, 6, blocks)


def _script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_flops_scripts_splash_blocks_are_the_ones_splash_keeps():
    """scripts/document_kernel_flops.py counts splash's blocks itself (gpt_1b's sizes are
    too large for splash's mask processing in a test); on small segments its counts equal
    the non-empty blocks of splash's own mask info: a mask built from the row's ids
    (a dynamic mask) and a static LocalMask window."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info

    flops_script = _script("document_kernel_flops")
    seq, doc_len = 1536, 300
    starts = flops_script.document_starts(seq, doc_len, 100)
    for q_len, prefix in ((512, 0), (384, 640), (512, 1024)):
        row_starts = starts[prefix : prefix + q_len]
        kept, size, grid = flops_script.splash_blocks(q_len, prefix, row_starts, None)
        kv = prefix + q_len
        keys, rows = np.arange(kv)[None, :], np.arange(q_len)[:, None]
        mask = (keys <= prefix + rows) & (keys >= row_starts[:, None])
        bq = min(splash.BLOCK, -(-q_len // 128) * 128)
        bkv = min(splash.BLOCK, -(-kv // 128) * 128)
        padded = np.zeros((1, -(-q_len // bq) * bq, -(-kv // bkv) * bkv), bool)
        padded[0, :q_len, :kv] = mask
        info, _ = splash_attention_mask_info.process_dynamic_mask(jnp.asarray(padded), (bq, bkv))
        assert kept == int((np.asarray(info.block_mask) > 0).sum()) and size == bq * bkv
        assert grid == padded.size

        kept, _, _ = flops_script.splash_blocks(q_len, prefix, row_starts, doc_len)
        window = sa.LocalMask(padded.shape[1:], (doc_len - 1, 0), offset=prefix)
        info, _ = splash_attention_mask_info.process_mask(sa.MultiHeadMask([window]), (bq, bkv))
        assert kept == int((np.asarray(info.block_mask) > 0).sum())


def test_splash_kernels_cached_in_one_trace_serve_the_next():
    """splash caches a kernel per shape; its mask info is made concrete, so a second jit of
    the same shapes (an eval step after a train step) does not find the first trace's
    tracers (it raised UnexpectedTracerError before)."""
    q, prefix = jnp.ones((1, 6, 2, 8)), jnp.ones((1, 131, 2, 8))
    once = jax.jit(splash_kernel)(q, prefix, prefix, q, q)
    twice = jax.jit(lambda *a: 2 * splash_kernel(*a))(q, prefix, prefix, q, q)
    np.testing.assert_array_equal(2 * once, twice)


def test_pallas_gpu_with_documents_in_bfloat16():
    """bf16 inputs, as training runs: within bf16's rounding of the reference, and the
    kernels reading the prefix from uint16 cache words compute exactly what they compute on
    the prefix arrays (forward and all five cotangents)."""
    q, k, v, g = (x.astype(jnp.bfloat16) for x in sequence(ROWS))
    ids = jnp.asarray(ROWS)
    own = slice(5, 12)
    args = (q[:, own], k[:, :5], v[:, :5], k[:, own], v[:, own])
    documents = (ids[:, own], ids)
    run = jax.jit(out_and_grads, static_argnums=0)
    got = run(tiny_pallas_gpu, args, g[:, own], documents)
    f32 = [x.astype(jnp.float32) for x in (*args, g[:, own])]
    want = out_and_grads(reference, f32[:5], f32[5], documents)
    cached = run(cached_pallas_gpu, args, g[:, own], documents)
    for name, x, y, z in zip(NAMES, got, want, cached, strict=True):
        assert x.dtype == jnp.bfloat16, name
        x, y, z = (np.asarray(a, np.float32) for a in (x, y, z))
        assert np.abs(x - y).max() <= 2e-2 * np.abs(y).max(), name
        np.testing.assert_array_equal(z, x, err_msg=name)
