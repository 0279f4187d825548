"""Documents in (`seqpipe.data.documents`) and their tokens (`seqpipe.data`): real files written
from the standard library's text, real tokenizers, every bad input in one line."""

import gzip
import json
import os
import shutil
import sysconfig
from pathlib import Path

import ml_collections
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from seqpipe.data import documents, loader
from seqpipe.data import tokenizer as tok

HF_MODEL = Path(__file__).resolve().parent / "fixtures" / "hf" / "llama_tied_mha"
EMAIL = os.path.join(sysconfig.get_paths()["stdlib"], "email")
# Real text: the email package's modules, one document each.
TEXTS = [
    open(os.path.join(EMAIL, name), encoding="utf-8").read()
    for name in sorted(os.listdir(EMAIL))
    if name.endswith(".py")
]


def config_for(tmp_path, source, path, **data_keys):
    c = ml_collections.ConfigDict(
        dict(
            model=dict(vocab_size=512),
            train=dict(seq_len=16, global_batch_size=8, seed=0),
            data=dict(
                source=source,
                path=str(path),
                tokenizer="byte",
                token_dtype="uint16",
                eval_fraction=0.02,
                cache_dir=str(tmp_path / "cache"),
                text_key="text",
                skip_bad_lines=False,
                eod_id=-1,
                packing="none",
                reset_positions=True,
            ),
        )
    )
    c.data.update(data_keys)
    return c


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_docs(config):
    return documents.read(documents.corpus_files(config), config)


# ---------------------------------------------------------------- sources


def test_jsonl_file_directory_and_glob_hold_one_document_per_line(tmp_path):
    (tmp_path / "corpus" / "more").mkdir(parents=True)
    half = len(TEXTS) // 2
    write_jsonl(
        tmp_path / "corpus" / "a.jsonl", [{"text": t, "id": i} for i, t in enumerate(TEXTS[:half])]
    )
    # A blank line between records, and a file the directory walk leaves out.
    lines = [json.dumps({"text": t}) for t in TEXTS[half:]]
    (tmp_path / "corpus" / "more" / "b.jsonl").write_text("\n\n".join(lines) + "\n")
    (tmp_path / "corpus" / "notes.txt").write_text("not a corpus file")
    for path in (tmp_path / "corpus", tmp_path / "corpus" / "**" / "*.jsonl"):
        assert read_docs(config_for(tmp_path, "jsonl", path)) == TEXTS
    one = config_for(tmp_path, "jsonl", tmp_path / "corpus" / "a.jsonl")
    assert read_docs(one) == TEXTS[:half]


def test_jsonl_reads_the_configured_text_key_and_leaves_empty_documents_out(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"body": TEXTS[0]}, {"body": ""}, {"body": TEXTS[1]}])
    assert read_docs(config_for(tmp_path, "jsonl", path, text_key="body")) == TEXTS[:2]


def test_parquet_files_hold_one_document_per_row(tmp_path):
    (tmp_path / "pq").mkdir()
    half = len(TEXTS) // 2
    for name, part in (("0.parquet", TEXTS[:half]), ("1.parquet", TEXTS[half:])):
        table = pa.table({"id": list(range(len(part))), "text": part})
        pq.write_table(table, tmp_path / "pq" / name, row_group_size=3)  # several groups
    assert read_docs(config_for(tmp_path, "parquet", tmp_path / "pq")) == TEXTS
    large = pa.table({"content": pa.array(TEXTS[:2], pa.large_string())})
    pq.write_table(large, tmp_path / "large.parquet")
    config = config_for(tmp_path, "parquet", tmp_path / "large.parquet", text_key="content")
    assert read_docs(config) == TEXTS[:2]


def test_parquet_dictionary_and_view_string_columns_are_read(tmp_path):
    """A dictionary-encoded text column (issue 47: refused as not strings), as writers
    store repeated text, is decoded; so are large strings and string views."""
    repeated = [TEXTS[0], TEXTS[1], TEXTS[0], None, TEXTS[2], TEXTS[1]]
    columns = {
        "dictionary": pa.array(repeated).dictionary_encode(),
        "large dictionary": pa.array(repeated, pa.large_string()).dictionary_encode(),
        "view": pa.array(repeated, pa.string_view()),
    }
    for name, column in columns.items():
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"id": range(6), "text": column}), path, use_dictionary=True)
        if "dictionary" in name:
            assert pa.types.is_dictionary(pq.ParquetFile(path).schema_arrow.field("text").type)
        config = config_for(tmp_path, "parquet", path, skip_bad_lines=True)
        assert read_docs(config) == [t for t in repeated if t is not None]
    raw = pa.table({"text": pa.array([b"a", b"b", b"a"]).dictionary_encode()})
    pq.write_table(raw, tmp_path / "bytes.parquet")
    with pytest.raises(loader.DataError, match=r"column 'text' holds dictionary<values=binary"):
        read_docs(config_for(tmp_path, "parquet", tmp_path / "bytes.parquet"))


