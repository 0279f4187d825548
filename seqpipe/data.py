"""Real data: a text corpus, its tokenizer, and the grain input pipeline.

Sources (`config.data.source`):
  stdlib  the running interpreter's standard-library `.py` files (no test packages):
          real text present on every machine.
  text    `config.data.path`: a file, a directory (recursive) or a glob of text files.
  tokens  `config.data.path`: a flat binary of token ids (`config.data.token_dtype`),
          memory-mapped, never copied.

Caching. Text is tokenized once. The trained BPE and the flat token array live in a
cache dir (`config.data.cache_dir`, else `$SEQPIPE_CACHE`, else `~/.cache/seqpipe`) under
names keyed by a fingerprint of the corpus (file paths, sizes, mtimes), the vocab size
and the tokenizer's own content, so a stale entry can never be picked up. A copy of the
tokenizer is written to `WORKDIR/tokenizer.json` so a run keeps what it was trained with.

Splits. The last `config.data.eval_fraction` of the token stream (at least one window)
is held out for evaluation; training never sees it.

Batches. Windows of `seq_len + 1` tokens, stride `seq_len`, are shuffled with
`config.train.seed` (reshuffled each epoch, repeated forever) and grouped into global
batches of `global_batch_size` windows; neither depends on the number of processes, so
an iterator's state restores under any. Each process reads only the rows its devices
hold under `sharding.batch_sharding(mesh)` (`local_rows`): one contiguous range, the
same for processes that share a `data` index (all rows on a 1 x N mesh whose stages
span hosts), and `to_global` assembles the global batch from those parts.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import json
import math
import os
import stat
import sys
import sysconfig
from collections.abc import Callable, Iterator
from typing import Any

import grain
import jax
import numpy as np

from seqpipe import sharding
from seqpipe import tokenizer as tok
from seqpipe.files import atomic_write, atomic_write_bytes
from seqpipe.tokenizer import Tokenizer

# BPE training sees at most this much text (whole documents, in corpus order): a few
# tens of MB already give stable merges, and more only costs time.
BPE_TRAIN_MAX_CHARS = 64 * 2**20
# Package dirs under the stdlib that hold tests or third-party code, not library text.
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


# Lines said once per process, however often the corpus is listed.
_SAID: set[str] = set()


class DataError(ValueError):
    """Bad data or data config; the message says what is wrong and how to fix it."""


# ---------------------------------------------------------------- corpus files


def _stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in _STDLIB_SKIP]
        files += [os.path.join(d, n) for n in names if n.endswith(".py")]
    return sorted(files)


def _unreadable(path: str, e: OSError) -> DataError:
    return DataError(f"cannot read {path} ({e.strerror}); fix data.path or its permissions")


def _read_bytes(path: str, size: int = -1) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError as e:
        raise _unreadable(path, e) from None


def _is_text(path: str) -> bool:
    return b"\0" not in _read_bytes(path, 8192)


def _text_files(path: str) -> list[str]:
    if not path:
        raise DataError("data.source=text needs data.path: a file, a directory or a glob")
    if os.path.exists(path) and not os.path.isdir(path):
        if not stat.S_ISREG(os.stat(path).st_mode):  # a pipe would block the read forever
            raise DataError(
                f"data.path={path!r} is {_kind(path)}, not a regular file; point data.path "
                "at text files"
            )
        if not _is_text(path):  # what the directory walk skips, named alone
            raise DataError(
                f"data.path={path!r} is a binary file, not text; for token ids use "
                "data.source=tokens, else point data.path at text"
            )
        return [path]
    if os.path.isdir(path):
        found = _walk(path, lambda parts: True, follow_links=False)
    elif "**" in path:
        found = _recursive_glob(path)
    else:
        found = glob.glob(path)  # no recursion: no link can loop
    files = _regular_files(path, found)
    if os.path.isdir(path):
        files = [f for f in files if _is_text(f)]
    if not files:
        raise DataError(
            f"data.path={path!r} matches no text files; point it at a file, dir or glob"
        )
    return files


def _walk(root: str, keep: Callable[[list[str]], bool], follow_links: bool) -> list[str]:
    """Paths under root (hidden names left out) whose parts below root `keep` accepts.
    Each real directory is walked once: a link back to one already walked (a loop, or a
    second way in) is not followed again."""
    seen, found = set(), []
    for d, dirs, names in os.walk(root, followlinks=follow_links):
        st = os.stat(d)
        if (st.st_dev, st.st_ino) in seen:
            dirs[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        rel = os.path.relpath(d, root).split(os.sep) if d != root else []
        found += [
            os.path.join(d, n) for n in sorted(names) if not n.startswith(".") and keep([*rel, n])
        ]
    return found


def _recursive_glob(pattern: str) -> list[str]:
    """glob.glob(pattern, recursive=True) without following a directory link twice (a
    link in DIR to DIR made glob read DIR's files 41 times)."""
    parts = pattern.split(os.sep)
    fixed = next(i for i, p in enumerate(parts) if glob.has_magic(p))
    root = os.sep.join(parts[:fixed]) or (os.sep if pattern.startswith(os.sep) else ".")
    if not os.path.isdir(root):
        return []
    found = _walk(root, lambda names: _glob_match(parts[fixed:], names), follow_links=True)
    return [os.path.relpath(f) for f in found] if root == "." else found


def _glob_match(pattern: list[str], names: list[str]) -> bool:
    """Whether path parts `names` match glob parts `pattern` ("**": any number of parts)."""
    if not pattern:
        return not names
    if pattern[0] == "**":
        return any(_glob_match(pattern[1:], names[i:]) for i in range(len(names) + 1))
    return (
        bool(names)
        and fnmatch.fnmatchcase(names[0], pattern[0])
        and _glob_match(pattern[1:], names[1:])
    )


def _kind(path: str) -> str:
    """What a path that is not a regular file is, in words."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "a dangling link"
    kinds = [
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _regular_files(path: str, found: list[str]) -> list[str]:
    """The regular files among `found`, each real file once (the first spelling, sorted);
    anything else (pipes, devices, sockets: a read could block forever) is never opened,
    and skipped with one line on stderr; directories are left out silently."""
    files, real_seen, skipped = [], set(), []
    for f in sorted(found):
        try:
            st = os.stat(f)
        except OSError:
            skipped.append(f)
            continue
        if stat.S_ISDIR(st.st_mode):
            continue
        if not stat.S_ISREG(st.st_mode):
            skipped.append(f)
        elif (st.st_dev, st.st_ino) not in real_seen:
            real_seen.add((st.st_dev, st.st_ino))
            files.append(f)
    line = (
        f"data.path={path!r}: skipped {len(skipped)} path(s) that are not regular files "
        f"({skipped[0]} is {_kind(skipped[0])})"
        if skipped
        else None
    )
    if line and line not in _SAID:  # the BPE and the token stream list the files twice
        _SAID.add(line)
        print(line, file=sys.stderr)
    return files


def _corpus_files(config) -> list[str]:
    source = config.data.source
    if source == "stdlib":
        return _stdlib_files()
    if source == "text":
        return _text_files(config.data.path)
    raise DataError(f"data.source={source!r} has no text; use 'stdlib', 'text' or 'tokens'")


def _fingerprint(files: list[str], *extra: Any) -> str:
    """Hash of the file list and stats: cheap, and changes whenever a file does."""
    stats = [(f, s.st_size, s.st_mtime_ns) for f in files for s in [os.stat(f)]]
    blob = json.dumps([stats, list(extra)], default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _read_docs(files: list[str], config) -> list[str]:
    """The files' text. Invalid UTF-8 is replaced by U+FFFD and counted: said in one line,
    refused past `data.max_invalid_utf8` of the corpus's bytes."""
    docs, invalid, size = [], {}, 0
    for f in files:
        raw = _read_bytes(f)
        size += len(raw)
        try:
            docs.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            doc = raw.decode("utf-8", errors="replace")
            invalid[f] = doc.count("\ufffd") - raw.count("\ufffd".encode())
            docs.append(doc)
    docs = [d for d in docs if d]
    if not docs:
        raise DataError(f"the corpus ({len(files)} files) is empty; add text to data.path")
    if invalid:
        _check_utf8(invalid, size, config.data.get("max_invalid_utf8", 0.001))
    return docs


def _check_utf8(invalid: dict[str, int], size: int, limit: float) -> None:
    count, worst = sum(invalid.values()), max(invalid, key=invalid.get)
    what = (
        f"{count} invalid UTF-8 sequences in {len(invalid)} of the corpus's files "
        f"({count / size:.2%} of {size} bytes; most in {worst}: {invalid[worst]})"
    )
    if count > limit * size:
        raise DataError(
            f"{what}: more than data.max_invalid_utf8={limit}; convert the files to UTF-8, "
            "leave out the ones that are not text, or raise data.max_invalid_utf8 to train "
            "on them with each replaced by U+FFFD"
        )
    line = f"{what}: each replaced by U+FFFD (data.max_invalid_utf8={limit})"
    if line not in _SAID:  # the BPE and the token stream read the files twice
        _SAID.add(line)
        print(line, file=sys.stderr)


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
    if t.vocab_size > vocab:
        raise DataError(
            f"tokenizer has {t.vocab_size} symbols but model.vocab_size={vocab}; "
            f"set model.vocab_size >= {t.vocab_size}"
        )
    return t


def _load_named(kind: str) -> tok.BpeTokenizer:
    """data.tokenizer=hf:DIR (DIR/tokenizer.json) or a path to a tokenizer.json."""
    path = os.path.join(kind[3:], "tokenizer.json") if kind.startswith("hf:") else kind
    return _bpe_file(path, f"data.tokenizer={kind}: {path}")


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
    from seqpipe import checkpoint  # only here: data loading needs no orbax otherwise

    if not workdir or not checkpoint.complete_steps(checkpoint.directory(workdir)):
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
            f"the checkpoints in {checkpoint.directory(workdir)} were trained with "
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
    files = _corpus_files(config)
    key = _fingerprint(files, "bpe", vocab, BPE_TRAIN_MAX_CHARS)
    cache = _cache_dir(config)
    path = os.path.join(cache, f"bpe-{vocab}-{key}.json")
    if os.path.exists(path):
        try:
            return tok.BpeTokenizer.from_file(path)
        except Exception as e:  # HF raises a bare Exception for a file it cannot parse
            _damaged(path, e)
    _check_writable(cache)
    docs, total = [], 0
    for d in _read_docs(files, config):
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


def _encode_corpus(config, t: Tokenizer) -> np.ndarray:
    files = _corpus_files(config)
    key = _fingerprint(files, tok.fingerprint(t))
    cache = _cache_dir(config)
    path = os.path.join(cache, f"tokens-{key}.npy")
    if os.path.exists(path):
        try:
            return _load_npy(path)
        except (OSError, ValueError, EOFError) as e:
            _damaged(path, e)
    _check_writable(cache)
    dtype = np.uint16 if t.vocab_size <= 2**16 else np.uint32
    docs = _read_docs(files, config)
    if isinstance(t, tok.ByteTokenizer):
        # Bytes are their own ids: skip the Python lists.
        stream = np.frombuffer("".join(docs).encode("utf-8"), np.uint8).astype(dtype)
    else:
        eot = [] if t.eot_id is None else [t.eot_id]
        stream = np.concatenate([np.array(ids + eot, dtype) for ids in t.encode_batch(docs)])
    _write_entry(path, lambda f: _save_npy(f, stream))
    return np.load(path, mmap_mode="r")


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


def _read_token_file(config) -> np.ndarray:
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
        raise _unreadable(path, e) from None
    # One pass in chunks, so a huge file never sits in memory at once.
    vocab = config.model.vocab_size
    top = max((int(tokens[i : i + 2**24].max()) for i in range(0, tokens.size, 2**24)), default=0)
    if top >= vocab:
        raise DataError(
            f"data.path={path!r} holds token id {top} >= model.vocab_size={vocab}; "
            "check data.token_dtype or raise model.vocab_size"
        )
    return tokens


def read_corpus(config) -> tuple[np.ndarray, np.ndarray, Tokenizer | None]:
    """(train_tokens, eval_tokens, tokenizer), writing nothing outside the cache: 1-D, the
    eval split is the stream's last part; the tokenizer is None for a token file without
    one (its tokenizer is checked only when one is named: it may be any)."""
    t = None
    if config.data.source != "tokens" or config.data.get("tokenizer_path"):
        t = load_tokenizer(config)
    if config.data.source == "tokens":
        tokens = _read_token_file(config)
    else:
        tokens = _encode_corpus(config, t)
    window = config.train.seq_len + 1
    fraction = config.data.get("eval_fraction", 0.02)
    num_eval = max(math.ceil(fraction * tokens.size), window)
    if tokens.size - num_eval < window:
        raise DataError(
            f"the corpus has {tokens.size} tokens: too few for a train and an eval window of "
            f"{window}; add data or lower train.seq_len"
        )
    split = tokens.size - num_eval
    return tokens[:split], tokens[split:], t


def identity(tokens: np.ndarray) -> dict:
    """What a checkpoint's data position counts batches of: the training stream's length
    and a digest of its ids (all of them up to 4 Mi tokens, else 64 evenly spaced pieces
    and the last: cheap on a memory-mapped file of any size). Moving the files changes
    neither; other data, or the same files edited, changes one."""
    piece, n = 2**16, int(tokens.size)
    if n <= 64 * piece:
        parts = [tokens]
    else:
        parts = [tokens[s : s + piece] for s in np.linspace(0, n - piece, 65).astype(np.int64)]
    h = hashlib.sha256()
    for part in parts:  # as uint32: the same ids in uint16 or uint32 are the same data
        h.update(np.ascontiguousarray(part, dtype=np.uint32).tobytes())
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
    return train, held_out


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
            "mesh.stage * mesh.tensor the global device count"
        )
    return rows[jax.process_index()]


