"""HuggingFace checkpoints in the trainer: `--config hf:DIR`, `train.init_from`, every
schedule on imported weights, export that transformers loads, and bad input in one line."""

import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import run_of, run_python, tiny_args
from safetensors import safe_open

from seqpipe.hf import config as hf_config
from seqpipe.hf import weights
from seqpipe.models import model
from seqpipe.parallel import layout, sharding
from seqpipe.run import config as config_lib
from seqpipe.schedule import SCHEDULES
from seqpipe.tools import verify
from seqpipe.train import optim, step

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "hf"
GQA = FIXTURES / "llama_gqa_llama3"  # 4 layers, 4 query heads on 2 K/V heads, llama3 rope
SPEC = f"hf:{GQA}"


def corpus(tmp_path) -> Path:
    """Real text: seqpipe's own model source."""
    path = tmp_path / "corpus.txt"
    path.write_text((REPO / "seqpipe" / "models" / "model.py").read_text())
    return path


def run_args(tmp_path, **overrides) -> list[str]:
    base = {
        "data.source": "text",
        "data.path": str(corpus(tmp_path)),
        "data.cache_dir": str(tmp_path / "cache"),
        "train.seq_len": "32",
        "train.global_batch_size": "4",
        "train.steps": "2",
        "train.log_every": "1",
        "checkpoint.async_save": "false",
    }
    base.update({k: str(v) for k, v in overrides.items()})
    return [f"--config.{k}={v}" for k, v in base.items()]


