"""Forward attention FLOPs the Pallas kernels run on packed documents, per row and layer,
against the causal count of the same step unpacked (docs/long-context.md, "Packed
documents: kernels").

    .venv/bin/python scripts/document_kernel_flops.py [SEQ] [SEGMENTS] [DOC_LEN]

Defaults: gpt_1b (d_model 2048) at 32768 with seq1f1b K = 8 equal segments and documents
of 4096 tokens, once with document starts on the segment starts and once shifted by half a
document. Rows:
- causal: the analytic count unpacked (every query times the keys up to it);
- documents: the analytic count with the document mask (every query times its document's
  keys up to it), what an ideal kernel runs;
- pallas_gpu: `pallas_gpu.executed_flops`, without and with documents (its loops skip
  the key blocks before each query block's first document start);
- splash static: `splash.executed_flops`, the blocks its static causal mask keeps, the same
  with documents (SegmentIds only mask inside the blocks it runs);
- splash per-row mask: the 512 x 512 blocks a mask built from each row's ids would keep (a
  dynamic splash mask), and the bytes of that mask (splash materialises it whole);
- splash window: a static LocalMask of DOC_LEN keys (exact only if no document is longer).
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from seqpipe.kernels import (
    pallas_gpu,
    splash,  # noqa: E402
)

WIDTH = 2048  # gpt_1b: 16 heads of 128


def document_starts(seq: int, doc_len: int, shift: int) -> np.ndarray:
    """Each position's document start (absolute) for documents of `doc_len` whose starts
    lie at `shift` + k * doc_len (the first document cut short)."""
    at = np.arange(seq)
    return np.where(at < shift, 0, shift + (at - shift) // doc_len * doc_len)


def analytic(starts: np.ndarray, lengths) -> tuple[int, int]:
    """(causal, document-masked) forward FLOPs of every segment's queries."""
    at = np.arange(sum(lengths))
    return 4 * WIDTH * int((at + 1).sum()), 4 * WIDTH * int((at - starts + 1).sum())


def splash_blocks(q_len: int, prefix: int, row_starts: np.ndarray, window: int | None):
    """splash's padded grid: the blocks with a kept entry of the causal mask, and of the
    causal and document mask (`row_starts`: the segment's rows' starts), or of a static
    window of `window` keys behind each query."""
    bq = min(splash.BLOCK, -(-q_len // 128) * 128)
    bkv = min(splash.BLOCK, -(-(prefix + q_len) // 128) * 128)
    kv_blocks = -(-(prefix + q_len) // bkv)
    kept = 0
    for first in range(0, q_len, bq):
        rows = np.arange(first, min(first + bq, q_len))
        lo = row_starts[rows] if window is None else np.maximum(prefix + rows - window + 1, 0)
        # rows see [lo, P + row]: a block is kept iff some row's range meets it
        for j in range(kv_blocks):
            kept += bool(np.any((lo < (j + 1) * bkv) & (prefix + rows >= j * bkv)))
    return kept, bq * bkv, (-(-q_len // bq) * bq) * kv_blocks * bkv


def table(seq: int, segments: int, doc_len: int, shift: int) -> dict:
    lengths = [seq // segments] * segments
    starts = document_starts(seq, doc_len, shift)
    causal, documents = analytic(starts, lengths)
    gpu = gpu_docs = splash_static = splash_row = splash_window = mask_bytes = 0
    offset = 0
    for q_len in lengths:
        row_starts = starts[offset : offset + q_len]
        gpu += pallas_gpu.executed_flops(q_len, offset, WIDTH)
        gpu_docs += pallas_gpu.executed_flops(q_len, offset, WIDTH, starts=row_starts)
        splash_static += splash.executed_flops(q_len, offset, WIDTH)
        kept, size, grid = splash_blocks(q_len, offset, row_starts, None)
        splash_row += 4 * kept * size * WIDTH
        mask_bytes += grid
        kept, size, _ = splash_blocks(q_len, offset, row_starts, doc_len)
        splash_window += 4 * kept * size * WIDTH
        offset += q_len
    return {
        "causal": causal,
        "documents": documents,
        "pallas_gpu": gpu,
        "pallas_gpu documents": gpu_docs,
        "splash static (with or without documents)": splash_static,
        "splash per-row mask": splash_row,
        "splash window": splash_window,
        "per-row mask bytes": mask_bytes,
    }


def main(argv) -> None:
    seq, segments, doc_len = (int(a) for a in argv) if argv else (32768, 8, 4096)
    for shift in (0, doc_len // 2):
        rows = table(seq, segments, doc_len, shift)
        print(f"seq {seq}, K = {segments}, documents of {doc_len} starting at {shift} (mod)")
        causal = rows["causal"]
        for name, value in rows.items():
            if name.endswith("bytes"):
                print(f"  {name:45s} {value / 2**20:10.0f} MiB per row and layer")
            else:
                print(f"  {name:45s} {value / 1e12:8.3f} TFLOP  {value / causal:6.3f}x causal")


if __name__ == "__main__":
    main(sys.argv[1:])