def _gather(tokens: np.ndarray, seq_len: int, window_ids: np.ndarray) -> np.ndarray:
    """int32 [len(window_ids), seq_len + 1]: window w is tokens[w*L : w*L + L + 1]."""
    starts = np.asarray(window_ids, dtype=np.int64)[:, None] * seq_len
    return tokens[starts + np.arange(seq_len + 1)].astype(np.int32)


def train_iterator(config, tokens: np.ndarray, rows: slice) -> Iterator[dict[str, np.ndarray]]:
    """An endless grain iterator of {"tokens": int32 [B_local, L+1]}, `rows` of every global
    batch (`local_rows`); has get/set_state."""
    seq_len = config.train.seq_len
    ds = (
        grain.MapDataset.range(_num_windows(tokens, seq_len))
        .shuffle(seed=config.train.seed)
        .repeat()  # infinite; each epoch is shuffled with seed + epoch
        .batch(config.train.global_batch_size)  # window ids of one global batch
        .map(lambda ids: {"tokens": _gather(tokens, seq_len, ids[rows])})
    )
    # One reader thread keeps a couple of batches ahead of the step; order stays fixed.
    options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)
    return iter(ds.to_iter_dataset(options))


def eval_batches(config, tokens: np.ndarray, num_batches: int, rows: slice) -> list[np.ndarray]:
    """`rows` of the first `num_batches` global batches of eval windows, in order (wrapping
    around)."""
    seq_len = config.train.seq_len
    batch = config.train.global_batch_size
    n = _num_windows(tokens, seq_len)
    ids = np.arange(batch)[rows]
    return [_gather(tokens, seq_len, (b * batch + ids) % n) for b in range(num_batches)]


def to_global(local_batch: np.ndarray, mesh: jax.sharding.Mesh, batch_size: int) -> jax.Array:
    """Assembles the processes' `local_rows` of a batch into one global [batch_size, L+1]
    array, split over 'data'."""
    # Given the global shape, jax checks each process's part against it.
    global_shape = (batch_size, *local_batch.shape[1:])
    return jax.make_array_from_process_local_data(
        sharding.batch_sharding(mesh), local_batch, global_shape
    )
