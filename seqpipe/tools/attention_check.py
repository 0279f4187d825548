"""The segment attention kernels on the accelerator: exactness against `xla`, then time.

    python -m seqpipe.tools.attention_check [--json FILE] [--budget_s 50] [--sweep]

1. `pallas_gpu` compiled for the GPU (not interpreted) against `xla` in bfloat16: the
   output and all five cotangents, on a segment whose prefix and length are off every
   block; the error relative to each array's largest entry, bound 2e-2 (bfloat16's
   rounding, as tests/test_attention.py bounds blockwise). Then the same kernels reading
   the prefix from a bf16 K/V cache's uint16 words (`attention.attend_cached`) against
   them on the prefix arrays: the same arithmetic, so bit for bit.
2. Forward + backward time of `xla`, `blockwise` and `pallas_gpu` at gpt_1b's 8192-token
   shapes (one row, 16 heads of 128): the last of four seq1f1b segments (prefix 6144,
   2048 queries) and the whole sequence as one segment (the reference). Median of 5
   calls after a compiling one; TFLOP/s count the causal forward's QK and PV matmuls
   times 3.5 (forward 1 + backward 2.5, the usual FlashAttention count).

Cases past `--budget_s` are skipped (said in the output), so the check stays short.

`--sweep` tunes the kernels' tiles instead: for each tiling in `SWEEP` (query and key
blocks of the forward, dK/dV and dq kernels; Triton's warps and pipeline stages), the
check of 1. against `xla`, then the time of 2., and the fastest tiling that is exact.
A tiling that does not compile (past the GPU's shared memory, say) is reported as such.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from seqpipe.kernels import attention, kv_cache, pallas_gpu

NAMES = ("out", "dq", "dk_prefix", "dv_prefix", "dk_own", "dv_own")
BOUND = 2e-2
HEADS, WIDTH = 16, 128  # gpt_1b
TIMED = ((6144, 2048), (0, 8192))  # (prefix, queries)
EXACT = (2, 1000, 700, 4, WIDTH)  # batch, prefix, queries, heads, width: off every block
# The tilings `--sweep` tries, the default first. Shared memory bounds them: a 128 x 128
# forward tile at E = 128 holds Q, K and V tiles of 32 KiB each per pipeline stage.
SWEEP = (
    pallas_gpu.Blocks(),
    pallas_gpu.Blocks(forward=(128, 128)),
    pallas_gpu.Blocks(forward=(64, 64)),
    pallas_gpu.Blocks(num_stages=3),
    pallas_gpu.Blocks(forward=(128, 128), num_stages=3),
    pallas_gpu.Blocks(dkv=(128, 64), dq=(128, 64)),
    pallas_gpu.Blocks(dkv=(64, 128), dq=(128, 64)),
    pallas_gpu.Blocks(dkv=(128, 128), dq=(128, 128)),
    pallas_gpu.Blocks(num_warps=4),
)


def _inputs(batch, prefix, q_len, heads, width, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 6)
    shapes = [q_len, prefix, prefix, q_len, q_len, q_len]
    return [
        jax.random.normal(key, (batch, n, heads, width), jnp.float32).astype(dtype)
        for key, n in zip(keys, shapes, strict=True)
    ]


def _with_grads(attend):
    """attend(q, K prefix, V prefix, K own, V own), jitted with its five cotangents for
    the output cotangent g: (out, dq, dK prefix, dV prefix, dK own, dV own)."""

    def run(q, kp, vp, ks, vs, g):
        out, vjp = jax.vjp(attend, q, kp, vp, ks, vs)
        return (out, *vjp(g))

    return jax.jit(run)


def _out_and_grads(name):
    return _with_grads(functools.partial(attention.attend, name))


def _tiled(blocks: pallas_gpu.Blocks, interpret: bool):
    """`_out_and_grads` of pallas_gpu with these tiles."""
    kernel = pallas_gpu.pallas_gpu_attention
    return _with_grads(functools.partial(kernel, blocks=blocks, interpret=interpret))


def exactness(got, want) -> dict:
    """Each of the output and five cotangents' error relative to its largest entry."""
    errors = {}
    for name, x, y in zip(NAMES, got, want, strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        errors[name] = float(np.abs(x - y).max() / np.abs(y).max())
    return {"rel_err": errors, "ok": all(e <= BOUND for e in errors.values())}


def _shape_name(batch, prefix, q_len, heads, width) -> str:
    return f"b{batch} P{prefix} Q{q_len} H{heads} E{width} bf16"


def check_exact() -> dict:
    args = _inputs(*EXACT, jnp.bfloat16)
    want = _out_and_grads("xla")(*args)
    got = _out_and_grads("pallas_gpu")(*args)
    return {"shape": _shape_name(*EXACT), **exactness(got, want)}


def check_cached() -> dict:
    """attend_cached against attend, both pallas_gpu: max |difference| of the output and
    the five cotangents (the prefix's as the sinks')."""
    q, kp, vp, ks, vs, g = _inputs(2, 1000, 700, 4, WIDTH, jnp.bfloat16)
    base = jnp.zeros((2, 3, 2, 1024, 4, WIDTH), jnp.bfloat16)
    words = [kv_cache.to_words(base.at[1, 2, :, :1000].set(x)) for x in (kp, vp)]
    cache = kv_cache.Prefix(*words, jnp.int32(1), jnp.int32(2))

    def cached(q, sink_k, sink_v, ks, vs, g):
        def fn(*a):
            return attention.attend_cached("pallas_gpu", a[0], cache, a[1], a[2], 1000, *a[3:])

        out, vjp = jax.vjp(fn, q, sink_k, sink_v, ks, vs)
        return (out, *vjp(g))

    want = _out_and_grads("pallas_gpu")(q, kp, vp, ks, vs, g)
    got = jax.jit(cached)(q, jnp.zeros_like(kp), jnp.zeros_like(vp), ks, vs, g)
    diffs = {
        name: float(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32)).max())
        for name, x, y in zip(NAMES, got, want, strict=True)
    }
    return {"max_abs_diff": diffs, "ok": not any(diffs.values())}


