"""`model.attention=auto` on a TPU: splash where its step fits the device, else blockwise,
saying which and why (`seqpipe.run.attention_auto`)."""

import importlib.util
from pathlib import Path

import pytest
from helpers import needs_libtpu

from seqpipe.pipeline import spec
from seqpipe.run import attention_auto
from seqpipe.run import config as config_lib
from seqpipe.run.remat_auto import HEADROOM
from seqpipe.targets import topology
from seqpipe.train import aot

GiB = 2**30


def train_script():
    """train.py as a module (its --compile_only summary line)."""
    path = Path(__file__).resolve().parent.parent / "train.py"
    spec = importlib.util.spec_from_file_location("train_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TPU_ENV = {
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    "TPU_ACCELERATOR_TYPE": "v5p-8",
    "TPU_WORKER_HOSTNAMES": "localhost",
}


def compiles(peaks: dict[str, float]):
    """A `peak_of` over `peaks` (GiB) that records what it was asked to compile."""
    asked = []

    def peak_of(name):
        asked.append(name)
        return int(peaks[name] * GiB)

    return peak_of, asked


def test_on_a_tpu_auto_prefers_splash_and_falls_back_to_blockwise():
    first = lambda platform: spec.attention_on("auto", platform)  # noqa: E731
    assert attention_auto.candidates(first("tpu")) == ("splash", "blockwise")
    assert attention_auto.candidates(first("cpu")) == ("blockwise",)
    assert attention_auto.candidates(first("cuda")) == ("blockwise",)


def test_splash_that_fits_is_kept_without_compiling_blockwise():
    peak_of, asked = compiles({"splash": 50.0, "blockwise": 53.8})
    choice = attention_auto.choose(peak_of, ("splash", "blockwise"), 95 * GiB)
    assert (choice.name, asked) == ("splash", ["splash"])
    assert choice.line() == (
        "auto -> splash (fits; peak GiB: splash 50.0; limit 85.5 GiB (90% of 95.0))"
    )


def test_splash_that_does_not_fit_gives_way_to_blockwise_and_says_why():
    """The 30B at 64k on v5p-128 (README): splash 109.8 GiB a chip, blockwise 53.8."""
    peak_of, asked = compiles({"splash": 109.8, "blockwise": 53.8})
    choice = attention_auto.choose(peak_of, ("splash", "blockwise"), 95 * GiB)
    assert (choice.name, asked) == ("blockwise", ["splash", "blockwise"])
    assert choice.line() == (
        "auto -> blockwise (fits; peak GiB: splash 109.8, blockwise 53.8; "
        "limit 85.5 GiB (90% of 95.0))"
    )


def test_when_neither_fits_the_smaller_is_taken():
    peak_of, _ = compiles({"splash": 120.0, "blockwise": 90.0})
    choice = attention_auto.choose(peak_of, ("splash", "blockwise"), 95 * GiB)
    assert choice.name == "blockwise" and choice.line().startswith("auto -> blockwise (least;")
    assert 90 * GiB > HEADROOM * 95 * GiB


# A step where splash keeps more than blockwise: remat none, so every layer keeps splash's
# residuals for the whole micro-batch (the 30B's case, at 4 layers of width 512). With 8
# heads of 64 (libtpu 0.0.50, jax 0.12) splash's step needs 577 MB and blockwise's 380;
# with 4 heads of 128 splash's needed 415 and blockwise's 427, and no budget split them.
NO_REMAT = {
    "model.vocab_size": 2048,
    "model.num_layers": 4,
    "model.d_model": 512,
    "model.num_heads": 8,
    "model.d_ff": 2048,
    "model.dtype": "bfloat16",
    "mesh.data": 1,
    "mesh.stage": 4,
    "pipeline.schedule": "seq1f1b",
    "pipeline.microbatches": 4,
    "pipeline.segments": 4,
    "pipeline.inflight": "minimal",
    "pipeline.remat": "none",
    "train.global_batch_size": 4,
    "train.seq_len": 4096,
}


@pytest.mark.slow
@needs_libtpu
def test_a_tpu_step_whose_splash_does_not_fit_compiles_with_blockwise(monkeypatch):
    """Compiled for a v5p-8: with room, auto keeps splash (one compile); with a budget
    between splash's peak and blockwise's, it takes blockwise and the report says why."""
    for key, value in TPU_ENV.items():
        monkeypatch.setenv(key, value)
    devices = topology.devices(topology.parse("v5p-8"))
    overrides = {key: str(value) for key, value in NO_REMAT.items()}
    config = config_lib.load("tiny", {**overrides, "model.attention": "auto"})
    roomy = aot.compile_only(aot.resolve(config, devices, 95 * GiB))
    assert roomy["attention"] == "splash" and list(roomy["attention_auto"]["peaks"]) == ["splash"]
    blockwise = attention_auto.with_attention(config, "blockwise")
    blockwise = aot.compile_only(aot.resolve(blockwise, devices))
    splash, block = roomy["peak_memory_per_device_bytes"], blockwise["peak_memory_per_device_bytes"]
    assert block < splash  # else no budget splits them
    budget = int((splash + block) / 2 / HEADROOM)
    result = aot.compile_only(aot.resolve(config, devices, budget))
    assert result["attention"] == "blockwise"
    assert result["attention_auto"]["peaks"] == {"splash": splash, "blockwise": block}
    assert result["peak_memory_per_device_bytes"] == block
    line = train_script().summary(result)
    assert f"blockwise attention ({result['attention_auto']['line']})" in line
    assert result["attention_auto"]["line"].startswith("auto -> blockwise (fits; peak GiB: splash")
