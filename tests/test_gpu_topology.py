"""Compiling for NVIDIA GPUs on a machine without one: system names, the CUDA plugin's
compile-only devices, and train.py --compile_only --topology h200-N end to end (the
Pallas GPU attention kernels lowered through Triton to PTX included)."""

import json
import math
import os
import re
from pathlib import Path

import pytest
from helpers import needs_plugin

from seqpipe.targets import gpu_topology, topology
from seqpipe.tools import step_cost

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "name, model, gpus, shape",
    [
        ("h200", "h200", 1, "1x1x1"),
        ("h200-1", "h200", 1, "1x1x1"),
        ("H100-4", "h100", 4, "1x1x4"),
        ("h200-8", "h200", 8, "1x1x8"),
        ("h200-16", "h200", 16, "1x2x8"),
        ("h100-64", "h100", 64, "1x8x8"),
    ],
)
def test_system_names_map_to_gpus_and_hosts_of_eight(name, model, gpus, shape):
    s = topology.parse(name)
    assert isinstance(s, gpu_topology.System)
    assert (s.model, s.chips, s.topology_name) == (model, gpus, shape)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("h200-12", "h200-N counts GPUs, 8 a host; N is 1, 2, 4 or a multiple of 8"),
        ("h100-0", "N is 1, 2, 4 or a multiple of 8"),
        ("h200-eight", "GPU systems are h100-N or h200-N"),
        ("a100-8", "is not a TPU slice or GPU system name; use one of v4-N"),
    ],
)
def test_an_unknown_system_is_one_line_that_names_the_supported_ones(name, expected):
    with pytest.raises(ValueError) as e:
        topology.parse(name)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_target_config_describes_the_gpu_xla_compiles_for():
    text = gpu_topology.parse("h200-8").target_config()
    assert "device_memory_size: 151397597184" in text  # 141 GiB
    assert "memory_bandwidth: 4800000000000" in text
    assert 'device_description_str: "NVIDIA H200"' in text
    assert "memory_bandwidth: 3352320000000" in gpu_topology.parse("h100").target_config()


def _compile_only(tmp_path, overrides: dict, name: str, env_extra=None):
    from helpers import run_python, tiny_args

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(env_extra or {})
    args = (*tiny_args(**overrides), "--compile_only", "--topology", name)
    return run_python("train.py", *args, "--workdir", str(tmp_path / "never"), env=env)


@needs_plugin
def test_compile_only_for_gpus_reports_memory_per_gpu_and_collectives(tmp_path):
    """The tiny model pipelined 4 ways with tensor parallelism on h200-16 (2 hosts of 8):
    memory from XLA's GPU compiler, sends between stages and sums over replicas."""
    overrides = {
        "mesh.data": "-1",
        "mesh.stage": "4",
        "mesh.tensor": "2",
        "pipeline.schedule": "seq1f1b",
        "pipeline.microbatches": "2",
        "pipeline.segments": "2",
    }
    proc = _compile_only(tmp_path, overrides, "h200-16")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr
    summary, report = proc.stdout.strip().splitlines()
    assert summary.startswith("h200-16: 16 GPUs (NVIDIA H200, 2 hosts of 8), mesh 2x4x2; per GPU:")
    result = json.loads(report)
    assert result["device_kind"] == "NVIDIA H200" and result["chips"] == 16
    assert result["topology"] == "1x2x8"
    assert result["mesh"] == {"data": 2, "stage": 4, "tensor": 2}
    total = result["memory_per_device_bytes"]["total"]
    assert 0 < total < result["hbm_per_chip_bytes"] == 151397597184 and result["fits"]
    assert result["collectives"]["collective-permute"] > 0
    assert result["collectives"]["all-reduce"] > 0
    assert not (tmp_path / "never").exists()


@needs_plugin
def test_the_pallas_gpu_kernels_compile_to_ptx_for_an_h100(tmp_path):
    """What interpret mode cannot show: Triton lowers the forward, dK/dV and dq kernels
    for sm_90 (shared memory, layouts), as a GPU run would, and they are in the program.
    `remat=auto` fits the H100's budget (first policy tried: none)."""
    overrides = {
        "mesh.data": "1",
        "mesh.stage": "2",
        "model.attention": "pallas_gpu",
        "pipeline.remat": "auto",  # an H100's budget: the tiny model keeps everything
        "pipeline.schedule": "seq1f1b",
        "pipeline.microbatches": "2",
        "pipeline.segments": "2",
    }
    dump = tmp_path / "dump"
    # Of the kernels' LLVM IR and PTX, jax 0.12's XLA dumps only the stages this regex
    # names (none without it); 0.10.2's dumped all, and takes the flag too.
    flags = f"--xla_dump_to={dump} --xla_dump_emitter_re=ptx"
    proc = _compile_only(tmp_path, overrides, "h100-2", {"XLA_FLAGS": flags})
    assert proc.returncode == 0, proc.stderr
    assert "pallas_gpu attention; remat none (auto)" in proc.stdout
    entries = {
        line.split()[2].split("(")[0]
        for ptx in dump.glob("*.ptx")
        for line in ptx.read_text().splitlines()
        if line.startswith(".visible .entry segment_attention")
    }
    kernels = {e.split("__")[0] for e in entries}
    assert kernels == {"segment_attention_forward", "segment_attention_dkv", "segment_attention_dq"}