def test_text_source_is_one_document_per_file(tmp_path):
    config = config_for(tmp_path, "text", os.path.join(EMAIL, "*.py"))
    assert read_docs(config) == [t for t in TEXTS if t]


def test_gzip_files_read_as_the_files_they_hold(tmp_path):
    """`.jsonl.gz`, `.json.gz` and `.txt.gz` are decompressed as they are read (issue 47:
    a .jsonl.gz was "not UTF-8"); a directory walk keeps .jsonl.gz beside .jsonl."""
    half = len(TEXTS) // 2
    (tmp_path / "corpus").mkdir()
    write_jsonl(tmp_path / "corpus" / "a.jsonl", [{"text": t} for t in TEXTS[:half]])
    lines = "\n\n".join(json.dumps({"text": t}) for t in TEXTS[half:]) + "\n"
    with gzip.open(tmp_path / "corpus" / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(lines)
    assert read_docs(config_for(tmp_path, "jsonl", tmp_path / "corpus")) == TEXTS
    one = config_for(tmp_path, "jsonl", tmp_path / "corpus" / "b.jsonl.gz")
    assert read_docs(one) == TEXTS[half:]
    (tmp_path / "doc.txt.gz").write_bytes(gzip.compress(TEXTS[0].encode()))
    config = config_for(tmp_path, "text", tmp_path / "doc.txt.gz")
    assert read_docs(config) == TEXTS[:1]
    train, held_out, _ = loader.read_corpus(config)  # tokens of the text, not of the gzip
    tokens = np.concatenate([train.tokens, held_out.tokens])
    assert bytes(tokens.astype(np.uint8)) == TEXTS[0].encode()


def test_a_bad_line_in_a_gzip_file_or_a_damaged_gzip_is_one_line(tmp_path):
    body = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:3]) + '{"text": 1\n'
    whole = gzip.compress(body.encode())
    (tmp_path / "bad.jsonl.gz").write_bytes(whole)
    with pytest.raises(loader.DataError, match=r"bad.jsonl.gz:4 is not valid JSON"):
        loader.read_corpus(config_for(tmp_path, "jsonl", tmp_path / "bad.jsonl.gz"))
    damaged = bytearray(whole)
    damaged[40:60] = b"x" * 20
    cases = {
        "cut": (whole[: len(whole) // 2], "Compressed file ended before the end-of-stream"),
        "damaged": (bytes(damaged), "Error -3 while decompressing data"),
        "not gzip": (body.encode(), "Not a gzipped file"),
    }
    for name, (content, reason) in cases.items():
        path = tmp_path / f"{name}.jsonl.gz"
        path.write_bytes(content)
        with pytest.raises(loader.DataError) as e:
            loader.read_corpus(config_for(tmp_path, "jsonl", path))
        assert str(e.value).startswith(f"{path} is not a whole gzip file ({reason}")
        assert str(e.value).endswith("; compress it again, or leave it out of data.path")
        assert "\n" not in str(e.value)
    assert not (tmp_path / "cache").exists() or not os.listdir(tmp_path / "cache")


# ---------------------------------------------------------------- tokens of documents


def test_every_document_ends_with_the_bpe_end_symbol_and_starts_are_kept(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXTS])
    config = config_for(tmp_path, "jsonl", path, tokenizer="bpe", eval_fraction=0.01)
    train, held_out, t = loader.read_corpus(config)
    stream = np.concatenate([train.tokens, held_out.tokens])
    ends = np.flatnonzero(stream == t.eot_id)
    assert len(ends) == len(TEXTS)  # one end symbol per document, none inside one
    np.testing.assert_array_equal(
        train.starts, np.concatenate([[0], ends + 1])[: len(train.starts)]
    )
    for i in (0, 5):  # each document decodes to its text, then the end symbol
        a, b = ([0, *ends + 1])[i], ends[i]
        assert t.decode(stream[a:b]) == TEXTS[i] and stream[b] == t.eot_id


def llama3_like(tmp_path, eos=2):
    """A HF model directory whose tokenizer, as Llama 3's, has no <|endoftext|>: a BOS added
    by its post-processor, and the end of text only as config.json's eos_token_id."""
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|pad|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(TEXTS, trainer)
    hf.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    directory = tmp_path / "llama3"
    directory.mkdir(exist_ok=True)
    hf.save(str(directory / "tokenizer.json"))
    (directory / "config.json").write_text(json.dumps({"eos_token_id": eos, "bos_token_id": 0}))
    return directory


def test_a_hf_tokenizer_without_endoftext_begins_with_its_bos_and_ends_with_the_model_eos(tmp_path):
    directory = llama3_like(tmp_path)
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in TEXTS[:6]])
    config = config_for(tmp_path, "jsonl", path, tokenizer=f"hf:{directory}", eval_fraction=0.01)
    t = loader.load_tokenizer(config)
    assert t.hf.token_to_id(tok.EOT) is None and t.eot_id == 2
    train, held_out, _ = loader.read_corpus(config)
    stream = np.concatenate([train.tokens, held_out.tokens])
    starts = [*train.starts, *(held_out.starts[1:] + train.tokens.size)]
    ends = [*starts[1:], stream.size]
    for text, a, b in zip(TEXTS[:6], starts, ends, strict=True):
        assert stream[a] == 0 and stream[b - 1] == 2  # <|begin_of_text|> ... <|end_of_text|>
        assert t.decode(stream[a + 1 : b - 1]) == text
    # Another eos is other tokens: the cache never serves the old ones.
    other = llama3_like(tmp_path, eos=1)
    assert other == directory
    again, _, _ = loader.read_corpus(config)
    assert np.count_nonzero(again.tokens == 1) >= 5 and not np.any(again.tokens == 2)
    assert len(list((tmp_path / "cache").glob("tokens-*.npy"))) == 2


