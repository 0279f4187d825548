"""seqpipe against torch: every parameter's gradient of two HF models (transformers,
float64; scripts/make_torch_oracle.py) through `seqpipe.hf.load` and every schedule, and
ten steps of a torch AdamW recipe run by train.py (docs/training.md)."""

import json

import jax
import numpy as np
import pytest
from helpers import REPO, run_python, subprocess_env
from pairwise import full_product
from safetensors.numpy import load_file

from seqpipe import schedule as schedule_lib
from seqpipe.hf import weights
from seqpipe.models import noise, reference
from seqpipe.parallel import sharding
from seqpipe.pipeline import executor
from seqpipe.run import config as config_lib
from seqpipe.tools.verify import canonical_loss_and_grads

FIXTURES = REPO / "tests" / "fixtures" / "hf"
MODELS = ("llama_gqa_llama3", "qwen2_bias")
ROWS = ("unpacked", "packed")
# seqpipe's float64 model against torch's: two float64 computations of one function.
FLOAT64_RTOL = 1e-12
TRAJECTORY_RTOL = 1e-5


def _oracle(name: str, rows: str) -> tuple:
    """(batch, torch's loss, torch's gradients by HF name) of a fixture."""
    o = np.load(FIXTURES / name / ("grads.npz" if rows == "unpacked" else "grads_packed.npz"))
    batch = o["tokens"]
    if rows == "packed":
        batch = {"tokens": batch, "documents": o["documents"], "positions": o["positions"]}
    grads = {k: o[k] for k in o.files if k not in ("tokens", "documents", "positions", "loss")}
    return batch, float(o["loss"]), grads


def _config(name: str, schedule: str):
    config = config_lib.load(f"hf:{FIXTURES / name}")
    virtual = 2 if schedule_lib.GENERATORS[schedule].interleaved else 1
    config.mesh.update(data=1, stage=2)
    # The fixture's two rows of 40 tokens (and their targets) as two micro-batches of one.
    config.pipeline.update(schedule=schedule, microbatches=2, segments=2, virtual_stages=virtual)
    config.train.update(global_batch_size=2, seq_len=40)
    return config


def _by_name(cfg, tree) -> dict:
    return dict(weights.tensors(cfg, tree, "float64"))


def _cases():
    """Every schedule, model and kind of row under `make test-all`; by default each
    schedule once, the models and rows taken in turn."""
    factors = (schedule_lib.SCHEDULES, MODELS, ROWS)
    valid = lambda s, m, r: not (m == "qwen2_bias" and "interleaved" in s)  # noqa: E731
    turns = [(m, r) for r in ROWS for m in MODELS]
    sample = set()
    for i, schedule in enumerate(schedule_lib.SCHEDULES):
        sample.add(next(c for k in range(4) if valid(*(c := (schedule, *turns[(i + k) % 4])))))
    full = full_product(factors, valid)
    return [pytest.param(*c, marks=[] if c in sample else pytest.mark.slow) for c in full]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("rows", ROWS)
def test_the_float64_model_equals_torchs(name, rows):
    """seqpipe's model in float64 (the truth `seqpipe.verify` measures against) gives
    torch's float64 loss and gradients to 1e-12: a wrong conversion or layer is off by
    far more, and the float32 results below are judged against the same truth."""
    batch, loss, grads = _oracle(name, rows)
    cfg, params = weights.load(str(FIXTURES / name))
    got_loss, got = noise.float64_reference(params, batch, cfg)
    assert abs(got_loss - loss) <= FLOAT64_RTOL * loss
    errors = noise.normwise(_by_name(cfg, got), grads)
    assert max(errors.values()) <= FLOAT64_RTOL, max(errors.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("schedule, name, rows", _cases())
def test_every_schedule_gives_torchs_gradients(schedule, name, rows):
    """The pipelined float32 gradients, mapped to HF names, within `noise.FACTOR` of the
    float32 noise (the float32 reference's own distance from torch's float64)."""
    batch, loss, grads = _oracle(name, rows)
    config = _config(name, schedule)
    if rows == "packed":
        config.data.packing = "concat"
    config_lib.validate(config)
    spec = executor.make_spec(config)
    mesh = sharding.mesh_of(config)
    cfg, params = weights.load(str(FIXTURES / name))
    ref = jax.jit(reference.loss_and_grads, static_argnums=2)(params, batch, cfg)
    placed = jax.device_put(batch, sharding.batch_sharding(mesh))
    result = jax.jit(lambda p, t: canonical_loss_and_grads(p, t, spec, mesh))(params, placed)
    verdict = noise.judge(
        (result[0], _by_name(cfg, result[1])), (ref[0], _by_name(cfg, ref[1])), (loss, grads)
    )
    print(verdict.line())
    assert verdict.ok, verdict.line()


def test_ten_adamw_steps_equal_torchs(tmp_path):
    """train.py with the recipe's train.* keys (docs/training.md) on the token file torch
    trained on, through a pipeline: the ten losses and every final parameter within 1e-5."""
    t = np.load(FIXTURES / "llama_gqa_llama3" / "trajectory.npz")
    recipe = json.loads((FIXTURES / "torch_oracle.json").read_text())["recipe"]
    data = tmp_path / "tokens.bin"
    t["stream"].astype(np.uint16).tofile(data)
    keys = {
        **{f"train.{k}": v for k, v in recipe.items()},
        "train.log_every": 1,
        "data.source": "tokens",
        "data.path": data,
        "data.token_dtype": "uint16",
        "mesh.stage": 2,
        "pipeline.schedule": "seq1f1b",
        "pipeline.microbatches": 2,
        "pipeline.segments": 2,
    }
    workdir, out = tmp_path / "run", tmp_path / "export"
    args = [f"--config.{k}={v}" for k, v in keys.items()]
    env = subprocess_env(devices=2)
    spec = f"hf:{FIXTURES / 'llama_gqa_llama3'}"
    proc = run_python("train.py", "--config", spec, "--workdir", str(workdir), *args, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = np.array([r["loss"] for r in records if "loss" in r])
    print(f"losses: worst relative error {np.max(np.abs(losses / t['losses'] - 1)):.1e}")
    np.testing.assert_allclose(losses, t["losses"], rtol=TRAJECTORY_RTOL)
    proc = run_python("-m", "seqpipe.hf", "export", "--workdir", str(workdir), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = {}
    for f in sorted(out.glob("*.safetensors")):
        final.update(load_file(f))
    truth = {k: t[k] for k in t.files if k not in ("stream", "losses")}
    assert sorted(final) == sorted(truth)
    errors = noise.normwise(
        {k: final[k] for k in sorted(truth)}, {k: truth[k] for k in sorted(truth)}
    )
    worst = max(errors.items(), key=lambda kv: kv[1])
    print(f"final parameters: worst normwise error {worst[1]:.1e} ({worst[0]})")
    assert worst[1] <= TRAJECTORY_RTOL, worst
