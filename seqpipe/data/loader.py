"""Real data: a corpus's documents, its tokenizer, and the grain input pipeline.

Sources (`config.data.source`): stdlib, text, jsonl and parquet hold documents as text
(`seqpipe.data.documents`); tokens is `config.data.path`, a flat binary of token ids
(`config.data.token_dtype`), memory-mapped, never copied, whose documents end with
`config.data.eod_id` (-1: one stream, no boundaries).

Tokenization. Each document is encoded with the tokenizer's own special tokens (a HF
tokenizer's post-processor adds its beginning-of-sequence token) and ended with its
end-of-document id `Tokenizer.eot_id` (<|endoftext|>, which the BPE trained here carries;
for a HF model without it, as Llama 3, its config's eos_token_id), unless the
post-processor ended it already. The byte tokenizer has no room for one: its documents
only join.

Caching. Text is tokenized once. The trained BPE and the flat token array (followed, in
the same file, by its documents' starts) live in a cache dir (`config.data.cache_dir`,
else `$SEQPIPE_CACHE`, else `~/.cache/seqpipe`) under names keyed by a fingerprint of the
corpus (file paths, sizes, mtimes; source and text key for jsonl and parquet), the vocab
size and the tokenizer's own content and end-of-document id, so a stale entry can never
be picked up. A copy of the tokenizer is written to `WORKDIR/tokenizer.json` so a run
keeps what it was trained with.

Splits. The last `config.data.eval_fraction` of the token stream (at least one window)
is held out for evaluation; training never sees it.

Batches. Rows of `seq_len + 1` tokens, packed by `config.data.packing`: none (windows of
the stream, stride `seq_len`: {"tokens"}), concat (the same windows, with "documents" and
"positions") or best_fit (whole documents placed best-fit, padded), `seqpipe.data.packing`.
Rows are shuffled with `config.train.seed` (reshuffled each epoch, repeated forever) and
grouped into global batches of `global_batch_size` rows; neither depends on the number of
processes, so an iterator's state restores under any. Each process reads only the rows
its devices hold under `sharding.batch_sharding(mesh)` (`local_rows`): one contiguous
range, the same for processes that share a `data` index (all rows on a 1 x N mesh whose
stages span hosts), and `to_global` assembles the global batch from those parts.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import grain
import jax
import numpy as np

from seqpipe.data import documents, packing
from seqpipe.data import tokenizer as tok
from seqpipe.data.tokenizer import Tokenizer
from seqpipe.errors import DataError
from seqpipe.host import checkpoint_dir
from seqpipe.host.files import atomic_write, atomic_write_bytes
from seqpipe.parallel import sharding

# BPE training sees at most this much text (whole documents, in corpus order): a few
# tens of MB already give stable merges, and more only costs time.
BPE_TRAIN_MAX_CHARS = 64 * 2**20


class Stream(NamedTuple):
    """A token stream and the ascending offsets where its documents start (the first 0)."""

    tokens: np.ndarray
    starts: np.ndarray


def _fingerprint(files: list[str], *extra: Any) -> str:
    """Hash of the file list and stats: cheap, and changes whenever a file does."""
    stats = [(f, s.st_size, s.st_mtime_ns) for f in files for s in [os.stat(f)]]
    blob = json.dumps([stats, list(extra)], default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _cache_dir(config) -> str:
    d = (
        config.data.get("cache_dir")
        or os.environ.get("SEQPIPE_CACHE")
        or os.path.join(os.path.expanduser("~"), ".cache", "seqpipe")
    )
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:  # a file in the way, no permission, a read-only mount
        raise DataError(
            f"data.cache_dir {d} cannot be made ({e.strerror}); set data.cache_dir (or "
            "$SEQPIPE_CACHE) to a writable directory"
        ) from None
    return d


def _check_writable(directory: str) -> None:
    """Before building a cache entry (minutes, for a BPE), not after."""
    if not os.access(directory, os.W_OK | os.X_OK):
        raise DataError(
            f"data.cache_dir {directory} is not writable and has no entry for this corpus; "
            "make it writable or set data.cache_dir (or $SEQPIPE_CACHE) to a writable directory"
        )


def _write_entry(path: str, write) -> None:
    """A cache entry, whole or not at all (`files.atomic_write`); a failure is one line."""
    try:
        atomic_write(path, write)
    except OSError as e:
        raise DataError(
            f"writing the cache entry {path} failed ({e.strerror or e}); free space in "
            f"{os.path.dirname(path)} or set data.cache_dir (or $SEQPIPE_CACHE) to another "
            "directory"
        ) from None


def _damaged(path: str, e: Exception) -> None:
    """A cache entry that does not load (cut short by a crash before entries were written
    atomically, or damaged on disk) is removed, so it is rebuilt, not fatal forever."""
    reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
    print(f"the cache entry {path} is damaged ({reason}); rebuilding it", file=sys.stderr)
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as e2:
        raise DataError(
            f"the cache entry {path} is damaged and cannot be removed ({e2.strerror}); "
            "remove it or set data.cache_dir to another directory"
        ) from None


# ---------------------------------------------------------------- tokenizer


def load_tokenizer(config) -> Tokenizer:
    """The configured tokenizer; a BPE is trained on the corpus on first use, then cached."""
    kind = config.data.tokenizer
    vocab = config.model.vocab_size
    if kind == "byte":
        t: Tokenizer = tok.ByteTokenizer()
    elif kind == "bpe":
        t = _load_bpe(config)
    elif kind.startswith("hf:") or kind.endswith(".json"):
        t = _load_named(kind)
    else:
        raise DataError(f"data.tokenizer={kind!r} is unknown; use 'bpe' or 'byte'")
    # Before any token is cached: XLA's gather of an id past the embedding is undefined.
    if t.num_ids > vocab:
        path = config.data.get("tokenizer_path")
        setting = (
            f"data.tokenizer_path={path}" if kind == "bpe" and path else f"data.tokenizer={kind}"
        )
        raise DataError(
            f"{setting} has ids up to {t.num_ids - 1} but model.vocab_size={vocab}; set "
            f"model.vocab_size >= {t.num_ids}, or use a tokenizer whose ids are below {vocab} "
            "(the model's own)"
        )
    return t


def _load_named(kind: str) -> tok.BpeTokenizer:
    """data.tokenizer=hf:DIR (DIR/tokenizer.json) or a path to a tokenizer.json. Without
    <|endoftext|> (Llama 3, Mistral) documents end with the model's eos_token_id
    (DIR/config.json)."""
    path = os.path.join(kind[3:], "tokenizer.json") if kind.startswith("hf:") else kind
    t = _bpe_file(path, f"data.tokenizer={kind}: {path}")
    if t.eot_id is None and kind.startswith("hf:"):
        t.eot_id = _model_eos(kind[3:], t.num_ids)
    return t


def _model_eos(directory: str, num_ids: int) -> int | None:
    """The eos_token_id of DIR/config.json (the first, if a list) if it is one of the
    tokenizer's `num_ids`, else None."""
    try:
        with open(os.path.join(directory, "config.json")) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return None  # train.init_from's checks say what is wrong with a config.json
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if isinstance(eos, int) and not isinstance(eos, bool) and 0 <= eos < num_ids:
        return eos
    return None


