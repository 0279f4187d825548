"""Compiling for a Cloud TPU slice on a machine without TPUs: slice names, libtpu's
compile-only devices, and train.py --compile_only --topology end to end."""

import json
import os
from pathlib import Path

import pytest
from helpers import needs_libtpu

from seqpipe.targets import hlo, topology

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "name, chips, shape, config",
    [
        ("v4-8", 4, (2, 2, 1), "megacore"),
        ("v4-16", 8, (2, 2, 2), "megacore"),
        ("v4-4096", 2048, (8, 16, 16), "megacore"),
        ("v5p-8", 4, (2, 2, 1), "megacore"),
        ("v5p-16", 8, (2, 2, 2), "megacore"),
        ("v5p-64", 32, (2, 4, 4), "megacore"),
        ("v5p-128", 64, (4, 4, 4), "megacore"),
        ("v5p-256", 128, (4, 4, 8), "megacore"),
        ("v5p-8192", 4096, (16, 16, 16), "megacore"),
        ("v5litepod-1", 1, (1, 1), "default"),
        ("v5litepod-16", 16, (4, 4), "default"),
        ("v5e-8", 8, (2, 4), "default"),
        ("v6e-4", 4, (2, 2), "default"),
        ("v6e-32", 32, (4, 8), "default"),
        ("v6e-256", 256, (16, 16), "default"),
    ],
)
def test_slice_names_map_to_chips_and_torus_shapes(name, chips, shape, config):
    s = topology.parse(name)
    assert (s.chips, s.shape, s.spec.chip_config) == (chips, shape, config)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("v5p-12", "v5p-N counts TensorCores (2 a chip); supported N: 8, 16,"),
        ("v5p-384", "supported N: 8, 16, 32"),  # a real shape (4x4x12), not a power of two
        ("v4-4", "supported N: 8, 16"),
        ("v5litepod-2", "v5litepod-N counts chips; supported N: 1, 4, 8"),
        ("v6e-512", "supported N: 1, 4, 8, 16, 32, 64, 128, 256"),
        ("v3-8", "is not a TPU slice or GPU system name"),
        ("tpu", "is not a TPU slice or GPU system name"),
    ],
)
def test_unsupported_slice_names_are_refused_with_what_is_supported(name, expected):
    with pytest.raises(ValueError) as info:
        topology.parse(name)
    assert "\n" not in str(info.value) and expected in str(info.value)


def test_collectives_are_counted_by_instruction_not_by_name():
    text = "\n".join(
        [
            "%all-reduce.1 = f32[4]{0} all-reduce(f32[4]{0} %p), replica_groups={}",
            "%ag = (f32[2], f32[4]) all-gather-start(f32[2] %x), dimensions={0}",
            "%agd = f32[4] all-gather-done((f32[2], f32[4]) %ag)",
            "%cp = bf16[8] collective-permute(bf16[8] %y), source_target_pairs={{0,1}}",
            "%fusion.all-reduce = f32[4] fusion(f32[4] %all-reduce.1), kind=kLoop",
        ]
    )
    assert hlo.count_collectives(text) == {
        "all-reduce": 1,
        "all-gather": 1,
        "collective-permute": 1,
        "all-to-all": 0,
        "reduce-scatter": 0,
    }


@needs_libtpu
def test_every_supported_slice_is_a_topology_libtpu_describes(monkeypatch):
    """Every name parse accepts gives libtpu's compile-only devices: one a chip, of the
    generation's kind (a shape libtpu does not know would raise)."""
    for key, value in [
        ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
        ("TPU_ACCELERATOR_TYPE", "v5p-8"),
        ("TPU_WORKER_HOSTNAMES", "localhost"),
    ]:
        monkeypatch.setenv(key, value)
    for generation in topology.GENERATIONS:
        for size in topology.supported_sizes(generation):
            s = topology.parse(f"{generation}-{size}")
            devices = topology.devices(s)
            assert len(devices) == s.chips, s
            assert {d.device_kind for d in devices} == {s.spec.device_kind}, s


