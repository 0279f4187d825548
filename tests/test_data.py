"""Real text, real tokenizers, the real grain pipeline: no mocks."""

import json
import os
import sysconfig

import chex
import jax
import ml_collections
import numpy as np
import pytest

from seqpipe.data import documents, loader
from seqpipe.parallel import sharding

STDLIB = sysconfig.get_paths()["stdlib"]


def make_config(tmp_path, **data_overrides):
    c = ml_collections.ConfigDict(
        dict(
            model=dict(vocab_size=512),
            train=dict(seq_len=16, global_batch_size=8, seed=0),
            data=dict(
                source="text",
                path=os.path.join(STDLIB, "email", "**", "*.py"),
                tokenizer="bpe",
                token_dtype="uint16",
                eval_fraction=0.02,
                cache_dir=str(tmp_path / "cache"),
            ),
        )
    )
    c.data.update(data_overrides)
    return c


def stream_config(tmp_path, seq_len=4, batch=8, seed=0):
    c = make_config(tmp_path)
    c.train.update(seq_len=seq_len, global_batch_size=batch, seed=seed)
    return c


def take(it, n):
    return [next(it)["tokens"] for _ in range(n)]


# ---------------------------------------------------------------- tokenizers


def test_bpe_trains_on_stdlib_text_caches_and_round_trips(tmp_path):
    config = make_config(tmp_path)
    tok = loader.load_tokenizer(config)
    assert tok.vocab_size == 512
    text = open(os.path.join(STDLIB, "email", "utils.py"), encoding="utf-8").read()
    ids = tok.encode(text)
    assert len(ids) < len(text.encode()) / 2  # merges learnt from real code compress it
    assert tok.decode(ids) == text
    odd = "naïve café → ∑ 😀\n\tx  = 1"  # bytes never seen in training still round-trip
    assert tok.decode(tok.encode(odd)) == odd
    # Cached under the data cache and copied into the workdir once the data is read; a
    # reload is the same tokenizer.
    assert not os.path.exists(tmp_path / "work")
    loader.load_tokens(config, str(tmp_path / "work"))
    assert json.loads((tmp_path / "work" / "tokenizer.json").read_text()) == json.loads(
        tok.to_json()
    )
    (cached,) = (tmp_path / "cache").glob("bpe-512-*.json")
    again = loader.load_tokenizer(config)
    assert again.to_json() == tok.to_json()
    assert json.loads(cached.read_text()) == json.loads(tok.to_json())
    # Another vocab size is another cache entry, never the stale one.
    config.model.vocab_size = 600
    assert loader.load_tokenizer(config).vocab_size == 600


def test_byte_tokenizer_round_trips(tmp_path):
    tok = loader.load_tokenizer(make_config(tmp_path, tokenizer="byte"))
    text = "def f(x):\n    return 'ünïcode ∑ 😀'\n"
    assert tok.vocab_size == 256
    assert tok.encode(text) == list(text.encode())
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_larger_than_model_vocab_is_an_error(tmp_path):
    config = make_config(tmp_path, tokenizer="byte")
    config.model.vocab_size = 200
    with pytest.raises(loader.DataError, match="vocab_size"):
        loader.load_tokenizer(config)


# ---------------------------------------------------------------- corpus and splits


def test_stdlib_corpus_split_and_cache(tmp_path):
    config = make_config(tmp_path, source="stdlib", path="", tokenizer="byte")
    train, held_out = loader.load_tokens(config, "")
    files = documents._stdlib_files()
    assert files == sorted(files) and not any("site-packages" in f for f in files)
    total = sum(len(open(f, "rb").read().decode("utf-8", "replace").encode()) for f in files)
    assert train.size + held_out.size == total > 5_000_000
    assert held_out.size == int(np.ceil(0.02 * total))
    # The split is the stream's tail: the eval tokens follow the training tokens.
    first = open(files[0], "rb").read()
    assert bytes(train[: len(first)].astype(np.uint8)) == first
    # Second load comes from the cached array, identical.
    train2, held_out2 = loader.load_tokens(config, "")
    np.testing.assert_array_equal(train2, train)
    np.testing.assert_array_equal(held_out2, held_out)


