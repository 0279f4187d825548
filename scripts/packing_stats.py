"""What best_fit packing costs: padding and rows on real short documents, and the time to
place a million documents. Prints one line per measurement (docs/long-context.md cites them).

    python scripts/packing_stats.py
"""

import json
import os
import sysconfig
import tempfile
import time

import ml_collections
import numpy as np

from seqpipe.data import documents, loader, packing


def paragraphs_corpus(directory: str) -> str:
    """A JSON lines file of the email package's paragraphs: real, mostly short documents."""
    email = os.path.join(sysconfig.get_paths()["stdlib"], "email", "**", "*.py")
    texts = [open(f, encoding="utf-8").read() for f in documents._text_files(email)]
    path = os.path.join(directory, "paragraphs.jsonl")
    with open(path, "w") as f:
        f.write(
            "\n".join(json.dumps({"text": p}) for t in texts for p in t.split("\n\n") if p.strip())
        )
    return path


def real_documents(directory: str) -> None:
    path = paragraphs_corpus(directory)
    for seq_len in (128, 1024):
        config = ml_collections.ConfigDict(
            dict(
                model=dict(vocab_size=2048),
                train=dict(seq_len=seq_len, global_batch_size=8, seed=0),
                data=dict(
                    source="jsonl",
                    path=path,
                    tokenizer="bpe",
                    token_dtype="uint16",
                    eval_fraction=0.02,
                    cache_dir=os.path.join(directory, "cache"),
                    text_key="text",
                ),
            )
        )
        train, _, _ = loader.read_corpus(config)
        starts, size = np.asarray(train.starts), train.tokens.size
        layout = packing.best_fit(starts, size, seq_len + 1)
        padding = 1 - size / (layout.num_rows * (seq_len + 1))
        print(
            f"email paragraphs, seq_len {seq_len}: {len(starts)} documents (median "
            f"{np.median(np.diff([*starts, size])):.0f} tokens), {size} tokens: best_fit "
            f"{layout.num_rows} rows, padding {padding:.3%}; concat {(size - 1) // seq_len} rows"
        )


def a_million_documents() -> None:
    lengths = np.random.default_rng(0).lognormal(np.log(600), 1.2, 1_000_000)
    lengths = np.maximum(1, lengths.astype(np.int64))
    starts, size = packing.document_starts(lengths), int(lengths.sum())
    for seq_len in (4096, 32768):
        start = time.perf_counter()
        layout = packing.best_fit(starts, size, seq_len + 1)
        seconds = time.perf_counter() - start
        padding = 1 - size / (layout.num_rows * (seq_len + 1))
        print(
            f"1e6 lognormal documents (median 600 tokens), seq_len {seq_len}: best_fit in "
            f"{seconds:.1f} s, {layout.num_rows} rows, padding {padding:.3%}"
        )


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        real_documents(d)
    a_million_documents()