def _bpe_file(path: str, setting: str, fix: str = "") -> tok.BpeTokenizer:
    """The BPE in the tokenizer.json at `path`; a DataError naming `setting` (and saying
    `fix`) if it is missing or unreadable."""
    if not os.path.isfile(path):
        raise DataError(f"{setting} does not exist; give a tokenizer.json")
    try:
        return tok.BpeTokenizer.from_file(path)
    except Exception as e:  # HF raises a bare Exception for a file it cannot parse
        raise DataError(f"{setting} is not a tokenizers JSON file ({e}){fix}") from None


def save_tokenizer(t: Tokenizer, workdir: str) -> None:
    """A copy of the BPE in the workdir, so a run keeps what it was trained with; left as it
    is when it already holds this BPE (a resumed run writes nothing it need not)."""
    if not (workdir and isinstance(t, tok.BpeTokenizer)):
        return
    path = os.path.join(workdir, "tokenizer.json")
    try:
        with open(path) as f:
            if json.loads(f.read()) == json.loads(t.to_json()):
                return
    except (OSError, ValueError):
        pass  # absent or unreadable: write it
    os.makedirs(workdir, exist_ok=True)
    atomic_write_bytes(path, t.hf.to_str(pretty=True).encode())


def check_resume_tokenizer(t: Tokenizer, workdir: str, config) -> None:
    """Refuse a tokenizer other than the one a workdir's checkpoints were trained with
    (its `tokenizer.json`; none there: no BPE): the same ids would mean
    other text, and the run would go on without a sign of it."""
    if not workdir or not checkpoint_dir.complete_steps(checkpoint_dir.directory(workdir)):
        return
    saved = os.path.join(workdir, "tokenizer.json")
    if os.path.exists(saved):
        with open(saved) as f:
            same = isinstance(t, tok.BpeTokenizer) and json.loads(f.read()) == json.loads(
                t.to_json()
            )
        trained_with = f"the BPE in {saved}"
        how = f" (data.tokenizer=bpe data.tokenizer_path={saved})"
    else:
        same = isinstance(t, tok.ByteTokenizer)
        trained_with, how = "no BPE (the byte tokenizer, or a token file without one)", ""
    if not same:
        raise DataError(
            f"the checkpoints in {checkpoint_dir.directory(workdir)} were trained with "
            f"{trained_with}, not the configured data.tokenizer={config.data.tokenizer} "
            f"(data.source={config.data.source}); resume with that tokenizer{how} or use a "
            "new --workdir"
        )


