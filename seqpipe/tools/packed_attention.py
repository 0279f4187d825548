"""What packed documents save in attention: executed FLOPs of a step, and a CPU timing.

    python -m seqpipe.tools.packed_attention --config configs/gpt_1b.py \\
        --config.train.seq_len=32768 --config.train.global_batch_size=2 \\
        --config.pipeline.schedule=seq1f1b --config.pipeline.segments=8 \\
        --config.mesh.stage=8 --config.pipeline.microbatches=2 --document 4096 [--time]

FLOPs: the forward QK and PV matmul FLOPs `blockwise` executes for every segment of every
row and layer (`blockwise.executed_flops`: the key blocks its loops visit), on rows of
`--document`-token documents against the same rows unpacked; with them the exact causal
count (the lower triangle) and the exact block-diagonal one. The backward visits the same
blocks (five block matmuls to the forward's two), so the ratios hold for the whole step.

`--time`: one layer's attention (`blockwise`, float32, forward and backward of every
segment against its prefix) on this CPU, with and without documents, timed in one run on
a row of `--time_len` tokens cut into the same number of segments, documents of
`--time_len / (seq_len / document)` tokens (the same share of the row), 2 heads.
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from seqpipe.kernels import blockwise
from seqpipe.models import document_mask
from seqpipe.pipeline import executor
from seqpipe.run import config as config_lib


def _segments(lengths):
    offsets = np.cumsum((0,) + tuple(lengths[:-1]))
    return list(zip(offsets.tolist(), lengths, strict=True))


def _row_ids(seq_len: int, document: int) -> np.ndarray:
    """Kernel ids [1, seq_len] of a row of `document`-token documents (the last shorter)."""
    lengths = [document] * (seq_len // document) + (
        [seq_len % document] if seq_len % document else []
    )
    docs, _ = document_mask.pack_rows([lengths], seq_len)
    return np.asarray(document_mask.kernel_ids(jnp.asarray(docs)))


def step_flops(lengths, width: int, layers: int, rows: int, document: int) -> dict:
    """Forward attention matmul FLOPs of a step: executed unpacked and packed, exact."""
    seq_len = sum(lengths)
    ids = _row_ids(seq_len, document)
    out = dict.fromkeys(("unpacked", "packed", "causal", "block_diagonal"), 0)
    for offset, length in _segments(lengths):
        out["unpacked"] += blockwise.executed_flops(length, offset, width)
        seg_ids = (ids[:, offset : offset + length], ids[:, : offset + length])
        out["packed"] += blockwise.executed_flops(length, offset, width, documents=seg_ids)
    rows_q = np.arange(seq_len)
    starts = np.searchsorted(ids[0], ids[0], side="left")
    out["causal"] = 2 * 2 * int(np.sum(rows_q + 1)) * width
    out["block_diagonal"] = 2 * 2 * int(np.sum(rows_q - starts + 1)) * width
    return {k: v * layers * rows for k, v in out.items()}


def time_attention(lengths, document: int, heads: int = 2, head_dim: int = 128) -> dict:
    """Seconds of one layer's attention forward and backward over all segments, with and
    without documents, measured in this process (each compiled first, then timed 3 times:
    the best)."""
    seq_len = sum(lengths)
    ids = jnp.asarray(_row_ids(seq_len, document))
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, g = (jax.random.normal(key, (1, seq_len, heads, head_dim)) for key in keys)

    def layer(q, k, v, g, packed: bool):
        total = 0.0
        for offset, length in _segments(lengths):
            own = slice(offset, offset + length)
            docs = (ids[:, own], ids[:, : offset + length]) if packed else None
            args = (q[:, own], k[:, :offset], v[:, :offset], k[:, own], v[:, own])
            fn = lambda *a, docs=docs: blockwise.blockwise_attention(*a, documents=docs)  # noqa: E731
            out, vjp = jax.vjp(fn, *args)
            total = total + jnp.sum(out) + sum(jnp.sum(x) for x in vjp(g[:, own]))
        return total

    out = {}
    for packed in (False, True):
        fn = jax.jit(lambda q, k, v, g, packed=packed: layer(q, k, v, g, packed))
        fn(q, k, v, g).block_until_ready()
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            fn(q, k, v, g).block_until_ready()
            best = min(best, time.perf_counter() - start)
        out["packed" if packed else "unpacked"] = best
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--document", type=int, required=True, help="tokens per document")
    parser.add_argument("--time", action="store_true", help="also time one layer on this CPU")
    parser.add_argument("--time_len", type=int, default=8192)
    args, rest = parser.parse_known_args(argv)
    try:
        config = config_lib.load(args.config, config_lib.parse_overrides(rest))
    except config_lib.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.document < 1 or args.document > config.train.seq_len:
        print(f"error: --document={args.document} must be in [1, train.seq_len]", file=sys.stderr)
        return 2

    spec = executor.make_spec(config)
    cfg = spec.cfg
    width, t = cfg.num_heads * cfg.head_dim, config.train
    # The sequence's segments, whole: what the step computes over all its context devices.
    lengths = spec.sequence_lengths
    flops = step_flops(lengths, width, cfg.num_layers, t.global_batch_size, args.document)
    print(f"segments {list(lengths)}, {args.document}-token documents")
    for name, value in flops.items():
        print(f"  {name:15s} {value:.4e} forward attention FLOPs a step")
    print(f"  packed / unpacked executed: {flops['packed'] / flops['unpacked']:.4f}")
    print(f"  packed / causal:            {flops['packed'] / flops['causal']:.4f}")
    print(f"  block-diagonal / causal:    {flops['block_diagonal'] / flops['causal']:.4f}")
    if args.time:
        share = args.time_len * args.document // t.seq_len
        lengths = [args.time_len // spec.segments] * spec.segments
        seconds = time_attention(lengths, share)
        print(
            f"one layer, {args.time_len} tokens in {spec.segments} segments, {share}-token "
            f"documents, 2 heads of 128, float32, on this CPU: unpacked "
            f"{seconds['unpacked']:.3f} s, packed {seconds['packed']:.3f} s, ratio "
            f"{seconds['packed'] / seconds['unpacked']:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