def timed(fn, prefix: int, q_len: int, heads: int, width: int, reps: int) -> dict:
    """fn's (forward + backward's) compile and median time on one row of the shape."""
    args = _inputs(1, prefix, q_len, heads, width, jnp.bfloat16)
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    step = statistics.median(times)
    forward = 4 * heads * width * (q_len * prefix + q_len * (q_len + 1) / 2)
    return {
        "prefix": prefix,
        "q": q_len,
        "compile_s": round(compile_s, 1),
        "ms": round(step * 1e3, 2),
        "tflops": round(3.5 * forward / step / 1e12, 1),
    }


def time_case(name: str, prefix: int, q_len: int, reps: int = 5) -> dict:
    return {"impl": name, **timed(_out_and_grads(name), prefix, q_len, HEADS, WIDTH, reps)}


def sweep(
    candidates=SWEEP,
    budget_s: float = 100.0,
    exact=EXACT,
    cases=TIMED,
    heads: int = HEADS,
    interpret: bool = False,
    reps: int = 5,
    log=print,
) -> dict:
    """Each tiling's exactness against xla on `exact` (batch, prefix, queries, heads,
    width), then its time at each (prefix, queries) of `cases` (`heads` heads of that
    width); and the fastest exact tiling. Tilings past `budget_s` are skipped."""
    began, rows = time.perf_counter(), []
    args = _inputs(*exact, jnp.bfloat16)
    want = _out_and_grads("xla")(*args)
    for blocks in candidates:
        row = {"blocks": dataclasses.asdict(blocks)}
        rows.append(row)
        if time.perf_counter() - began > budget_s:
            row["skipped"] = f"past {budget_s:.0f} s"
            continue
        try:
            fn = _tiled(blocks, interpret)
            row.update(exactness(fn(*args), want))
            if row["ok"]:
                row["timed"] = [timed(fn, p, q, heads, exact[-1], reps) for p, q in cases]
                row["ms"] = round(sum(t["ms"] for t in row["timed"]), 2)
        except Exception as e:  # out of shared memory, say: a result, not a crash
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        log(json.dumps(row))
    fastest = min((r for r in rows if "ms" in r), key=lambda r: r["ms"], default=None)
    return {"shape": _shape_name(*exact), "rows": rows, "fastest": fastest}


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--budget_s", type=float, default=50.0)
    parser.add_argument("--sweep", action="store_true", help="time the tilings in SWEEP")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    flags = arguments(argv)
    print(f"devices: {jax.devices()}", flush=True)
    if flags.sweep:
        results = sweep(budget_s=flags.budget_s, log=lambda m: print(m, flush=True))
        print(f"fastest exact tiling: {results['fastest']}")
        if flags.json:
            with open(flags.json, "w") as f:
                json.dump(results, f, indent=1)
        return 0 if results["fastest"] else 1
    began = time.perf_counter()
    results = {"exact": None, "cached": None, "timed": [], "skipped": [], "errors": []}
    for key, check in (("exact", check_exact), ("cached", check_cached)):
        try:
            results[key] = check()
            print(f"pallas_gpu {key}: {results[key]}", flush=True)
        except Exception as e:  # a kernel that does not compile is a result to report
            results["errors"].append(f"{key}: {type(e).__name__}: {e}"[:2000])
            print(results["errors"][-1], flush=True)
    for prefix, q_len in TIMED:
        for name in ("pallas_gpu", "blockwise", "xla"):
            if time.perf_counter() - began > flags.budget_s:
                results["skipped"].append(f"{name} P{prefix} Q{q_len}")
                continue
            try:
                row = time_case(name, prefix, q_len)
                results["timed"].append(row)
                print(json.dumps(row), flush=True)
            except Exception as e:
                results["errors"].append(
                    f"{name} P{prefix} Q{q_len}: {type(e).__name__}: {e}"[:2000]
                )
                print(results["errors"][-1], flush=True)
    if results["skipped"]:
        print(f"skipped (past {flags.budget_s:.0f} s): {results['skipped']}")
    if flags.json:
        with open(flags.json, "w") as f:
            json.dump(results, f, indent=1)
    checks = (results["exact"], results["cached"])
    ok = all(c is not None and c["ok"] for c in checks) and not results["errors"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