def _load_bpe(config) -> tok.BpeTokenizer:
    path = config.data.get("tokenizer_path")
    if path:
        fix = "; give the tokenizer.json the data was made with"
        return _bpe_file(path, f"data.tokenizer_path={path!r}", fix)
    if config.data.source == "tokens":
        raise DataError(
            "data.source=tokens has no text to train a BPE on; "
            "set data.tokenizer_path to its tokenizer.json or use data.tokenizer=byte"
        )
    vocab = config.model.vocab_size
    if vocab < 257:
        raise DataError(f"a byte-level BPE needs model.vocab_size >= 257 (got {vocab})")
    files = documents.corpus_files(config)
    key = _fingerprint(files, "bpe", vocab, BPE_TRAIN_MAX_CHARS, *_source_key(config))
    cache = _cache_dir(config)
    path = os.path.join(cache, f"bpe-{vocab}-{key}.json")
    if os.path.exists(path):
        try:
            return tok.BpeTokenizer.from_file(path)
        except Exception as e:  # HF raises a bare Exception for a file it cannot parse
            _damaged(path, e)
    _check_writable(cache)
    docs, total = [], 0
    for d in documents.read(files, config):
        if total >= BPE_TRAIN_MAX_CHARS:
            break
        docs.append(d)
        total += len(d)
    t = tok.train_bpe(docs, vocab)
    _write_entry(path, lambda f: f.write(t.hf.to_str(pretty=True).encode()))
    return t


# ---------------------------------------------------------------- tokens


def _token_dtype(config) -> np.dtype:
    name = config.data.get("token_dtype") or "uint16"
    if name not in ("uint16", "uint32"):
        raise DataError(f"data.token_dtype={name!r} is unsupported; use 'uint16' or 'uint32'")
    return np.dtype(name)


def _source_key(config) -> tuple:
    """What reads documents out of the files, beyond the files: the source and text key for
    jsonl and parquet (stdlib and text: nothing, so their cache entries keep their names)."""
    d = config.data
    return (d.source, d.get("text_key", "text")) if d.source in ("jsonl", "parquet") else ()


def _encode_corpus(config, t: Tokenizer) -> Stream:
    """The corpus's token stream, from the cache or tokenized and cached."""
    files = documents.corpus_files(config)
    key = _fingerprint(files, tok.fingerprint(t), *_source_key(config))
    cache = _cache_dir(config)
    path = os.path.join(cache, f"tokens-{key}.npy")
    if os.path.exists(path):
        try:
            return _load_stream(path)
        except (OSError, ValueError, EOFError) as e:
            _damaged(path, e)
    _check_writable(cache)
    stream, lengths = _tokenize(documents.read(files, config), t)
    starts = packing.document_starts(lengths)
    # One entry, whole or not at all: the tokens' array, then the starts' (np.load of the
    # file reads the tokens alone).
    _write_entry(path, lambda f: (_save_npy(f, stream), _save_npy(f, starts)))
    return _load_stream(path)


