"""Tokenizers: raw bytes (256 symbols) and a byte-level BPE trained with HF `tokenizers`.

Both expose the same small surface: `encode`, `encode_batch`, `decode`, `vocab_size`,
`num_ids` (one past the largest id: what the model's embedding must hold), `eot_id` (the
id appended after each document, or None; `seqpipe.data` sets a HF model's eos_token_id
where the tokenizer has no <|endoftext|>) and `to_json` (a stable description, hashed to
key the token cache).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"


class Tokenizer(Protocol):
    vocab_size: int
    num_ids: int
    eot_id: int | None

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def to_json(self) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids. No room for an end-of-text id: documents are just concatenated."""

    vocab_size = num_ids = 256
    eot_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        # A window may cut a multi-byte character in half.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def to_json(self) -> str:
        return '{"type": "byte"}'


class BpeTokenizer:
    """A byte-level BPE (GPT-2 style pre-tokenization), so every string round-trips."""

    def __init__(self, hf: HFTokenizer):
        self.hf = hf
        self.vocab_size = hf.get_vocab_size()
        # Ids need not be dense (a vocabulary with gaps): the largest, not the count, is
        # what must fit the model. Added tokens and the end-of-document id are among them.
        self.num_ids = max(hf.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.eot_id = hf.token_to_id(EOT)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # The fast path skips offsets, which we never use; it runs on all cores.
        return [e.ids for e in self.hf.encode_batch_fast(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> str:
        return self.hf.to_str()

    @classmethod
    def from_file(cls, path: str) -> BpeTokenizer:
        return cls(HFTokenizer.from_file(path))


def train_bpe(texts: Sequence[str], vocab_size: int) -> BpeTokenizer:
    """Trains a byte-level BPE with `vocab_size` symbols (256 bytes + EOT + merges)."""
    hf = HFTokenizer(models.BPE())
    # No prefix space, so decode(encode(s)) == s exactly.
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        # Seed all 256 bytes so any input is encodable, even bytes unseen in training.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer)
    return BpeTokenizer(hf)


def fingerprint(tokenizer: Tokenizer) -> str:
    """A short hash of the content and the end-of-document id: token caches made with
    another tokenizer, or that ended documents otherwise, never match."""
    blob = f"{tokenizer.to_json()}\n{tokenizer.eot_id}"
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
