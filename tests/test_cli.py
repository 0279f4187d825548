"""Bad input to the command-line tools: one clear line, exit code 2, no traceback, no files."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(args, cwd):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


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


def test_verify_accepts_a_correct_pipeline(tmp_path):
    result = run(
        [
            "-m",
            "seqpipe.verify",
            "--config",
            "tiny",
            "--workdir",
            str(tmp_path),
            "--config.model.num_layers=4",
            "--config.model.d_model=32",
            "--config.model.d_ff=64",
            "--config.data.tokenizer=byte",
            "--config.model.vocab_size=256",
            "--config.train.seq_len=32",
            "--config.pipeline.segments=3",
            "--config.pipeline.partition=flops",
        ],
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout
