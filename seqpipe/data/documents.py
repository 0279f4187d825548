"""Documents in: the corpus's files and the documents they hold, as text.

Sources (`config.data.source`), each a list of documents:
  stdlib   the running interpreter's standard-library `.py` files (no test packages), one
           document each: real text present on every machine.
  text     `config.data.path` (a file, a directory walked recursively, or a glob) of text
           files, one document each.
  jsonl    the same, of JSON lines files: one document per line, its `config.data.text_key`
           field (default "text"); blank lines are skipped.
  parquet  the same, of Parquet files (as HuggingFace datasets are published): one
           document per row of the `config.data.text_key` column.

A text or JSON lines file whose name ends in `.gz` is decompressed as it is read. A JSON
line that does not parse, is not an object, lacks the key or holds no string is refused,
naming the file and line; `config.data.skip_bad_lines` skips such lines instead, counted
and reported in one line. Empty documents are left out; a corpus with none is refused.
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import json
import os
import stat
import sys
import sysconfig
import zlib
from collections.abc import Callable

from seqpipe.errors import DataError

# Package dirs under the stdlib that hold tests or third-party code, not library text.
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
# What a directory walk keeps for each source (a glob or a named file: what it names).
# A name ending in .gz is read through gzip, whatever the source but parquet.
_SUFFIXES = {"jsonl": (".jsonl", ".json", ".jsonl.gz", ".json.gz"), "parquet": (".parquet",)}
SOURCES_WITH_FILES = ("text", "jsonl", "parquet")

# Lines said once per process, however often the corpus is listed.
_SAID: set[str] = set()


def say_once(line: str) -> None:
    """`line` on stderr, once per process (the BPE and the token stream read the corpus
    twice)."""
    if line not in _SAID:
        _SAID.add(line)
        print(line, file=sys.stderr)


def _stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in _STDLIB_SKIP]
        files += [os.path.join(d, n) for n in names if n.endswith(".py")]
    return sorted(files)


def unreadable(path: str, e: OSError) -> DataError:
    return DataError(f"cannot read {path} ({e.strerror}); fix data.path or its permissions")


def _read_bytes(path: str, size: int = -1) -> bytes:
    """The file's bytes (the first `size`), decompressed if its name ends in `.gz`."""
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
            return f.read(size)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:  # BadGzipFile is an OSError
        raise DataError(
            f"{path} is not a whole gzip file ({str(e) or type(e).__name__}); compress it "
            "again, or leave it out of data.path"
        ) from None
    except OSError as e:
        raise unreadable(path, e) from None


def _is_text(path: str) -> bool:
    return b"\0" not in _read_bytes(path, 8192)


def _text_files(path: str) -> list[str]:
    return _source_files(path, "text")