def test_token_file_documents_end_after_each_eod_id(tmp_path):
    ids = np.array([5, 6, 0, 7, 0, 8, 9, 9, 0, 4] * 20, np.uint16)
    path = tmp_path / "ids.bin"
    ids.tofile(path)
    config = config_for(tmp_path, "tokens", path, eod_id=0, tokenizer="bpe", eval_fraction=0.1)
    config.model.vocab_size = 10
    train, held_out, _ = loader.read_corpus(config)
    assert train.tokens.size == 180  # the last 20 held out
    starts = np.flatnonzero(ids == 0) + 1  # after each end; the last ends the file
    np.testing.assert_array_equal(train.starts, [0, *starts[starts < 180]])
    assert held_out.starts.tolist() == [0, 3, 5, 9, 13, 15, 19]
    config.data.eod_id = -1  # no documents: one stream
    assert loader.read_corpus(config)[0].starts.tolist() == [0]
    config.data.eod_id = 3  # an id the file never holds
    with pytest.raises(loader.DataError, match=r"holds no data.eod_id=3, so no document ends"):
        loader.read_corpus(config)


def sparse_tokenizer(directory, top: int):
    """A copy of a HF model directory whose tokenizer (96 entries) has its last token moved
    to id `top`: a vocabulary with a gap, whose count fits a small model but ids do not."""
    shutil.copytree(HF_MODEL, directory)
    spec = json.loads((directory / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab[max(vocab, key=vocab.get)] = top
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return directory


@pytest.mark.parametrize("setting", ["file", "hf", "tokenizer_path"])
def test_tokenizer_ids_past_model_vocab_are_refused_before_any_token_is_cached(tmp_path, setting):
    """Its 96 entries fit model.vocab_size=512; its ids, up to 1322, do not (issue 47)."""
    directory = sparse_tokenizer(tmp_path / "model", 1322)
    file = directory / "tokenizer.json"
    keys = {
        "file": dict(tokenizer=str(file)),
        "hf": dict(tokenizer=f"hf:{directory}"),
        "tokenizer_path": dict(tokenizer="bpe", tokenizer_path=str(file)),
    }[setting]
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": t + "}"} for t in TEXTS])
    config = config_for(tmp_path, "jsonl", path, **keys)
    assert Tokenizer.from_file(str(file)).get_vocab_size() == 96
    named = "data.tokenizer_path" if setting == "tokenizer_path" else "data.tokenizer"
    with pytest.raises(loader.DataError) as e:
        loader.read_corpus(config)
    assert str(e.value).startswith(f"{named}={keys.get('tokenizer_path') or keys['tokenizer']} ")
    assert str(e.value).endswith(
        " has ids up to 1322 but model.vocab_size=512; set model.vocab_size >= 1323, or use a "
        "tokenizer whose ids are below 512 (the model's own)"
    )
    assert not (tmp_path / "cache").exists() or not os.listdir(tmp_path / "cache")
    config.model.vocab_size = 1323  # room for every id: read, and the ids are all there
    train, _, _ = loader.read_corpus(config)
    assert train.tokens.max() == 1322


# ---------------------------------------------------------------- bad input

BAD_JSONL = {
    "not JSON": ('{"text": "a"}\n{"text": "b"\n', r"c.jsonl:2 is not valid JSON"),
    "no text key": (
        '{"text": "a"}\n{"body": "b"}\n',
        r"c.jsonl:2 has no 'text' field \(keys \['body'\]\)",
    ),
    # A line that is no object has no field for data.text_key to name (issue 47).
    "an array": (
        '{"text": "a"}\n\n["b"]\n',
        r"c.jsonl:3 is not a JSON object but an array; write each document as an object with "
        r"its text in the 'text' field, e.g. \{\"text\": \"...\"\}; fix it",
    ),
    "a string": ('"just text"\n', r"c.jsonl:1 is not a JSON object but a string; write each"),
    "a number": ('{"text": "a"}\n3.5\n', r"c.jsonl:2 is not a JSON object but a number; write"),
    "null": ("null\n", r"c.jsonl:1 is not a JSON object but null; write each document"),
    "text not a string": ('{"text": 3}\n', r"c.jsonl:1 has a int in 'text', not a string"),
    "not UTF-8": (b'{"text": "\xff"}\n', r"c.jsonl:1 is not UTF-8"),
}


@pytest.mark.parametrize("name", sorted(BAD_JSONL))
def test_a_bad_json_line_is_refused_naming_file_and_line_and_nothing_is_written(tmp_path, name):
    content, match = BAD_JSONL[name]
    path = tmp_path / "c.jsonl"
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    config = config_for(tmp_path, "jsonl", path, tokenizer="bpe")
    with pytest.raises(loader.DataError, match=match) as e:
        loader.read_corpus(config)
    assert "data.skip_bad_lines=True" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "cache").exists() or not os.listdir(tmp_path / "cache")