def test_bpe_tokens_carry_end_of_text_between_documents(tmp_path):
    config = make_config(tmp_path)
    tok = loader.load_tokenizer(config)
    train, held_out = loader.load_tokens(config, "")
    stream = np.concatenate([train, held_out])
    files = [f for f in documents._text_files(config.data.path) if os.path.getsize(f)]
    assert np.count_nonzero(stream == tok.eot_id) == len(files)  # empty files add nothing
    first = open(files[0], encoding="utf-8").read()
    assert tok.decode(stream[: np.argmax(stream == tok.eot_id)]) == first


def test_eval_split_is_at_least_one_window(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text("abcdefghij" * 10)  # 100 byte tokens
    config = make_config(tmp_path, path=str(path), tokenizer="byte")
    train, held_out = loader.load_tokens(config, "")
    assert held_out.size == config.train.seq_len + 1 and train.size == 100 - 17


def test_directory_source_skips_binary_and_hidden_files(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "b.txt").write_text("second " * 20)
    (corpus / "sub" / "a.txt").write_text("first " * 20)
    (corpus / ".hidden").write_text("hidden")
    (corpus / "blob.bin").write_bytes(b"\0\1\2" * 10)
    config = make_config(tmp_path, path=str(corpus), tokenizer="byte")
    train, held_out = loader.load_tokens(config, "")
    text = bytes(np.concatenate([train, held_out]).astype(np.uint8)).decode()
    assert text == "second " * 20 + "first " * 20  # sorted paths: b.txt < sub/a.txt


def test_tokens_source_reads_a_uint16_file(tmp_path):
    ids = np.random.default_rng(0).integers(0, 512, size=5000, dtype=np.uint16)
    path = tmp_path / "ids.bin"
    ids.tofile(path)
    config = make_config(tmp_path, source="tokens", path=str(path), tokenizer="byte")
    train, held_out = loader.load_tokens(config, "")
    assert isinstance(train, np.memmap)  # read in place, never copied
    np.testing.assert_array_equal(np.concatenate([train, held_out]), ids)
    assert held_out.size == 100


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(source="text", path="/no/such/dir/*.txt"), "matches no text files"),
        (dict(source="tokens", path="/no/such/file.bin"), "is not a file"),
        (dict(source="text", path=""), "needs data.path"),
    ],
)
def test_bad_paths_are_clear_errors(tmp_path, overrides, match):
    with pytest.raises(loader.DataError, match=match):
        loader.load_tokens(make_config(tmp_path, tokenizer="byte", **overrides), "")


def test_out_of_range_token_ids_are_an_error(tmp_path):
    path = tmp_path / "ids.bin"
    np.array([1, 2, 3, 700] * 100, np.uint16).tofile(path)
    config = make_config(tmp_path, source="tokens", path=str(path), tokenizer="byte")
    with pytest.raises(loader.DataError, match="token id 700 >= model.vocab_size=512"):
        loader.load_tokens(config, "")