def _source_files(path: str, source: str) -> list[str]:
    """The files `data.path` names for `source`: a file, a directory (recursive; text files,
    or files with the source's suffixes) or a glob (what it matches)."""
    what = f"{source} files"
    if not path:
        raise DataError(f"data.source={source} needs data.path: a file, a directory or a glob")
    if os.path.exists(path) and not os.path.isdir(path):
        if not stat.S_ISREG(os.stat(path).st_mode):  # a pipe would block the read forever
            raise DataError(
                f"data.path={path!r} is {_kind(path)}, not a regular file; point data.path "
                f"at {what}"
            )
        if source == "text" and not _is_text(path):  # what the directory walk skips
            raise DataError(
                f"data.path={path!r} is a binary file, not text; for token ids use "
                "data.source=tokens, for Parquet data.source=parquet, else point data.path "
                "at text"
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
        keep = _is_text if source == "text" else lambda f: f.endswith(_SUFFIXES[source])
        files = [f for f in files if keep(f)]
    if not files:
        suffixes = f" ({', '.join(_SUFFIXES[source])})" if source in _SUFFIXES else ""
        raise DataError(
            f"data.path={path!r} matches no {what}{suffixes}; point it at a file, dir or glob"
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
    if line:
        say_once(line)
    return files


def _text_docs(files: list[str], config) -> list[str]:
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
    say_once(line)


def corpus_files(config) -> list[str]:
    """The corpus's files, sorted: what the caches' fingerprints are taken of."""
    source = config.data.source
    if source == "stdlib":
        return _stdlib_files()
    if source in SOURCES_WITH_FILES:
        return _source_files(config.data.path, source)
    raise DataError(
        f"data.source={source!r} has no text; use 'stdlib', 'text', 'jsonl', 'parquet' or 'tokens'"
    )


def read(files: list[str], config) -> list[str]:
    """The documents in `files` (`corpus_files`), in order; empty ones left out. DataError
    for a bad line (unless data.skip_bad_lines) or a corpus with no document."""
    source = config.data.source
    if source in ("stdlib", "text"):
        return _text_docs(files, config)
    bad = BadLines(config.data.get("skip_bad_lines", False))
    key = config.data.get("text_key", "text")
    reader = _jsonl_docs if source == "jsonl" else _parquet_docs
    docs = [doc for f in files for doc in reader(f, key, bad) if doc]
    bad.report()
    if not docs:
        raise DataError(
            f"the corpus ({len(files)} {source} files) holds no document: every "
            f"{'line' if source == 'jsonl' else 'row'}'s {key!r} is empty or skipped; "
            "add documents to data.path"
        )
    return docs


class BadLines:
    """Bad lines (or rows) of a corpus: refused at the first (the default), or with
    `skip` counted and reported in one line at the end."""

    def __init__(self, skip: bool):
        self.skip, self.count, self.files, self.first = skip, 0, set(), ""

    def __call__(self, where: str, what: str) -> None:
        if not self.skip:
            raise DataError(
                f"{where} {what}; fix it, or set data.skip_bad_lines=True to skip such lines "
                "(counted and reported)"
            )
        self.count += 1
        self.files.add(where.rsplit(":", 1)[0])
        self.first = self.first or f"{where} {what}"

    def report(self) -> None:
        if self.count:
            say_once(
                f"data.skip_bad_lines: skipped {self.count} bad line(s) in "
                f"{len(self.files)} file(s); the first: {self.first}"
            )


def _jsonl_docs(path: str, key: str, bad: BadLines) -> list[str]:
    """Each non-blank line's `key` field."""
    docs = []
    for number, line in enumerate(_read_bytes(path).split(b"\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except UnicodeDecodeError:
            bad(where, "is not UTF-8")
            continue
        except ValueError as e:
            bad(where, f"is not valid JSON ({getattr(e, 'msg', e)})")
            continue
        if not isinstance(record, dict):  # data.text_key cannot help: there are no fields
            bad(
                where,
                f"is not a JSON object but {_json_kind(record)}; write each document as an "
                f'object with its text in the {key!r} field, e.g. {{{json.dumps(key)}: "..."}}',
            )
        elif key not in record:
            has = f"keys {sorted(record)[:8]}"
            bad(where, f"has no {key!r} field ({has}); set data.text_key to the text's field")
        elif not isinstance(record[key], str):
            bad(where, f"has a {type(record[key]).__name__} in {key!r}, not a string")
        else:
            docs.append(record[key])
    return docs


def _json_kind(value) -> str:
    """What a parsed JSON value is, in JSON's words."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)  # null, true, false
    kinds = {str: "a string", int: "a number", float: "a number", list: "an array"}
    return kinds[type(value)]


def _parquet_docs(path: str, key: str, bad: BadLines) -> list[str]:
    """Each row's `key` column (a null row is a bad line)."""
    import pyarrow as pa  # only here: the other sources need no Arrow
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
        schema = table.schema_arrow
        _check_column(path, schema, key, pa)
        column = [v for b in table.iter_batches(columns=[key]) for v in b.column(0).to_pylist()]
    except (pa.ArrowException, OSError) as e:
        reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise DataError(
            f"{path} is not a readable Parquet file ({reason}); point data.path at Parquet "
            "files or set data.source"
        ) from None
    docs = []
    for row, value in enumerate(column, 1):
        if value is None:
            bad(f"{path}:{row}", f"(row {row}) has a null {key!r}")
        else:
            docs.append(value)
    return docs


def _check_column(path: str, schema, key: str, pa) -> None:
    """The text column is there and holds strings (plain, large, views or a dictionary of
    them)."""
    if key not in schema.names:
        raise DataError(
            f"{path} has no column {key!r} (its columns: {schema.names[:8]}); set "
            "data.text_key to the column that holds the text"
        )
    kind = schema.field(key).type
    # A dictionary of strings is how Parquet writers store repeated text: to_pylist
    # decodes it.
    values = kind.value_type if pa.types.is_dictionary(kind) else kind
    text = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view)
    if not any(is_text(values) for is_text in text):
        raise DataError(
            f"{path}: column {key!r} holds {kind}, not strings; set data.text_key to the "
            "column that holds the text"
        )