def test_skip_bad_lines_counts_and_reports_them_in_one_line(tmp_path, capsys):
    good = [json.dumps({"text": t}) for t in TEXTS[:4]]
    (tmp_path / "a.jsonl").write_text("\n".join([good[0], "{oops", good[1]]) + "\n")
    (tmp_path / "b.jsonl").write_text("\n".join([good[2], '{"body": 1}', '{"text": 2}', good[3]]))
    config = config_for(tmp_path, "jsonl", tmp_path / "*.jsonl", skip_bad_lines=True)
    assert read_docs(config) == TEXTS[:4]
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("data.skip_bad_lines: skipped 3 bad line(s) in 2 file(s); the first: ")
    assert "a.jsonl:2 is not valid JSON" in line


def test_a_null_parquet_row_is_a_bad_line(tmp_path, capsys):
    pq.write_table(pa.table({"text": [TEXTS[0], None, TEXTS[1]]}), tmp_path / "n.parquet")
    config = config_for(tmp_path, "parquet", tmp_path / "n.parquet")
    with pytest.raises(loader.DataError, match=r"n.parquet:2 \(row 2\) has a null 'text'"):
        read_docs(config)
    config.data.skip_bad_lines = True
    assert read_docs(config) == TEXTS[:2]
    assert "skipped 1 bad line(s) in 1 file(s)" in capsys.readouterr().err


def test_parquet_without_the_column_or_with_another_type_or_not_parquet_is_refused(tmp_path):
    pq.write_table(pa.table({"body": TEXTS[:2]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "b.parquet")
    (tmp_path / "c.parquet").write_text("not parquet at all")
    cases = {
        "a": r"a.parquet has no column 'text' \(its columns: \['body'\]\); set data.text_key",
        "b": r"b.parquet: column 'text' holds int64, not strings",
        "c": r"c.parquet is not a readable Parquet file",
    }
    for name, match in cases.items():
        config = config_for(tmp_path, "parquet", tmp_path / f"{name}.parquet", tokenizer="bpe")
        with pytest.raises(loader.DataError, match=match):
            loader.read_corpus(config)
    assert not (tmp_path / "cache").exists() or not os.listdir(tmp_path / "cache")


def test_an_empty_corpus_is_refused(tmp_path):
    write_jsonl(tmp_path / "e.jsonl", [{"text": ""}, {"text": ""}])
    with pytest.raises(loader.DataError, match=r"the corpus \(1 jsonl files\) holds no document"):
        read_docs(config_for(tmp_path, "jsonl", tmp_path / "e.jsonl"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("text, but not JSON lines")
    with pytest.raises(
        loader.DataError, match=r"matches no jsonl files \(.jsonl, .json, .jsonl.gz, .json.gz\)"
    ):
        read_docs(config_for(tmp_path, "jsonl", tmp_path / "d"))


def test_a_cache_entry_cut_in_its_document_starts_is_rebuilt(tmp_path, capsys):
    config = config_for(tmp_path, "text", os.path.join(EMAIL, "*.py"))
    train, _, _ = loader.read_corpus(config)
    starts = np.array(train.starts)
    (entry,) = (tmp_path / "cache").glob("tokens-*.npy")
    os.truncate(entry, entry.stat().st_size - 8)  # the tokens whole, the starts cut
    np.testing.assert_array_equal(np.load(entry, mmap_mode="r")[:10], train.tokens[:10])
    again, _, _ = loader.read_corpus(config)
    np.testing.assert_array_equal(again.starts, starts)
    assert f"the cache entry {entry} is damaged" in capsys.readouterr().err