@needs_plugin
def test_without_a_pipeline_the_pallas_gpu_kernel_runs_on_each_data_shards_rows(tmp_path):
    """The reference step with the Triton kernel: XLA cannot partition a Pallas call (it
    would gather the batch around it), so each data shard runs in a shard_map and every
    kernel sees its own rows: 8 rows over data 2 are 4 a call."""
    overrides = {"mesh.data": "2", "model.attention": "pallas_gpu", "model.dtype": "bfloat16"}
    dump = tmp_path / "dump"
    proc = _compile_only(tmp_path, overrides, "h100-2", {"XLA_FLAGS": f"--xla_dump_to={dump}"})
    assert proc.returncode == 0, proc.stderr
    assert "pallas_gpu attention" in proc.stdout
    (step,) = [p for p in dump.glob("*jit_train_step*after_optimizations.txt") if "-" not in p.name]
    triton = 'custom_call_target="__gpu$xla.gpu.triton"'
    calls = [line for line in step.read_text().splitlines() if triton in line]
    rows = {step_cost.dims_of(step_cost.parse(line).type)[0] for line in calls}
    kernels = {re.search(r'name = "(segment_attention_\w+)"', line).group(1) for line in calls}
    assert kernels == {"segment_attention_forward", "segment_attention_dkv", "segment_attention_dq"}
    assert rows == {4}


@needs_plugin
# seq_zb_h1 carries every buffer seq1f1b does and the B-to-W ones; both under test-all
# (100 s on 2 cores).
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["seq1f1b", "seq_zb_h1"])
def test_a_gpu_tick_copies_and_transposes_no_buffer_it_carries(tmp_path, schedule):
    """On a GPU a conditional's results never share its operands' memory, and loops that
    choose their own layouts for one buffer need transposes between them: either way
    whole carried buffers (gradients, stash, K/V caches) would be moved every tick. The
    tick's top level, compiled for an H200, copies or transposes none of them."""
    overrides = {
        "mesh.data": "1",
        "mesh.stage": "1",
        "pipeline.remat": "none",  # the stash holds every residual, in several layouts
        "pipeline.schedule": schedule,
        "pipeline.microbatches": "2",
        "pipeline.segments": "4",
    }
    dump = tmp_path / "dump"
    proc = _compile_only(tmp_path, overrides, "h200", {"XLA_FLAGS": f"--xla_dump_to={dump}"})
    assert proc.returncode == 0, proc.stderr
    (path,) = dump.glob("*jit_train_step*gpu_after_optimizations.txt")
    module = step_cost.Module(path.read_text())
    (tick_loop,) = [i for i in module.top_level(module.entry) if i.op == "while"]
    carried = {
        math.prod(step_cost.dims_of(t))
        for t in re.findall(r"\w+\[[\d,]+\]", tick_loop.type)
        if len(step_cost.dims_of(t)) >= 3  # buffers, not counters or token ids
    }
    assert carried
    moved = [
        i.name
        for i in module.top_level(step_cost.callee(tick_loop, "body"))
        if (i.op == "copy" or "transpose" in i.name)
        and math.prod(step_cost.dims_of(i.type)) in carried
    ]
    assert moved == []


@needs_plugin
@pytest.mark.slow  # the TPU's DOES NOT FIT path runs by default (test_topology)
def test_a_step_larger_than_the_gpu_says_so_and_exits_1(tmp_path):
    """Float32 logits of 8 x 4096 tokens over a vocabulary of 2^21, whole: 256 GiB (a short
    sequence compiles in a third of the time 32768 tokens took)."""
    overrides = {
        "mesh.data": "1",
        "mesh.stage": "1",
        "pipeline.schedule": "none",
        "model.vocab_size": str(2**21),
        "train.seq_len": "4096",
        "train.global_batch_size": "8",
        "model.loss_chunk": "0",
    }
    proc = _compile_only(tmp_path, overrides, "h100")
    assert proc.returncode == 1, proc.stderr
    summary = proc.stdout.strip().splitlines()[0]
    assert summary.startswith("h100: 1 GPU (NVIDIA H100 80GB HBM3, 1 host of 1), mesh 1x1")
    assert "of 79 GiB HBM" in summary and "DOES NOT FIT" in summary


def test_without_the_cuda_plugin_compiling_for_gpus_is_one_line_that_says_how_to_install(
    tmp_path,
):
    proc = _compile_only(
        tmp_path, {}, "h200-8", {"SEQPIPE_CUDA_PLUGIN_DIR": str(tmp_path / "no-plugin")}
    )
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line, line
    assert line.startswith("error: --topology h200-8: cannot describe 1x1x8")
    assert "jax-cuda13-plugin==" in line and "make install" in line
    assert proc.stdout == "" and not (tmp_path / "never").exists()