@pytest.mark.oldest  # also on the oldest supported release
@needs_libtpu
def test_compile_only_for_a_tpu_slice_reports_memory_per_chip_and_collectives(tmp_path):
    """The tiny model pipelined 4 ways on v5p-16 (8 chips); mesh.data=-1 takes the other
    2. Memory comes from the TPU compiler; the pipeline's sends and the gradients' sums
    are in the program."""
    from helpers import run_python, tiny_args

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    args = tiny_args(
        **{
            "mesh.data": "-1",
            "mesh.stage": "4",
            "pipeline.schedule": "seq1f1b",
            "pipeline.microbatches": "2",
            "pipeline.segments": "2",
        }
    )
    workdir = tmp_path / "never"
    args += ["--compile_only", "--topology", "v5p-16", "--workdir", str(workdir)]
    proc = run_python("train.py", *args, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr  # libtpu's warnings are kept out
    summary, report = proc.stdout.strip().splitlines()
    result = json.loads(report)
    assert summary.startswith("v5p-16: 8 chips (v5p:2x2x2, megacore), mesh 2x4; per chip:")
    assert result["device_kind"] == "TPU v5" and result["chips"] == 8
    assert result["mesh"] == {"data": 2, "stage": 4, "tensor": 1}
    assert result["chips"] == result["mesh"]["data"] * result["mesh"]["stage"]
    total = result["memory_per_device_bytes"]["total"]
    assert 0 < total < result["hbm_per_chip_bytes"] == 95 * 2**30 and result["fits"]
    assert result["collectives"]["collective-permute"] > 0  # stage to stage
    assert result["collectives"]["all-reduce"] > 0  # gradients over data replicas
    assert not workdir.exists()


def test_compile_only_for_a_tpu_slice_with_tensor_parallelism_and_a_step_that_does_not_fit():
    """v5p-16 split 2 x 2 x 2 (tensor parallelism on a torus) compiles and fits; a step
    whose logits need more than a chip's HBM is the compiler's refusal, in one line, exit 1
    (without a pipeline: also the TPU's `auto` attention outside a shard_map)."""
    from helpers import run_python, tiny_args

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    tensor = {
        "mesh.data": "-1",
        "mesh.stage": "2",
        "mesh.tensor": "2",
        "pipeline.schedule": "seq1f1b",
        "pipeline.microbatches": "2",
        "pipeline.segments": "2",
    }
    # Float32 logits of 32768 tokens over a vocabulary of 2^20, whole: 128 GiB a chip.
    huge = {
        "mesh.data": "8",
        "model.vocab_size": str(2**20),
        "train.seq_len": "32768",
        "model.loss_chunk": "0",
    }
    outs = []
    for overrides in (tensor, huge):
        args = [*tiny_args(**overrides), "--compile_only", "--topology", "v5p-16"]
        outs.append(run_python("train.py", *args, env=env))
    fits, too_big = outs
    assert fits.returncode == 0, fits.stderr
    summary, report = fits.stdout.strip().splitlines()
    assert summary.startswith("v5p-16: 8 chips (v5p:2x2x2, megacore), mesh 2x2x2; per chip:")
    assert json.loads(report)["fits"]
    assert too_big.returncode == 1, too_big.stderr
    line = too_big.stderr.strip()
    assert "\n" not in line and line.startswith("error: does not fit: RESOURCE_EXHAUSTED")


def test_the_tpu_compilers_refusal_gives_the_need():
    """libtpu refuses a step over HBM instead of reporting its peak; its temporaries are a
    lower bound on the peak (the message as libtpu 0.0.50 words it, from tiny at 65536
    tokens with `xla` attention on a v5p-8)."""
    message = (
        "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total "
        "memory required for HLO temporaries (171.78G) exceeds available HBM (95.73G). "
        "HLO module: jit_train_step."
    )
    assert topology.refused_need(message) == int(171.78 * 2**30)
    terabytes = message.replace("(171.78G)", "(1.28T)")  # llama3_1_8b 2x8x2 zb_h1 `dots`
    assert topology.refused_need(terabytes) == int(1.28 * 2**40)
    assert topology.refused_need("RESOURCE_EXHAUSTED: out of memory on host") is None