def run(args: list[str], module: str | None = None, timeout=300):
    """train.py (or `module`) in a fresh process, which fakes the CPU devices its mesh needs."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    command = ["-m", module] if module else ["train.py"]
    return run_python(*command, *args, env=env, timeout=timeout)


def pipelined(schedule: str, stages: int, virtual: int = 1, **more) -> dict:
    return {
        "pipeline.schedule": schedule,
        "mesh.stage": stages,
        "mesh.data": 1,
        "pipeline.virtual_stages": virtual,
        "pipeline.microbatches": 2 * stages if virtual > 1 else stages,
        "pipeline.segments": 2,
        "train.global_batch_size": 2 * stages,
        "train.seq_len": 32,
        **more,
    }


LAYOUTS = {
    "2x4 seq1f1b": {**pipelined("seq1f1b", 4), "mesh.data": 2, "train.global_batch_size": 16},
    "3 stages, padded": pipelined("1f1b", 3, **{"pipeline.layers_per_stage": "2,1,1"}),
    "interleaved": pipelined("seq1f1b_interleaved", 2, 2),
    "tensor 2: K/V split": pipelined("seq1f1b", 2, **{"mesh.tensor": 2}),
    "tensor 4: K/V replicated": pipelined("seq1f1b", 2, **{"mesh.tensor": 4}),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_initial_state_is_the_checkpoint_on_every_layout(name):
    """init_from reads each device's block into the train state's stage order and
    shardings: back in canonical order it is the checkpoint, exactly."""
    config = config_lib.load(SPEC, {k: str(v) for k, v in LAYOUTS[name].items()})
    mesh = sharding.mesh_of(config)
    tx = optim.make_optimizer(config.train)
    state = step.init_state(run_of(config), mesh, tx)
    expected = weights.load(GQA)[1]
    params = layout.to_canonical(state["params"], layout.of_config(config))
    jax.tree.map(np.testing.assert_array_equal, params, expected)
    abstract = step.abstract_state(run_of(config), mesh, tx)
    same = jax.tree.map(
        lambda x, s: x.sharding.is_equivalent_to(s.sharding, x.ndim), state, abstract
    )
    assert all(jax.tree.leaves(same))
    assert int(state["step"]) == 0


# The default run takes the Seq1F1B pair; `make test-all` every schedule.
DEFAULT_SCHEDULES = ("seq1f1b", "seq1f1b_interleaved")


@pytest.mark.parametrize(
    "schedule",
    [s if s in DEFAULT_SCHEDULES else pytest.param(s, marks=pytest.mark.slow) for s in SCHEDULES],
)
def test_every_schedule_equals_the_reference_on_imported_weights(schedule):
    interleaved = "interleaved" in schedule
    overrides = pipelined(schedule, 2, 2 if interleaved else 1)
    config = config_lib.load(SPEC, {k: str(v) for k, v in overrides.items()})
    mesh = sharding.mesh_of(config)
    tokens = np.random.default_rng(0).integers(0, 96, (4 if interleaved else 2, 33))
    tokens = np.asarray(tokens, np.int32)
    r = verify.compare(run_of(config), tokens, mesh)
    assert r["ok"], r


@pytest.mark.parametrize(
    "mesh",
    [{"mesh.tensor": 2}, {"mesh.context": 2, "pipeline.schedule": "seq_zb_h1"}],
    ids=["tensor-2", "context-2-seq_zb_h1"],
)
def test_a_qwen3_model_equals_the_reference(mesh):
    """Qwen 3 (heads 16 wide on a width of 32: head_dim set apart; q_norm and k_norm, whose
    gains every tensor device holds whole) from a transformers-made checkpoint, pipelined
    over 2 stages with tensor or context parallelism: loss and every gradient."""
    overrides = pipelined("seq1f1b", 2, **mesh)
    config = config_lib.load(
        f"hf:{FIXTURES / 'qwen3_qk_norm'}", {k: str(v) for k, v in overrides.items()}
    )
    assert (config.model.head_dim, config.model.qk_norm) == (16, True)
    tokens = np.asarray(np.random.default_rng(0).integers(0, 96, (2, 33)), np.int32)
    r = verify.compare(run_of(config), tokens, sharding.mesh_of(config))
    assert r["ok"], r


@pytest.mark.parametrize(
    "name, mesh",
    [
        ("qwen3_moe", {"mesh.context": 2}),
        ("qwen2_moe", {"mesh.data": 2, "mesh.tensor": 2, "train.global_batch_size": 8}),
        pytest.param(
            "qwen3_moe_mixed",
            {"mesh.data": 2, "mesh.tensor": 2, "train.global_batch_size": 8},
            marks=pytest.mark.slow,
        ),
    ],
    ids=["qwen3_moe-context-2", "qwen2_moe-experts-2-tensor-2", "qwen3_moe_mixed-experts-2"],
)
def test_a_moe_model_equals_the_reference(name, mesh):
    """Mixtral, Qwen3-MoE and Qwen 2 MoE (its shared expert's columns over tensor), and a
    Qwen3-MoE whose dense and sparse layers alternate (decoder_sparse_step, mlp_only_layers)
    from transformers-made checkpoints (each device's experts read from their own tensors),
    pipelined over 2 stages with the experts split over 2 data replicas and tensor
    parallelism, or with context parallelism: loss and every gradient, the router loss's
    included (HF's router_aux_loss_coef)."""
    overrides = pipelined("seq1f1b", 2, **mesh)
    config = config_lib.load(f"hf:{FIXTURES / name}", {k: str(v) for k, v in overrides.items()})
    assert (config.model.num_experts, config.model.moe_aux_loss) == (4, 0.001)
    assert config.model.shared_expert_d_ff == (40 if name == "qwen2_moe" else 0)
    # Half the rows of train.global_batch_size: the router losses average over those given.
    rows = config.train.global_batch_size // 2
    tokens = np.asarray(np.random.default_rng(0).integers(0, 96, (rows, 33)), np.int32)
    r = verify.compare(run_of(config), tokens, sharding.mesh_of(config))
    assert r["ok"], r


@pytest.mark.parametrize("name, tensor", [("mixtral_moe", 2), ("qwen3_moe", 1)])
def test_verify_cli_on_a_mixture_with_its_experts_over_two_devices(tmp_path, name, tensor):
    """`python -m seqpipe.verify --config hf:DIR` on a transformers-made Mixtral (with
    tensor 2) and Qwen3-MoE at 2 stages, their experts split over 2 data replicas."""
    overrides = {
        **pipelined("seq1f1b", 2),
        "mesh.data": 2,
        "mesh.tensor": tensor,
        "train.global_batch_size": 8,
    }
    spec = f"hf:{FIXTURES / name}"
    result = run(["--config", spec, *run_args(tmp_path, **overrides)], "seqpipe.verify")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("OK"), result.stdout


@pytest.mark.parametrize("tensor", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_verify_cli_with_init_from(tmp_path, tensor):
    """`python -m seqpipe.verify --config hf:DIR` with K/V heads split (tensor 2) and
    replicated (tensor 4)."""
    overrides = pipelined("seq1f1b", 2, **{"mesh.tensor": tensor})
    result = run(["--config", SPEC, *run_args(tmp_path, **overrides)], "seqpipe.verify")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("OK"), result.stdout


def test_train_export_and_resume(tmp_path):
    """`train.py --config hf:DIR` trains from the checkpoint's weights with its tokenizer;
    export writes a HF directory of the trained weights; a second run on the workdir
    resumes its own checkpoint and says init_from is not read."""
    work = tmp_path / "run"
    args = ["--config", SPEC, "--workdir", str(work), *run_args(tmp_path)]
    first = run(args)
    assert first.returncode == 0, first.stderr
    assert f"initialised from {SPEC}" in first.stdout
    assert (work / "tokenizer.json").read_text() == (GQA / "tokenizer.json").read_text()
    out = tmp_path / "export"
    exported = run(["export", "--workdir", str(work), "--out", str(out)], "seqpipe.hf")
    assert exported.returncode == 0, exported.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    for bad, message in [
        (
            ["--step", "7", "--out", str(tmp_path / "o")],
            f"--step 7: {work}/checkpoints holds steps [2]",
        ),
        (["--out", str(out)], f"--out {out} exists and is not empty"),
    ]:
        refused = run(["export", "--workdir", str(work), *bad], "seqpipe.hf")
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert message in refused.stderr
    assert not (tmp_path / "o").exists()
    cfg, params = weights.load(out)
    _, original = weights.load(GQA)
    moved = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), params, original)
    assert all(d > 0 for d in jax.tree.leaves(moved))  # two steps changed every tensor
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "llama3"
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_theta"] == 500000.0
    again = run([*args, "--config.train.steps=3"])
    assert again.returncode == 0, again.stderr
    assert (
        f"train.init_from={SPEC} is not read: {work} holds its own checkpoint (step 2), "
        "which the run resumes"
    ) in again.stdout


def test_a_model_key_that_differs_from_config_json_is_one_line(tmp_path):
    result = run(
        ["--config", "tiny", f"--config.train.init_from={SPEC}", "--workdir", str(tmp_path / "w")]
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert f"train.init_from={SPEC}: model.vocab_size=2048 but {GQA}/config.json has 96" in (
        result.stderr
    )
    assert not (tmp_path / "w").exists()


def _copy(tmp_path) -> Path:
    import shutil

    target = tmp_path / "model"
    shutil.copytree(GQA, target)
    return target


def test_a_tokenizer_larger_than_the_vocabulary_is_one_line(tmp_path):
    from tokenizers import Tokenizer, models

    target = _copy(tmp_path)
    vocab = {chr(0x100 + i): i for i in range(200)}
    Tokenizer(models.BPE(vocab=vocab, merges=[])).save(str(target / "tokenizer.json"))
    result = run(
        ["--config", f"hf:{target}", "--workdir", str(tmp_path / "w"), *run_args(tmp_path)],
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: data.tokenizer=hf:{target} has ids up to 199 but model.vocab_size=96; set "
        "model.vocab_size >= 200, or use a tokenizer whose ids are below 96 (the model's own)"
    )
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("where", ["in DIR", "data.tokenizer"])
def test_tokenizer_ids_past_the_vocabulary_are_one_line_and_nothing_is_cached(tmp_path, where):
    """A tokenizer of 96 entries whose ids run to 1322 (a vocabulary with a gap), in the
    model's directory or named by data.tokenizer: its count fits the model's 96 rows, its
    ids do not; refused before a token is cached (issue 47)."""
    target = _copy(tmp_path)
    spec = json.loads((GQA / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab[max(vocab, key=vocab.get)] = 1322
    file = target / "tokenizer.json" if where == "in DIR" else tmp_path / "T.json"
    file.write_text(json.dumps(spec))
    named = f"hf:{target}" if where == "in DIR" else str(file)
    result = run(
        ["--config", f"hf:{target}", "--workdir", str(tmp_path / "w"), *run_args(tmp_path)]
        + ([f"--config.data.tokenizer={file}"] if where != "in DIR" else []),
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: data.tokenizer={named} has ids up to 1322 but model.vocab_size=96; set "
        "model.vocab_size >= 1323, or use a tokenizer whose ids are below 96 (the model's own)"
    )
    assert not (tmp_path / "w").exists() and not (tmp_path / "cache").exists()


def test_a_truncated_shard_stops_the_run_in_one_line(tmp_path):
    target = _copy(tmp_path)
    shard = target / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    result = run(
        ["--config", f"hf:{target}", "--workdir", str(tmp_path / "w"), *run_args(tmp_path)],
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1
    assert f"{shard} is damaged or truncated" in result.stderr
    assert not (tmp_path / "w").exists()


def test_export_of_a_workdir_without_checkpoints_is_one_line(tmp_path):
    out = tmp_path / "out"
    result = run(["export", "--workdir", str(tmp_path), "--out", str(out)], "seqpipe.hf")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "holds no checkpoint" in result.stderr
    assert not out.exists()


@pytest.mark.transformers  # not `slow` as well: make test-oracles runs it, no shard
def test_export_writes_what_transformers_loads(tmp_path):
    """An export of a checkpoint trained here: transformers' logits equal seqpipe's."""
    import torch
    import transformers

    work, out = tmp_path / "run", tmp_path / "export"
    assert run(["--config", SPEC, "--workdir", str(work), *run_args(tmp_path)]).returncode == 0
    exported = run(["export", "--workdir", str(work), "--out", str(out)], "seqpipe.hf")
    assert exported.returncode == 0, exported.stderr
    cfg, params = weights.load(out)
    tokens = np.random.default_rng(1).integers(0, 96, (2, 48))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = loaded(input_ids=torch.from_numpy(tokens)).logits.numpy()
    ours = np.asarray(model.forward(params, np.asarray(tokens, np.int32), cfg))
    assert float(np.max(np.abs(ours - theirs))) <= 1e-3
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        assert "lm_head.weight" in f.keys()


def test_config_from_an_hf_directory():
    """`--config hf:DIR`: its model keys, its weights and its tokenizer; defaults else."""
    config = config_lib.load(SPEC, {"train.seq_len": "64"})
    keys = hf_config.model_keys(hf_config.read(SPEC))
    assert {k: config.model[k] for k in keys if k != "rope_scaling"} == {
        k: v for k, v in keys.items() if k != "rope_scaling"
    }
    assert config.model.rope_scaling.to_dict() == {
        **config_lib.base_config().model.rope_scaling.to_dict(),
        **keys["rope_scaling"],
    }
    assert (config.train.init_from, config.data.tokenizer) == (SPEC, SPEC)
    assert config.train.seq_len == 64 and config.train.steps == config_lib.base_config().train.steps


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model.num_kv_heads": "4"}, f"model.num_kv_heads=4 but {GQA}/config.json has 2"),
        ({"data.tokenizer": "gpt2"}, "data.tokenizer='gpt2' is not valid"),
        ({"train.init_from": str(GQA)}, "is not valid; give hf:DIR"),
        ({"train.init_from": "hf:/nonexistent"}, "/nonexistent has no config.json"),
    ],
)
def test_bad_hf_settings_are_one_line(overrides, message):
    with pytest.raises(config_lib.ConfigError) as e:
        config_lib.load(SPEC, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_longer_context_may_change_the_rope():
    config = config_lib.load(SPEC, {"model.rope_scaling.factor": "16", "train.seq_len": "256"})
    assert hf_config.rope_change(config.model, SPEC) == (
        "model.rope_scaling.factor 8.0 -> 16.0 (the checkpoint's rope extended)"
    )


@pytest.mark.transformers  # not `slow` as well: make test-oracles runs it, no shard
def test_continued_pretraining_end_to_end(tmp_path):
    """Import the GQA Llama (llama3 rope, trained context 16 x 8), train 20 steps of
    seq1f1b on a 2 x 4 mesh at 256 tokens with the rope factor doubled, export: the
    export loads in transformers, whose logits equal seqpipe's at 256 tokens."""
    import torch
    import transformers

    text = tmp_path / "corpus.txt"
    text.write_text("".join(p.read_text() for p in sorted((REPO / "seqpipe").glob("*.py"))))
    work, out = tmp_path / "run", tmp_path / "export"
    args = [
        "--config", SPEC, "--workdir", str(work),
        *run_args(tmp_path, **{
            "data.path": str(text), "mesh.data": 2, "mesh.stage": 4,
            "pipeline.schedule": "seq1f1b", "pipeline.microbatches": 4,
            "pipeline.segments": 4, "train.seq_len": 256, "train.global_batch_size": 16,
            "train.steps": 20, "train.log_every": 5, "train.warmup_steps": 2,
            "train.learning_rate": 1e-3, "model.rope_scaling.factor": 16,
        }),
    ]  # fmt: skip
    trained = run(args, timeout=1200)
    print(trained.stdout)
    assert trained.returncode == 0, trained.stderr
    exported = run(["export", "--workdir", str(work), "--out", str(out)], "seqpipe.hf")
    assert exported.returncode == 0, exported.stderr
    print(exported.stdout)
    cfg, params = weights.load(out)
    assert cfg.rope_scaling.factor == 16.0
    tokens = np.random.default_rng(2).integers(0, 96, (2, 256))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = loaded(input_ids=torch.from_numpy(tokens)).logits.numpy()
    ours = np.asarray(model.forward(params, np.asarray(tokens, np.int32), cfg))
    error = float(np.max(np.abs(ours - theirs)))
    print(f"max |seqpipe - transformers| logit after 20 steps at 256 tokens: {error:.2e}")
    assert error <= 1e-3


def test_each_device_block_is_read_alone(monkeypatch):
    """On 2 stages x 2 tensor devices, every block read from the files is one device's:
    a layer's heads, MLP columns or vocabulary split in two, never a whole tensor that
    the mesh splits."""
    reads = []
    real = weights.read_block

    def recording(t, tensor_slice, shape, index):
        block = real(t, tensor_slice, shape, index)
        reads.append((t.name.split(".")[-2], block.size, int(np.prod(shape))))
        return block

    monkeypatch.setattr(weights, "read_block", recording)
    overrides = pipelined("seq1f1b", 2, **{"mesh.tensor": 2})
    config = config_lib.load(SPEC, {k: str(v) for k, v in overrides.items()})
    step.init_state(run_of(config), sharding.mesh_of(config), optim.make_optimizer(config.train))
    split = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    split |= {"embed_tokens", "lm_head"}
    sizes = {}
    for name, size, whole in reads:
        sizes.setdefault(name, set()).add(size / whole)
    assert split <= set(sizes)
    assert all(sizes[name] == {0.5} for name in split), sizes
    assert sizes["input_layernorm"] == {1.0}  # norm gains are whole on every device


# The config.json of the public checkpoints (their model keys, as published on the Hub).
PUBLIC = {
    "llama3_2_1b": {
        "architectures": ["LlamaForCausalLM"], "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
        "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256,
    },
    "llama3_1_8b": {
        "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256,
    },
    "qwen2_5_7b": {
        "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 3584,
        "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28,
        "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 131072, "use_sliding_window": False, "tie_word_embeddings": False,
        "vocab_size": 152064,
    },
}  # fmt: skip


@pytest.mark.parametrize("name", PUBLIC)
def test_the_shipped_configs_are_the_public_checkpoints(tmp_path, name):
    """configs/NAME.py takes the public checkpoint with train.init_from: no key differs."""
    (tmp_path / "config.json").write_text(json.dumps(PUBLIC[name]))
    config = config_lib.load(name, {"train.init_from": f"hf:{tmp_path}"})
    assert hf_config.rope_change(config.model, f"hf:{tmp_path}") is None


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory) -> Path:
    """A GPT run (configs/tiny's gelu MLP) of two steps, a checkpoint after each."""
    tmp = tmp_path_factory.mktemp("gpt")
    work = tmp / "run"
    overrides = {"train.steps": 2, "checkpoint.every": 1, "checkpoint.async_save": "false"}
    overrides["mesh.data"] = 2
    result = run(["--workdir", str(work), *tiny_args(**overrides)])
    assert result.returncode == 0, result.stderr
    return work


def _export(work: Path, out: Path, *more: str):
    return run(["export", "--workdir", str(work), "--out", str(out), *more], "seqpipe.hf")


def _damage(work: Path, step: int, how: str) -> Path:
    """A copy of the run whose step's state files are damaged: `flip`, 8 bytes in the middle
    of each overwritten; `truncate`, each cut to 100 bytes."""
    copy = work.parent / f"{work.name}-{how}"
    shutil.copytree(work, copy)
    files = [p for p in (copy / "checkpoints" / str(step) / "state").rglob("*") if p.is_file()]
    for path in [p for p in files if p.stat().st_size > 10_000]:
        if how == "flip":
            with open(path, "r+b") as f:
                f.seek(path.stat().st_size // 2)
                f.write(b"XXXXXXXX")
        else:
            os.truncate(path, 100)
    return copy


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_export_of_a_damaged_checkpoint_falls_back_to_the_newest_intact(gpt_run, tmp_path, how):
    """Export checks what it reads as resume does: a damaged newest step is skipped for the
    one before, saying so in one line; asked for by --step, it is refused in one line."""
    damaged = _damage(gpt_run, 2, how)
    out, intact = tmp_path / "out", tmp_path / "intact"
    result = _export(damaged, out)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("warning: checkpoint step 2 (") and (
        "is damaged; exporting step 1, the newest intact one" in result.stderr
    )
    assert _export(gpt_run, intact, "--step", "1").returncode == 0
    assert (out / "model.safetensors").read_bytes() == (intact / "model.safetensors").read_bytes()
    refused = _export(damaged, tmp_path / "o", "--step", "2")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("error: --step 2 (")
    assert "is damaged; export another step (it holds [1, 2])" in refused.stderr
    assert not (tmp_path / "o").exists()


def test_a_gpt_run_exports_as_arcee_and_loads_back(gpt_run, tmp_path):
    """configs/tiny's GPT (gelu MLP) exports as transformers' Arcee, which seqpipe reads
    back: a format that loads, not a Llama config without the gate it names."""
    out = tmp_path / "out"
    assert _export(gpt_run, out).returncode == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["ArceeForCausalLM"]
    assert config["hidden_act"] == "gelu_pytorch_tanh"
    cfg, _ = weights.load(out)
    assert cfg.mlp == "gelu" and cfg.num_layers == 4


def test_every_out_that_cannot_be_written_is_one_line(gpt_run, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for out, message in [
        (a_file / "sub", f"--out {a_file}/sub: {a_file} is a file, not a directory"),
        (a_file / "sub" / "deeper", f"{a_file} is a file, not a directory"),
        (a_file, f"--out {a_file} exists and is not empty"),
    ]:
        result = _export(gpt_run, out)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert message in result.stderr
    assert a_file.read_text() == "x"


def test_an_export_into_an_empty_directory_keeps_it_and_gives_plain_modes(gpt_run, tmp_path):
    out = tmp_path / "made-for-it"
    out.mkdir(mode=0o755)
    assert _export(gpt_run, out).returncode == 0
    assert out.stat().st_mode & 0o777 == 0o755
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes == dict.fromkeys(["config.json", "model.safetensors"], 0o666 & ~mask), modes
