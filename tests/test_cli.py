"""Bad input to the command-line tools: one clear line, exit code 2, no traceback, no files."""

import os
from pathlib import Path

import pytest
from helpers import run_python

ROOT = Path(__file__).resolve().parent.parent


def run(args, cwd):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return run_python(*args, env=env, cwd=cwd)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--config", "nope.py"], "no such file"),
        (["--config", "tiny", "--config.train.stepz=3"], "train.stepz: unknown key"),
        (["--config", "tiny", "--config.train.steps=abc"], "expected a int"),
        (["--config", "tiny", "--config.pipeline.schedule=2f2b"], "pipeline.schedule='2f2b'"),
        (["--config", "tiny", "--config.model.num_heads=3"], "model.num_heads=3"),
        (["--config", "tiny", "--config.pipeline.segments=999"], "pipeline.segments=999"),
        (["--config", "tiny", "--config.train.learning_rate=-1"], "train.learning_rate=-1"),
        (["--config", "tiny", "--config.train.global_batch_size=7"], "global_batch_size=7"),
        (["--config", "tiny", "--config.mesh.stage=3"], "mesh.stage"),
        (["--config", "tiny", "--compile_only", "--topology", "v5p-12"], "counts TensorCores"),
        (["--config", "tiny", "--compile_only", "--topology", "v9-8"], "GPU system name"),
        (["--config", "tiny", "--topology", "v5p-16"], "needs --compile_only"),
        (
            ["--config", "tiny", "--compile_only", "--topology", "v5p-8"],
            "mesh.data * mesh.stage = 8 but --topology v5p-8: 4 chips (v5p:2x2x1, megacore) "
            "has 4 chips;",
        ),
        (
            [
                "--config",
                "tiny",
                "--compile_only",
                "--topology",
                "h100-8",
                "--config.mesh.data=3",
                "--config.mesh.stage=-1",
                "--config.train.global_batch_size=24",
            ],
            "mesh.data=3 does not divide the 8 GPUs of --topology h100-8: 8 GPUs (NVIDIA H100",
        ),
        (
            ["--config", "tiny", "--config.data.source=text", "--config.data.path=/no/such"],
            "data.path='/no/such'",
        ),
        ([], "--config"),
        (["--config", "tiny", "--bogus"], "unknown argument '--bogus'"),
    ],
)
def test_bad_input_gives_one_line_and_exit_2(tmp_path, args, expected):
    workdir = tmp_path / "run"
    result = run([str(ROOT / "train.py"), *args, "--workdir", str(workdir)], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr
    assert not workdir.exists()


def test_bare_config_name_is_found_in_configs(tmp_path):
    """`--config gpt_1b.py` from any directory resolves to configs/gpt_1b.py (checked by
    making that config invalid and seeing the complaint about its own value)."""
    result = run(
        [str(ROOT / "train.py"), "--config", "gpt_1b.py", "--config.model.num_heads=5"],
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert "model.num_heads=5 must divide model.d_model=2048" in result.stderr


# Unpacked rows are the harder case's subset (and `verify` runs unpacked in test_hf_train):
# under make test-all.
@pytest.mark.parametrize("packing", [pytest.param("none", marks=pytest.mark.slow), "best_fit"])
def test_verify_accepts_a_correct_pipeline_and_writes_nothing(tmp_path, packing):
    """A check writes only to the token cache: it used to write ./runs/tiny/tokenizer.json
    (a BPE here, the tokenizer it kept a copy of). Packed, it checks packed rows: a corpus
    of short files, many documents a row."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(400):
        (corpus / f"{i}.txt").write_text(f"def f(x):\n    return x + {i}\n" * (1 + i % 7))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    overrides = {
        "model.num_layers": 4,
        "model.d_model": 32,
        "model.d_ff": 64,
        "model.vocab_size": 300,
        "data.tokenizer": "bpe",
        "data.source": "text",
        "data.path": corpus,
        "data.cache_dir": tmp_path / "cache",
        "data.packing": packing,
        "train.seq_len": 32,
        "pipeline.segments": 3,
        "pipeline.partition": "flops",
    }
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    keys = [f"--config.{k}={v}" for k, v in overrides.items()]
    result = run_python("-m", "seqpipe.tools.verify", "--config", "tiny", *keys, env=env, cwd=cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("OK")
    assert ("on packed rows" in result.stdout) == (packing != "none"), result.stdout
    assert os.listdir(cwd) == []


# Every invalid input of issue 7, on the tiny config of test_train: the overrides, and what
# the one line must say (naming the key). `{tmp}` is a folder of broken data files.
PIPE = "mesh.data=2 mesh.stage=4 pipeline.schedule=seq1f1b pipeline.microbatches=2"
INVALID = {
    "mesh axis below 1": ("mesh.data=0", "mesh.data=0 must be at least 1"),
    "mesh product not the device count": ("mesh.data=4", "mesh.data * mesh.stage = 4 but 8"),
    "mesh axis below -1": ("mesh.stage=-2", "mesh.stage=-2 must be at least 1, or -1"),
    "two mesh axes at -1": (
        "mesh.data=-1 mesh.stage=-1",
        "mesh.data=-1 and mesh.stage=-1: at most one mesh axis can be -1",
    ),
    "mesh axis -1 and a stage count that does not divide the devices": (
        "mesh.data=-1 mesh.stage=3 model.num_layers=6 pipeline.schedule=seq1f1b",
        "mesh.stage=3 does not divide the 8 visible devices (mesh.data=-1 takes what "
        "mesh.stage leaves); set mesh.stage to a divisor of 8",
    ),
    "layers not divisible by stages": (f"{PIPE} model.num_layers=3", "model.num_layers=3 must"),
    "layers not divisible by stages * virtual": (
        f"{PIPE} pipeline.schedule=interleaved_1f1b pipeline.virtual_stages=2",
        "model.num_layers=4 must be divisible by mesh.stage * pipeline.virtual_stages = 8",
    ),
    "heads not dividing d_model": ("model.num_heads=3", "model.num_heads=3 must divide"),
    "batch not divisible by data * microbatches": (
        "train.global_batch_size=12",
        "train.global_batch_size=12 must be a positive multiple of",
    ),
    "interleaved with fewer micro-batches than stages": (
        f"{PIPE} pipeline.schedule=interleaved_1f1b pipeline.virtual_stages=2 model.num_layers=8",
        "pipeline.microbatches=2",
    ),
    "segments below 1": ("pipeline.segments=0", "pipeline.segments=0 must be"),
    "segments above seq_len": ("pipeline.segments=17", "pipeline.segments=17 exceeds"),
    "flops partition below the rounding multiple": (
        f"{PIPE} pipeline.segments=2 pipeline.partition=flops pipeline.partition_multiple=16",
        "pipeline.partition=flops, pipeline.partition_multiple=16: 2 segments of at least 16 "
        "tokens do not fit in 16",
    ),
    "unknown schedule": ("pipeline.schedule=2f2b", "pipeline.schedule='2f2b' is not valid"),
    "unknown partition": ("pipeline.partition=even", "pipeline.partition='even' is not valid"),
    "unknown remat policy": ("pipeline.remat=bogus", "pipeline.remat"),
    "unknown dtype": ("model.dtype=float8", "model.dtype='float8' is not valid"),
    "unknown data source": ("data.source=web", "data.source='web' is not valid"),
    "learning rate not finite": ("train.learning_rate=nan", "train.learning_rate=nan must be"),
    "learning rate negative": ("train.learning_rate=-1", "train.learning_rate=-1.0 must be"),
    "warm-up negative": ("train.warmup_steps=-1", "train.warmup_steps=-1 must be >= 0"),
    "weight decay not finite": ("train.weight_decay=inf", "train.weight_decay=inf must be"),
    "clip negative": ("train.grad_clip=-0.5", "train.grad_clip=-0.5 must be"),
    "Adam decay rate 1": ("train.b2=1.0", "train.b2=1.0 must be in [0, 1)"),
    "steps below 1": ("train.steps=0", "train.steps=0 must be at least 1"),
    "max_bad_steps below 1": ("train.max_bad_steps=0", "train.max_bad_steps=0 must be"),
    "data path missing": (
        "data.source=text data.path={tmp}/missing.txt",
        "data.path='{tmp}/missing.txt' matches no text files",
    ),
    "data path not given": ("data.source=text", "data.source='text' needs data.path"),
    "token file missing": (
        "data.source=tokens data.path={tmp}/no.bin data.tokenizer=bpe",
        "is not a file",
    ),
    "text file empty": ("data.source=text data.path={tmp}/empty.txt", "is empty"),
    "token file empty": (
        "data.source=tokens data.path={tmp}/empty.bin data.tokenizer=bpe",
        "data.path='{tmp}/empty.bin' is empty",
    ),
    # Exists and cannot be read, even by root (EIO at offset 0): as real as a chmod 000 file.
    "data unreadable": ("data.source=text data.path=/proc/self/mem", "cannot read /proc/self/mem"),
    "token file size not a multiple of the dtype": (
        "data.source=tokens data.path={tmp}/odd.bin data.tokenizer=bpe",
        "size is not a multiple of data.token_dtype=uint16",
    ),
    "token ids not below vocab_size": (
        "data.source=tokens data.path={tmp}/big_ids.bin data.tokenizer=bpe",
        "holds token id 300 >= model.vocab_size=256",
    ),
    "tokenizer file not a tokenizer": (
        "data.source=tokens data.path={tmp}/ids.bin data.tokenizer=bpe "
        "data.tokenizer_path={tmp}/garbage.json",
        "data.tokenizer_path='{tmp}/garbage.json' is not a tokenizers JSON file",
    ),
    "tokenizer file larger than vocab_size": (
        "data.source=tokens data.path={tmp}/ids.bin data.tokenizer=bpe "
        "data.tokenizer_path={tmp}/bpe300.json model.vocab_size=290",
        "data.tokenizer_path={tmp}/bpe300.json has ids up to 299 but model.vocab_size=290; "
        "set model.vocab_size >= 300",
    ),
    "tokenizer file missing": (
        "data.source=tokens data.path={tmp}/ids.bin data.tokenizer=bpe "
        "data.tokenizer_path={tmp}/none.json",
        "data.tokenizer_path='{tmp}/none.json' does not exist",
    ),
    # Keys that were never checked (issue 17): each ran, or failed after writing.
    "rope_base not finite": ("model.rope_base=nan", "model.rope_base=nan must be > 0"),
    "rope_base zero": ("model.rope_base=0", "model.rope_base=0.0 must be > 0"),
    "init_std not finite": ("model.init_std=nan", "model.init_std=nan must be > 0"),
    "init_std negative": ("model.init_std=-5", "model.init_std=-5.0 must be > 0"),
    "seed negative": ("train.seed=-1", "train.seed=-1 must be in [0, 2**32) (an integer)"),
    "seed above 2**64": ("train.seed=18446744073709551616", "train.seed=18446744073709551616"),
    "steps a bool": ("train.steps=True", "train.steps=True is of type bool, not an integer"),
    "eval_every with no eval batches": (
        "train.eval_every=1 train.eval_batches=0",
        "train.eval_every=1 with train.eval_batches=0 would never evaluate",
    ),
    "byte tokenizer with a token file": (
        "data.source=tokens data.path={tmp}/ids.bin data.tokenizer=byte",
        "data.tokenizer=byte does nothing with data.source=tokens",
    ),
    "binary file as text": (
        "data.source=text data.path={tmp}/ids.bin",
        "data.path='{tmp}/ids.bin' is a binary file, not text",
    ),
    "seq_len above what the data allows": (
        "data.source=text data.path={tmp}/short.txt train.seq_len=64",
        "the corpus has 100 tokens: too few",
    ),
    # Documents in (issue 35).
    "JSON line that does not parse": (
        "data.source=jsonl data.path={tmp}/bad.jsonl",
        "{tmp}/bad.jsonl:2 is not valid JSON (Expecting ',' delimiter); fix it, or set "
        "data.skip_bad_lines=True",
    ),
    "JSON line without the text key": (
        "data.source=jsonl data.path={tmp}/bad.jsonl data.text_key=body",
        "{tmp}/bad.jsonl:1 has no 'body' field (keys ['text']); set data.text_key",
    ),
    "parquet without the text column": (
        "data.source=parquet data.path={tmp}/nocol.parquet",
        "{tmp}/nocol.parquet has no column 'text' (its columns: ['body'])",
    ),
    "corpus of empty documents": (
        "data.source=jsonl data.path={tmp}/empty.jsonl",
        "the corpus (1 jsonl files) holds no document",
    ),
    "eod_id with a text source": (
        "data.source=text data.path={tmp}/short.txt data.eod_id=3",
        "data.eod_id=3 is for data.source=tokens",
    ),
    "text_key with a source without fields": (
        "data.text_key=body",
        "data.text_key='body' is for data.source=jsonl or parquet",
    ),
    "eod_id not below vocab_size": (
        "data.source=tokens data.path={tmp}/ids.bin data.tokenizer=bpe data.eod_id=256",
        "data.eod_id=256 is not below model.vocab_size=256",
    ),
    "token file packed without an eod_id": (
        "data.source=tokens data.path={tmp}/ids.bin data.tokenizer=bpe data.packing=concat",
        "data.packing=concat with data.source=tokens needs data.eod_id",
    ),
    "token file without its eod_id": (
        "data.source=tokens data.path={tmp}/ids.bin data.tokenizer=bpe data.eod_id=300 "
        "model.vocab_size=512",
        "holds no data.eod_id=300, so no document ends",
    ),
    "unknown packing": ("data.packing=greedy", "data.packing='greedy' is not valid"),
}
# Run through a real train.py process by default; the rest in the slow target (their
# in-process twins run by default).
BY_PROCESS = {
    "mesh product not the device count",
    "mesh axis -1 and a stage count that does not divide the devices",
    "interleaved with fewer micro-batches than stages",
    "learning rate not finite",
    "data unreadable",
    "token file size not a multiple of the dtype",
    "tokenizer file not a tokenizer",
    "seq_len above what the data allows",
    "seed negative",
    "JSON line that does not parse",
}


@pytest.fixture(scope="module")
def broken_data(tmp_path_factory):
    import numpy as np

    from seqpipe.data import tokenizer

    d = tmp_path_factory.mktemp("data")
    (d / "empty.txt").write_text("")
    (d / "empty.bin").write_bytes(b"")
    (d / "short.txt").write_text("0123456789" * 10)
    (d / "odd.bin").write_bytes(b"\1\0\2")
    np.array([1, 2, 300] * 100, np.uint16).tofile(d / "big_ids.bin")
    np.arange(1000, dtype=np.uint16).__mod__(256).astype(np.uint16).tofile(d / "ids.bin")
    (d / "garbage.json").write_text("this is not a tokenizer\n")
    (d / "bad.jsonl").write_text('{"text": "a line"}\n{"text": "no comma" "here"}\n')
    (d / "empty.jsonl").write_text('{"text": ""}\n')
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["some text"]}), d / "nocol.parquet")
    bpe = tokenizer.train_bpe([Path(os.__file__).read_text()], 300)  # real text: all merges
    assert bpe.vocab_size == 300
    bpe.hf.save(str(d / "bpe300.json"))
    return d


def _invalid_argv(name: str, data_dir, workdir) -> tuple[list[str], str]:
    from helpers import tiny_args

    overrides, expected = (x.replace("{tmp}", str(data_dir)) for x in INVALID[name])
    pairs = dict(kv.split("=", 1) for kv in overrides.split())
    pairs.setdefault("data.cache_dir", str(data_dir / "cache"))
    return ["--workdir", str(workdir), *tiny_args(**pairs)], expected


def _check_refusal(code: int, stderr: str, expected: str, workdir: Path) -> None:
    assert code == 2, stderr
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert expected in lines[0], lines[0]
    assert not workdir.exists()


@pytest.mark.parametrize("name", sorted(INVALID))
def test_every_invalid_input_is_refused_in_process(name, broken_data, tmp_path, capsys):
    """train.py's main() in this process: exit 2, one line naming the key, nothing written."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
    train_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_cli)
    argv, expected = _invalid_argv(name, broken_data, tmp_path / "run")
    with pytest.raises(SystemExit) as exit_info:
        train_cli.main(argv)
    _check_refusal(exit_info.value.code, capsys.readouterr().err, expected, tmp_path / "run")


@pytest.mark.parametrize(
    "name",
    [n if n in BY_PROCESS else pytest.param(n, marks=pytest.mark.slow) for n in sorted(INVALID)],
)
def test_every_invalid_input_is_refused_by_train_py(name, broken_data, tmp_path):
    argv, expected = _invalid_argv(name, broken_data, tmp_path / "run")
    # 8 CPU devices whatever the mesh, as on a machine with 8 accelerators.
    result = run_python(str(ROOT / "train.py"), *argv, cwd=tmp_path)
    _check_refusal(result.returncode, result.stderr, expected, tmp_path / "run")


# A config file that sets an integer depth, as a user tuning memory would.
DEEP = """from seqpipe.run.config import base_config


def get_config():
    c = base_config()
    c.mesh.update(data=2, stage=4)
    c.pipeline.update(schedule="seq1f1b", microbatches=4, segments=4, inflight={inflight!r})
    return c
"""


@pytest.mark.parametrize(
    "in_file, flag, expected",
    [
        (6, "full", "full"),
        (6, "minimal", "minimal"),
        (6, "9", 9),
        ("full", "6", 6),
        ("minimal", "full", "full"),
    ],
)
def test_inflight_overrides_either_way_between_a_name_and_an_integer(
    tmp_path, in_file, flag, expected
):
    """`pipeline.inflight` takes a name or an integer: the flag decides which, not the type
    of the value in the file (an integer there once made `=full` 'expected a int')."""
    from seqpipe.run import cli

    path = tmp_path / "deep.py"
    path.write_text(DEEP.format(inflight=in_file))
    argv = ["--config", str(path), f"--config.pipeline.inflight={flag}"]
    config, _ = cli.load_or_exit(argv, "train.py")
    assert config.pipeline.inflight == expected
    assert type(config.pipeline.inflight) is type(expected)


def test_a_lost_peer_line_names_the_process_and_the_newest_checkpoint(tmp_path):
    """What a survivor says when a collective fails for a lost peer (the gloo error)."""
    from seqpipe.host import peers
    from seqpipe.train import checkpoint

    ckpt = checkpoint.directory(tmp_path)
    (ckpt / "4").mkdir(parents=True)
    (ckpt / "6.orbax-checkpoint-tmp-1").mkdir()  # a save cut short: not intact
    peers._context.update(process=0, processes=2)
    peers.watch(ckpt)
    try:
        error = RuntimeError("INTERNAL: Gloo ReduceScatter failed: Connection closed by peer")
        assert peers.is_lost_peer(error)
        assert not peers.is_lost_peer(RuntimeError("RESOURCE_EXHAUSTED: out of memory"))
        line = peers.lost_message(str(error))
        assert line.startswith("lost process 1 of the run (INTERNAL: Gloo ReduceScatter"), line
        assert f"the newest intact checkpoint is step 4 in {ckpt}" in line
        assert peers.lost_message("Task 3 heartbeat timeout").startswith("lost process 3 ")
    finally:
        peers._context.update(process=0, processes=1, checkpoints=None)