def test_empty_and_too_small_corpora_are_errors(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    config = make_config(tmp_path, path=str(tmp_path / "empty.txt"), tokenizer="byte")
    with pytest.raises(loader.DataError, match="empty"):
        loader.load_tokens(config, "")
    (tmp_path / "tiny.txt").write_text("x" * 20)
    config.data.path = str(tmp_path / "tiny.txt")
    with pytest.raises(loader.DataError, match="too few"):
        loader.load_tokens(config, "")


# ---------------------------------------------------------------- pipeline

# A stream whose tokens are their own positions makes every window checkable.
STREAM = np.arange(4 * 64 + 1, dtype=np.uint32)  # 64 windows of 4 (+1)
EVERY_ROW = slice(None)  # what a lone process reads


def test_windows_are_contiguous_slices_and_an_epoch_covers_each_once(tmp_path):
    config = stream_config(tmp_path)
    batches = take(loader.train_iterator(config, STREAM, EVERY_ROW), 8)  # 8 x 8 = one epoch
    for b in batches:
        chex.assert_shape(b, (8, 5))
        chex.assert_type(b, np.int32)
        np.testing.assert_array_equal(b, b[:, :1] + np.arange(5))
        assert np.all(b[:, 0] % 4 == 0)
    starts = np.concatenate([b[:, 0] for b in batches])
    assert sorted(starts) == list(range(0, 256, 4))
    assert list(starts) != sorted(starts)  # shuffled


def test_same_seed_same_batches_other_seed_other_order(tmp_path):
    a = take(loader.train_iterator(stream_config(tmp_path, seed=1), STREAM, EVERY_ROW), 20)
    b = take(loader.train_iterator(stream_config(tmp_path, seed=1), STREAM, EVERY_ROW), 20)
    c = take(loader.train_iterator(stream_config(tmp_path, seed=2), STREAM, EVERY_ROW), 20)
    np.testing.assert_array_equal(np.stack(a), np.stack(b))
    assert not np.array_equal(np.stack(a), np.stack(c))
    # Each epoch is reshuffled, not replayed.
    assert not np.array_equal(np.stack(a[:8]), np.stack(a[8:16]))


def test_iterator_state_restores_exactly(tmp_path):
    config = stream_config(tmp_path)
    it = loader.train_iterator(config, STREAM, EVERY_ROW)
    take(it, 5)
    state = json.loads(json.dumps(it.get_state()))  # survives a trip through a checkpoint
    expected = take(it, 12)  # crosses an epoch boundary
    restored = loader.train_iterator(config, STREAM, EVERY_ROW)
    take(restored, 2)  # wherever it was, set_state wins
    restored.set_state(state)
    np.testing.assert_array_equal(np.stack(take(restored, 12)), np.stack(expected))


def process_of(devices_per_process):
    """Fake hosts: the 8 local devices, in id order, split into processes."""
    return lambda device: device.id // devices_per_process


# (mesh.data, mesh.stage, devices per process) -> the rows of a batch of 8 each process reads.
ROWS = {
    # Stages spread over the hosts: every process holds every row.
    (1, 8, 4): [slice(0, 8)] * 2,
    (1, 8, 2): [slice(0, 8)] * 4,
    (2, 4, 4): [slice(0, 4), slice(4, 8)],
    (2, 4, 2): [slice(0, 4)] * 2 + [slice(4, 8)] * 2,
    (4, 2, 4): [slice(0, 4), slice(4, 8)],
    (4, 2, 2): [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)],
}