def _tokenize(docs: list[str], t: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(stream, each document's token count): each document encoded with the tokenizer's
    special tokens, then its end-of-document id unless it ends with it already."""
    dtype = np.uint16 if t.num_ids <= 2**16 else np.uint32
    if isinstance(t, tok.ByteTokenizer):
        # Bytes are their own ids: skip the Python lists.
        encoded = [d.encode("utf-8") for d in docs]
        stream = np.frombuffer(b"".join(encoded), np.uint8).astype(dtype)
        return stream, np.array([len(e) for e in encoded], np.int64)
    eot = t.eot_id
    ids = [
        x + [eot] if eot is not None and (not x or x[-1] != eot) else x
        for x in t.encode_batch(docs)
    ]
    ids = [x for x in ids if x]
    stream = np.concatenate([np.array(x, dtype) for x in ids])
    return stream, np.array([len(x) for x in ids], np.int64)


def _load_stream(path: str) -> Stream:
    """A token cache entry, the tokens memory-mapped; ValueError if it is not whole."""
    tokens = _load_npy(path)
    with open(path, "rb") as f:
        f.seek(tokens.offset + tokens.nbytes)
        starts = np.lib.format.read_array(f)
    if (
        starts.ndim != 1
        or starts.dtype != np.int64
        or not starts.size
        or starts[0] != 0
        or starts[-1] >= tokens.size
        or np.any(np.diff(starts) <= 0)
    ):
        raise ValueError(f"no document starts of {tokens.size} tokens")
    return Stream(tokens, starts)


def _save_npy(f, array: np.ndarray) -> None:
    """np.save, in chunks through the file object: np.save's own tofile() reports a full
    disk as a short write, without the errno that says so."""
    np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(array))
    for i in range(0, array.size, 2**24):
        f.write(array[i : i + 2**24].tobytes())


def _load_npy(path: str) -> np.ndarray:
    """A token cache entry, memory-mapped; ValueError if it is not a whole 1-D array."""
    tokens = np.load(path, mmap_mode="r")  # a header it cannot read, or data cut short
    if tokens.ndim != 1 or tokens.dtype not in (np.uint16, np.uint32) or tokens.size == 0:
        raise ValueError(f"not a 1-D array of token ids: {tokens.dtype} {tokens.shape}")
    return tokens


def _read_token_file(config) -> Stream:
    """data.source=tokens: the file's ids, memory-mapped, and its documents' starts (after
    each data.eod_id; none set: one document)."""
    path = config.data.path
    if not path or not os.path.isfile(path):
        raise DataError(f"data.path={path!r} is not a file; data.source=tokens needs a flat binary")
    dtype = _token_dtype(config)
    if os.path.getsize(path) % dtype.itemsize:
        raise DataError(
            f"data.path={path!r}: its size is not a multiple of data.token_dtype={dtype} "
            f"({dtype.itemsize} bytes); check data.token_dtype"
        )
    if os.path.getsize(path) == 0:
        raise DataError(f"data.path={path!r} is empty; data.source=tokens needs token ids")
    try:
        tokens = np.memmap(path, dtype=dtype, mode="r")
    except OSError as e:
        raise documents.unreadable(path, e) from None
    # One pass in chunks, so a huge file never sits in memory at once.
    vocab = config.model.vocab_size
    top = max((int(tokens[i : i + 2**24].max()) for i in range(0, tokens.size, 2**24)), default=0)
    if top >= vocab:
        raise DataError(
            f"data.path={path!r} holds token id {top} >= model.vocab_size={vocab}; "
            "check data.token_dtype or raise model.vocab_size"
        )
    return Stream(tokens, _eod_starts(tokens, config.data.get("eod_id", -1), path))


def _eod_starts(tokens: np.ndarray, eod_id: int, path: str) -> np.ndarray:
    """Where documents start in a token file: at 0 and after each `eod_id` (-1: only 0)."""
    if eod_id < 0:
        return np.zeros(1, np.int64)
    chunk = 2**24  # in chunks, as above
    ends = [
        np.flatnonzero(tokens[i : i + chunk] == eod_id) + i for i in range(0, tokens.size, chunk)
    ]
    ends = np.concatenate(ends).astype(np.int64)
    if not ends.size:
        raise DataError(
            f"data.path={path!r} holds no data.eod_id={eod_id}, so no document ends; set "
            "data.eod_id to the id that ends its documents"
        )
    return np.concatenate([[0], ends[ends + 1 < tokens.size] + 1]).astype(np.int64)


def read_corpus(config) -> tuple[Stream, Stream, Tokenizer | None]:
    """(train, eval, tokenizer), writing nothing outside the cache: the eval split is the
    stream's last part; the tokenizer is None for a token file without one (its tokenizer
    is checked only when one is named: it may be any)."""
    t = None
    if config.data.source != "tokens" or config.data.get("tokenizer_path"):
        t = load_tokenizer(config)
    if config.data.source == "tokens":
        stream = _read_token_file(config)
    else:
        stream = _encode_corpus(config, t)
    tokens = stream.tokens
    window = config.train.seq_len + 1
    fraction = config.data.get("eval_fraction", 0.02)
    num_eval = max(math.ceil(fraction * tokens.size), window)
    if tokens.size - num_eval < window:
        raise DataError(
            f"the corpus has {tokens.size} tokens: too few for a train and an eval window of "
            f"{window}; add data or lower train.seq_len"
        )
    split = tokens.size - num_eval
    head, tail = packing.split_starts(np.asarray(stream.starts), split)
    return Stream(tokens[:split], head), Stream(tokens[split:], tail), t


def identity(tokens: np.ndarray, starts: np.ndarray | None = None) -> dict:
    """What a checkpoint's data position counts batches of: the training stream's length
    and a digest of its ids (all of them up to 4 Mi tokens, else 64 evenly spaced pieces
    and the last: cheap on a memory-mapped file of any size), and with `starts` (packed
    rows) of where its documents start. Moving the files changes neither; other data, or
    the same files edited, changes one."""
    piece, n = 2**16, int(tokens.size)
    if n <= 64 * piece:
        parts = [tokens]
    else:
        parts = [tokens[s : s + piece] for s in np.linspace(0, n - piece, 65).astype(np.int64)]
    h = hashlib.sha256()
    for part in parts:  # as uint32: the same ids in uint16 or uint32 are the same data
        h.update(np.ascontiguousarray(part, dtype=np.uint32).tobytes())
    if starts is not None:
        h.update(b"starts" + np.ascontiguousarray(starts, dtype=np.int64).tobytes())
    return {"tokens": n, "digest": h.hexdigest()[:16]}


def keep_tokenizer(t: Tokenizer | None, workdir: str, config) -> None:
    """Refuse a tokenizer other than the workdir's checkpoints were trained with, then keep
    a copy there: call once the data is checked, so a refused run writes nothing."""
    if t is not None and workdir:
        check_resume_tokenizer(t, workdir, config)
        save_tokenizer(t, workdir)


def load_tokens(config, workdir: str) -> tuple[np.ndarray, np.ndarray]:
    """`read_corpus`, then `keep_tokenizer` in workdir (none: ""): (train, eval tokens)."""
    train, held_out, t = read_corpus(config)
    keep_tokenizer(t, workdir, config)
    return train.tokens, held_out.tokens


# ---------------------------------------------------------------- batches


def _num_windows(tokens: np.ndarray, seq_len: int) -> int:
    n = (tokens.size - 1) // seq_len
    if n < 1:
        raise DataError(f"{tokens.size} tokens are too few for one window of {seq_len + 1}")
    return n


def rows_by_process(
    mesh: jax.sharding.Mesh,
    batch_size: int,
    process_of: Callable[[jax.Device], int] = lambda device: device.process_index,
) -> dict[int, slice]:
    """The rows of every global batch each process reads: the union of its devices' rows
    under the batch sharding. `process_of` maps a device to its process; tests pass one
    to simulate hosts.

    Every process computes every process's rows, so a layout the loader cannot serve is
    refused by all of them at once, not by one while the others wait in a collective.
    """
    replicas = mesh.shape[sharding.DATA]
    if batch_size % replicas:
        raise DataError(
            f"train.global_batch_size={batch_size} does not split over mesh.data={replicas}; "
            "make it a multiple"
        )
    indices = sharding.batch_sharding(mesh).devices_indices_map((batch_size,))
    rows: dict[int, set[int]] = {}
    for device, (index,) in indices.items():
        rows.setdefault(process_of(device), set()).update(range(batch_size)[index])
    by_process = {}
    for process, held in sorted(rows.items()):
        runs = _runs(sorted(held))
        if len(runs) > 1:
            where = ", ".join(f"[{a}, {b})" for a, b in runs)
            raise DataError(
                f"process {process} holds rows {where} of each global batch of {batch_size} "
                f"under the {' x '.join(str(n) for n in mesh.shape.values())} mesh: not one "
                "contiguous range, which the data loader cannot read; choose the mesh axes so "
                "each process's devices hold adjacent data indices"
            )
        by_process[process] = slice(*runs[0])
    return by_process


def _runs(ascending: list[int]) -> list[tuple[int, int]]:
    """Maximal ranges [start, stop) of consecutive ints in a sorted list."""
    runs = []
    for i in ascending:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def local_rows(config, mesh: jax.sharding.Mesh) -> slice:
    """The rows of every global batch that this process reads."""
    rows = rows_by_process(mesh, config.train.global_batch_size)
    if jax.process_index() not in rows:
        raise DataError(
            f"process {jax.process_index()} holds no device of the "
            f"{' x '.join(str(n) for n in mesh.shape.values())} mesh; make mesh.data * "
            "mesh.stage * mesh.context * mesh.tensor the global device count"
        )
    return rows[jax.process_index()]


def _gather(tokens: np.ndarray, seq_len: int, window_ids: np.ndarray) -> np.ndarray:
    """int32 [len(window_ids), seq_len + 1]: window w is tokens[w*L : w*L + L + 1]."""
    starts = np.asarray(window_ids, dtype=np.int64)[:, None] * seq_len
    return tokens[starts + np.arange(seq_len + 1)].astype(np.int32)


def _rows(config, stream: Stream | np.ndarray) -> tuple[int, Callable[[np.ndarray], dict]]:
    """(the number of rows, rows(ids) -> a batch dict of those rows) under data.packing; a
    bare token array is one document."""
    if not isinstance(stream, Stream):
        stream = Stream(stream, np.zeros(1, np.int64))
    tokens, starts, seq_len = stream.tokens, np.asarray(stream.starts), config.train.seq_len
    mode, reset = config.data.get("packing", "none"), config.data.get("reset_positions", True)
    if mode == "none":
        return _num_windows(tokens, seq_len), lambda ids: {"tokens": _gather(tokens, seq_len, ids)}
    if mode == "concat":
        windows = _num_windows(tokens, seq_len)
        return windows, lambda ids: packing.window_rows(tokens, starts, seq_len, ids, reset)
    if mode == "best_fit":
        layout = packing.best_fit(starts, tokens.size, seq_len + 1)
        return layout.num_rows, lambda ids: packing.packed_rows(tokens, layout, ids, reset)
    raise DataError(f"data.packing={mode!r} is unknown; use one of {list(packing.PACKINGS)}")


def train_iterator(
    config, stream: Stream | np.ndarray, rows: slice
) -> Iterator[dict[str, np.ndarray]]:
    """An endless grain iterator of batches, `rows` of every global batch (`local_rows`):
    {"tokens": int32 [B_local, L+1]}, and with data.packing "documents" and "positions" of
    the same shape (`seqpipe.data.packing`); has get/set_state."""
    num_rows, rows_of = _rows(config, stream)
    ds = (
        grain.MapDataset.range(num_rows)
        .shuffle(seed=config.train.seed)
        .repeat()  # infinite; each epoch is shuffled with seed + epoch
        .batch(config.train.global_batch_size)  # row ids of one global batch
        .map(lambda ids: rows_of(ids[rows]))
    )
    # One reader thread keeps a couple of batches ahead of the step; order stays fixed.
    options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)
    return iter(ds.to_iter_dataset(options))


def eval_batches(
    config, stream: Stream | np.ndarray, num_batches: int, rows: slice
) -> list[dict[str, np.ndarray]]:
    """`rows` of the first `num_batches` global batches of eval rows, in order (wrapping
    around), as `train_iterator`'s batches."""
    batch = config.train.global_batch_size
    num_rows, rows_of = _rows(config, stream)
    ids = np.arange(batch)[rows]
    return [rows_of((b * batch + ids) % num_rows) for b in range(num_batches)]


def global_batch(local: dict[str, np.ndarray], mesh, batch_size: int):
    """One step's global batch from this process's rows: `to_global` of the tokens alone
    (unpacked rows: the step's program as it always was), or, packed rows, of each of
    "tokens", "documents" and "positions"."""
    if "documents" not in local and "positions" not in local:
        return to_global(local["tokens"], mesh, batch_size)
    return {key: to_global(rows, mesh, batch_size) for key, rows in local.items()}


def to_global(local_batch: np.ndarray, mesh: jax.sharding.Mesh, batch_size: int) -> jax.Array:
    """Assembles the processes' `local_rows` of a batch into one global [batch_size, L+1]
    array, split over 'data'."""
    # Given the global shape, jax checks each process's part against it.
    global_shape = (batch_size, *local_batch.shape[1:])
    return jax.make_array_from_process_local_data(
        sharding.batch_sharding(mesh), local_batch, global_shape
    )