@pytest.mark.parametrize("layout", list(ROWS), ids=lambda k: "{}x{}-{}-per-process".format(*k))
def test_each_process_reads_the_rows_its_devices_hold(layout):
    data_size, stages, per_process = layout
    mesh = sharding.make_mesh(data_size, stages)
    rows = loader.rows_by_process(mesh, 8, process_of(per_process))
    assert list(rows) == list(range(8 // per_process))
    assert list(rows.values()) == ROWS[layout]
    # Processes whose devices share a data index (a row of the mesh) read the same rows.
    for replica in mesh.devices:
        sharing = {process_of(per_process)(d) for d in replica.flat}
        assert len({(rows[p].start, rows[p].stop) for p in sharing}) == 1


def test_process_rows_serve_the_same_global_batches_in_any_layout(tmp_path):
    config = stream_config(tmp_path)
    whole = take(loader.train_iterator(config, STREAM, EVERY_ROW), 10)
    halves = [take(loader.train_iterator(config, STREAM, r), 10) for r in ROWS[(2, 4, 4)]]
    both = [take(loader.train_iterator(config, STREAM, r), 10) for r in ROWS[(1, 8, 4)]]
    for step, full in enumerate(whole):
        first, second = halves[0][step], halves[1][step]
        assert first.shape == second.shape == (4, 5)
        np.testing.assert_array_equal(np.concatenate([first, second]), full)
        np.testing.assert_array_equal(both[0][step], full)
        np.testing.assert_array_equal(both[1][step], full)
    # A checkpointed iterator state means the same global batch under any other layout.
    second_half = loader.train_iterator(config, STREAM, slice(4, 8))
    take(second_half, 3)
    restored = loader.train_iterator(config, STREAM, EVERY_ROW)
    restored.set_state(json.loads(json.dumps(second_half.get_state())))
    np.testing.assert_array_equal(take(restored, 1)[0], whole[3])


def test_rows_a_process_cannot_read_in_one_range_are_refused():
    # Process 0 (devices 0-3) sits at data indices 0 and 2 of this 4 x 2 mesh.
    devices = np.array(jax.devices())[[0, 1, 4, 5, 2, 3, 6, 7]].reshape(4, 2)
    mesh = jax.sharding.Mesh(devices, (sharding.DATA, sharding.STAGE))
    with pytest.raises(loader.DataError) as refused:
        loader.rows_by_process(mesh, 8, process_of(4))
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        "process 0 holds rows [0, 2), [4, 6) of each global batch of 8 under the 4 x 2 mesh: "
        "not one contiguous range"
    )
    assert "choose the mesh axes" in message


def test_global_batch_must_split_over_data_replicas():
    with pytest.raises(
        loader.DataError, match="global_batch_size=6 does not split over mesh.data=4"
    ):
        loader.rows_by_process(sharding.make_mesh(4, 2), 6)


def test_a_lone_process_reads_every_row(tmp_path):
    assert loader.local_rows(stream_config(tmp_path), sharding.make_mesh(2, 4)) == slice(0, 8)


def test_eval_batches_are_deterministic_sharded_and_from_the_held_out_tail(tmp_path):
    config = stream_config(tmp_path, seq_len=16, batch=4)
    config.data.update(source="tokens", eval_fraction=0.1)
    path = tmp_path / "ids.bin"
    np.arange(2000, dtype=np.uint16).tofile(path)
    config.data.path = str(path)
    config.model.vocab_size = 2000
    train, held_out = loader.load_tokens(config, "")
    evals = [b["tokens"] for b in loader.eval_batches(config, held_out, 5, EVERY_ROW)]
    assert (
        loader.eval_batches(config, held_out, 5, EVERY_ROW)[4]["tokens"].tolist()
        == evals[4].tolist()
    )
    for b in evals:
        assert b.shape == (4, 17) and b.min() >= train.size  # never a training token
        np.testing.assert_array_equal(b, b[:, :1] + np.arange(17))
    assert [b[0, 0] for b in evals[:3]] == [1800, 1864, 1928]  # in order, windows wrap at 12
    halves = [loader.eval_batches(config, held_out, 5, rows) for rows in (slice(0, 2), slice(2, 4))]
    for b, x, y in zip(evals, *halves, strict=True):
        np.testing.assert_array_equal(np.concatenate([x["tokens"], y["tokens"]]), b)
    train_starts = {
        int(s) for b in take(loader.train_iterator(config, train, EVERY_ROW), 30) for s in b[:, 0]
    }
    assert max(train_starts) + 17 <= train.size


def test_to_global_shards_the_batch_over_data(tmp_path):
    mesh = sharding.make_mesh(4, 2)
    batch = np.arange(8 * 5, dtype=np.int32).reshape(8, 5)
    x = loader.to_global(batch, mesh, 8)
    assert x.shape == (8, 5) and x.sharding.spec == jax.sharding.PartitionSpec("data")
    np.testing.assert_array_equal(np.asarray(x), batch)
    # Each device holds two rows; the two stages of a data replica hold the same ones.
    assert {s.data.shape for s in x.addressable_shards} == {(2, 5)}


@pytest.mark.slow
@pytest.mark.parametrize("vocab_size", [4096, 8192])
def test_bpe_on_the_whole_stdlib(tmp_path, vocab_size):
    config = make_config(tmp_path, source="stdlib", path="")
    config.model.vocab_size = vocab_size
    tok = loader.load_tokenizer(config)
    assert tok.vocab_size == vocab_size
    train, held_out = loader.load_tokens(config, "")
    assert train.size + held_out.size > 2_000_000
    assert tok.decode(train[:2000]).startswith(open(documents._stdlib_files()[0]).read()[:500])


# ---------------------------------------------------------------- special files and links


def _within(fn, seconds=60):
    """fn() in a thread that may block (a pipe opened for reading waits for a writer
    forever; glob follows two links to their own directory 2^40 ways): its result, or
    AssertionError after `seconds`."""
    import threading

    result = {}

    def call():
        try:
            result["value"] = fn()
        except Exception as e:
            result["error"] = e

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


def _load_within(config, seconds=60):
    return _within(lambda: loader.load_tokens(config, ""), seconds)


def _unblock(fifo):
    """Give a reader stuck on `fifo` its end of file, so a failed test leaves no thread."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # no reader: nothing to unblock


@pytest.mark.parametrize("spelling", ["dir", "glob"])
def test_a_named_pipe_in_a_text_corpus_is_skipped_in_one_line_never_opened(
    tmp_path, capsys, spelling
):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("real text " * 50)
    fifo = corpus / "pipe.txt"
    os.mkfifo(fifo)
    path = str(corpus) if spelling == "dir" else str(corpus / "*.txt")
    try:
        train, held_out = _load_within(make_config(tmp_path, path=path, tokenizer="byte"))
    finally:
        _unblock(fifo)
    assert bytes(np.concatenate([train, held_out]).astype(np.uint8)).decode() == "real text " * 50
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "skipped 1 path(s) that are not regular files" in line, line
    assert f"{fifo} is a named pipe" in line, line


def test_a_named_pipe_or_device_as_data_path_is_refused_in_one_line(tmp_path):
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    try:
        with pytest.raises(loader.DataError, match="is a named pipe, not a regular file"):
            _load_within(make_config(tmp_path, path=str(fifo), tokenizer="byte"))
    finally:
        _unblock(fifo)
    with pytest.raises(loader.DataError, match="is a character device, not a regular file"):
        _load_within(make_config(tmp_path, path="/dev/zero", tokenizer="byte"))


def test_a_symlink_loop_under_a_glob_reads_each_real_file_once(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("first " * 40)
    (corpus / "sub" / "b.txt").write_text("second " * 40)
    (corpus / "loop").symlink_to(".")  # DIR/loop -> DIR
    (corpus / "back").symlink_to("../corpus")  # two loops at once: 2^40 paths to glob
    (corpus / "sub" / "up").symlink_to("..")  # a loop one level down
    (corpus / "same.txt").symlink_to("a.txt")  # a second name for a real file
    tmp_path.joinpath("elsewhere").mkdir()
    tmp_path.joinpath("elsewhere", "c.txt").write_text("third " * 40)
    (corpus / "out").symlink_to(tmp_path / "elsewhere")  # a link that does not loop
    for pattern in ("**", "**/*.txt"):
        files = _within(lambda p=pattern: documents._text_files(str(corpus / p)))
        assert files == [
            str(corpus / "a.txt"),
            str(corpus / "out/c.txt"),
            str(corpus / "sub/b.txt"),
        ]
    config = make_config(tmp_path, path=str(corpus / "**"), tokenizer="byte")
    train, held_out = _load_within(config)
    assert train.size + held_out.size == len("first " * 40 + "third " * 40 + "second " * 40)


def test_invalid_utf8_is_counted_in_one_line_and_refused_past_the_threshold(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "good.txt").write_text("plain text " * 2000)  # 22,000 bytes
    (corpus / "some.txt").write_bytes(b"caf\xe9 " * 4 + b"ok " * 100)  # 4 invalid bytes
    config = make_config(tmp_path, path=str(corpus), tokenizer="byte")
    train, held_out = loader.load_tokens(config, "")
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("4 invalid UTF-8 sequences in 1 of the corpus's files"), line
    assert f"most in {corpus / 'some.txt'}: 4" in line and "replaced by U+FFFD" in line
    # Each becomes U+FFFD, three bytes: the stream says what was read.
    assert train.size + held_out.size == 22000 + 4 * 7 + 300
    # 30,000 Latin-1 bytes are not UTF-8 text: refused, and nothing cached.
    (corpus / "latin1.txt").write_bytes("é".encode("latin-1") * 30000)
    config = make_config(
        tmp_path, path=str(corpus), tokenizer="byte", cache_dir=str(tmp_path / "c2")
    )
    with pytest.raises(
        loader.DataError, match=r"30004 invalid UTF-8 .* data.max_invalid_utf8=0.001"
    ):
        loader.load_tokens(config, "")
    assert not list((tmp_path / "c2").glob("tokens-*"))
    config.data.max_invalid_utf8 = 1.0  # taken as it is, when asked
    train, held_out = loader.load_tokens(config, "")
    assert "30004 invalid UTF-8 sequences in 2 of the corpus's files" in capsys.readouterr().err


# ---------------------------------------------------------------- packed rows


def packed_config(tmp_path, mode, seq_len=32, batch=4):
    c = make_config(tmp_path, packing=mode, reset_positions=True)
    c.train.update(seq_len=seq_len, global_batch_size=batch)
    return c


def take_all(it, n):
    return [next(it) for _ in range(n)]


def test_concat_rows_are_todays_rows_with_their_documents(tmp_path):
    stream, _, t = loader.read_corpus(packed_config(tmp_path, "concat"))
    none = take_all(loader.train_iterator(packed_config(tmp_path, "none"), stream, EVERY_ROW), 6)
    concat = take_all(
        loader.train_iterator(packed_config(tmp_path, "concat"), stream, EVERY_ROW), 6
    )
    assert all(set(b) == {"tokens"} for b in none)
    for a, b in zip(none, concat, strict=True):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])  # bit for bit
        assert set(b) == {"tokens", "documents", "positions"}
        # A token after <|endoftext|> starts a new document: ids step there, and only there.
        after_end = b["tokens"][:, :-1] == t.eot_id
        np.testing.assert_array_equal(np.diff(b["documents"]) == 1, after_end)
        assert np.all(b["positions"][:, 1:][after_end] == 0)


def paragraphs_config(tmp_path, mode):
    """A JSON lines corpus of the email package's paragraphs: many documents shorter than
    a row, some longer."""
    texts = [open(f, encoding="utf-8").read() for f in documents._text_files(EMAIL)]
    lines = [json.dumps({"text": p}) for t in texts for p in t.split("\n\n") if p.strip()]
    (tmp_path / "paragraphs.jsonl").write_text("\n".join(lines))
    c = packed_config(tmp_path, mode)
    c.data.update(source="jsonl", path=str(tmp_path / "paragraphs.jsonl"), text_key="text")
    return c


EMAIL = os.path.join(STDLIB, "email", "*.py")


def test_best_fit_serves_every_document_token_once_an_epoch(tmp_path):
    config = paragraphs_config(tmp_path, "best_fit")
    stream, _, t = loader.read_corpus(config)
    tokens, starts = np.asarray(stream.tokens), np.asarray(stream.starts)
    num_rows, _ = loader._rows(config, stream)
    batches = take_all(loader.train_iterator(config, stream, EVERY_ROW), -(-num_rows // 4))
    epoch = {k: np.concatenate([b[k] for b in batches])[:num_rows] for k in batches[0]}
    real = epoch["tokens"][epoch["documents"] > 0]
    np.testing.assert_array_equal(np.sort(real), np.sort(tokens))  # each token once
    # Each document's last piece ends with its <|endoftext|> (the split may cut the last).
    lengths = np.diff([*starts, tokens.size])
    assert 100 < np.count_nonzero(lengths <= 33) < len(lengths)  # short and long ones
    ends = np.diff(epoch["documents"], append=0) != 0  # each run's last token
    ended = np.count_nonzero(tokens[np.r_[starts[1:], tokens.size] - 1] == t.eot_id)
    assert np.count_nonzero(epoch["tokens"][ends & (epoch["documents"] > 0)] == t.eot_id) == ended
    assert np.all(epoch["documents"][:, 0] == 1) and np.all(epoch["positions"][:, 0] == 0)
    # Best fit leaves little padding: under 5% of the epoch's tokens here.
    assert np.count_nonzero(epoch["documents"] == 0) < 0.05 * epoch["documents"].size


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
def test_packed_iterator_state_restores_exactly(tmp_path, mode):
    config = packed_config(tmp_path, mode)
    stream, _, _ = loader.read_corpus(config)
    it = loader.train_iterator(config, stream, EVERY_ROW)
    take_all(it, 5)
    state = it.get_state()
    expected = take_all(it, 7)
    restored = loader.train_iterator(config, stream, EVERY_ROW)
    restored.set_state(json.loads(json.dumps(state)))  # as a checkpoint keeps it
    for a, b in zip(expected, take_all(restored, 7), strict=True):
        assert set(a) == set(b) == {"tokens", "documents", "positions"}
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


@pytest.mark.parametrize("mode", ["concat", "best_fit"])
def test_packed_eval_batches_are_packed_rows_of_the_held_out_tail(tmp_path, mode):
    config = packed_config(tmp_path, mode, batch=4)
    _, held_out, _ = loader.read_corpus(config)
    evals = loader.eval_batches(config, held_out, 3, EVERY_ROW)
    halves = [loader.eval_batches(config, held_out, 3, r) for r in (slice(0, 2), slice(2, 4))]
    for b, x, y in zip(evals, *halves, strict=True):
        assert {k: v.shape for k, v in b.items()} == {k: (4, 33) for k in b} and len(b) == 3
        for key in b:
            np.testing.assert_array_equal(np.concatenate([x[key], y[key]]), b[key])
    held = set(np.asarray(held_out.tokens).tolist())
    assert set(evals[0]["tokens"][evals[0]["documents"] > 0].tolist()) <= held


def test_identity_counts_document_starts_only_when_packed(tmp_path):
    stream, _, _ = loader.read_corpus(packed_config(tmp_path, "concat"))
    plain = loader.identity(stream.tokens)
    packed = loader.identity(stream.tokens, stream.starts)
    moved = loader.identity(
        stream.tokens, stream.starts + np.r_[0, np.ones(len(stream.starts) - 1, int)]
    )
    assert (
        plain["tokens"] == packed["tokens"]
        and len({plain["digest"], packed["digest"], moved["digest"]}) == 3
    )


def test_a_global_batch_holds_every_key_sharded_over_data(tmp_path):
    mesh = sharding.make_mesh(4, 2)
    config = packed_config(tmp_path, "best_fit", batch=8)
    stream, _, _ = loader.read_corpus(config)
    local = next(loader.train_iterator(config, stream, EVERY_ROW))
    batch = loader.global_batch(local, mesh, 8)
    for key, rows in local.items():
        assert batch[key].sharding.spec == jax.sharding.PartitionSpec("data")
        np.testing.assert_array_equal(np.asarray(batch[key]), rows)
