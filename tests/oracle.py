"""The oracle the pipeline tests share: a pipelined step's loss and every gradient against
the un-pipelined reference, judged by the rule `seqpipe.verify` states (each within
`noise.FACTOR` times the float32 reference's own distance from the float64 model); and the
small models and meshes their cases are built on.

One check serves every axis: schedules, meshes (data, stage, context, tensor), segments,
remat policies, GPT and a Llama-family model, mixtures of experts, packed rows.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from packed_rows import on_device, packed_batch

from seqpipe import schedule as schedule_lib
from seqpipe.models import model, noise, reference
from seqpipe.parallel import sharding
from seqpipe.pipeline import executor
from seqpipe.run import config as config_lib
from seqpipe.tools.verify import canonical_loss_and_grads

SEQ_LEN = 16
CONTEXT_SEQ_LEN = 32  # 2C pieces of every segment: K = 4 segments of 8 at C = 4
MODELS = ("gpt", "llama")
# A loss computed two ways in float32 (a forward-only pipeline, the model), relative.
LOSS_RTOL = 1e-5
# Grouped-query attention (4 query heads on 2 K/V heads), a SwiGLU MLP, Q/K/V biases, the
# head tied to the embedding, another norm epsilon and llama3 rope scaling whose original
# context (8) is shorter than the sequence: one frequency stretched, one interpolated.
# Weights drawn 10x wider than GPT's: at 0.02 attention is near uniform and wq's gradient
# cancels to float32 noise.
LLAMA = dict(
    num_heads=4,
    num_kv_heads=2,
    mlp="swiglu",
    qkv_bias=True,
    tie_embeddings=True,
    norm_eps=1e-5,
    init_std=0.2,
    rope_scaling=dict(
        type="llama3",
        factor=4.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8,
        beta_fast=32.0,
        beta_slow=1.0,
    ),
)
# A mixture of experts on the Llama-family model: 4 experts, 2 a token, both router losses.
MOE = dict(num_experts=4, experts_per_token=2, expert_d_ff=16, moe_aux_loss=0.1, moe_z_loss=0.01)


def microbatch_count(relation: str, stages: int, virtual: int) -> int:
    """Micro-batches "fewer", "equal" or "more" than the stages (interleaving: a multiple)."""
    if virtual > 1:
        return {"fewer": 0, "equal": stages, "more": 2 * stages}[relation]
    return {"fewer": stages - 1, "equal": stages, "more": stages + 2}[relation]


def virtual_stages(schedule: str) -> int:
    return 2 if schedule_lib.GENERATORS[schedule].interleaved else 1


def make_config(schedule, mesh, segments, part, relation, virtual, attention="auto", arch="gpt"):
    """A 16-wide model of one layer per stage and virtual stage on a (data, stage) mesh,
    rows of SEQ_LEN, two rows a micro-batch."""
    data, stages = mesh
    c = config_lib.base_config()
    c.model.update(
        vocab_size=61,
        num_layers=stages * virtual,
        d_model=16,
        num_heads=2,
        d_ff=24,
        attention=attention,
    )
    if arch == "llama":
        c.model.update(LLAMA)
    c.mesh.update(data=data, stage=stages)
    m = microbatch_count(relation, stages, virtual)
    c.pipeline.update(
        schedule=schedule, microbatches=m, segments=segments, partition=part, virtual_stages=virtual
    )
    c.train.update(global_batch_size=data * m * 2, seq_len=SEQ_LEN)
    config_lib.validate(c)
    return c


def tensor_config(schedule, mesh, segments, remat, arch="gpt"):
    """`make_config`'s model with 4 heads (so 4 tensor devices get one each) on a
    (data, stage, tensor) mesh."""
    data, stage, t = mesh
    c = make_config(
        schedule, (data, stage), segments, "uniform", "more", virtual_stages(schedule), arch=arch
    )
    c.model.update(num_heads=4, d_ff=32, vocab_size=64, d_model=32)
    c.mesh.tensor = t
    c.pipeline.remat = remat
    config_lib.validate(c, num_devices=data * stage * t)
    return c


def context_config(schedule, mesh, segments, remat="full", arch="gpt", attention="xla"):
    """`make_config`'s model with 4 heads (2 K/V heads for llama) on a (data, stage,
    context, tensor) mesh, rows of CONTEXT_SEQ_LEN."""
    data, stage, size, t = mesh
    c = make_config(
        schedule, (data, stage), 1, "uniform", "more", virtual_stages(schedule), attention, arch
    )
    c.model.update(num_heads=4, d_ff=32, vocab_size=64, d_model=32)
    if arch == "llama":
        c.model.update({k: v for k, v in LLAMA.items() if k != "num_heads"})
    c.mesh.update(context=size, tensor=t)
    c.pipeline.update(segments=segments, remat=remat)
    c.train.seq_len = CONTEXT_SEQ_LEN
    config_lib.validate(c, num_devices=data * stage * size * t)
    return c


def randomized_gains(params):
    """Norm gains and biases drawn at random (init makes them ones and zeros, under which
    a gain applied to the wrong rows, or a bias dropped, would change nothing)."""

    def draw(path, x):
        name = jax.tree_util.keystr(path)
        key = jax.random.fold_in(jax.random.key(7), len(name) * 1000 + x.size)
        if "norm" in name:
            return x + 0.2 * jax.random.normal(key, x.shape, x.dtype)
        if name.endswith("['bq']") or name.endswith("['bk']") or name.endswith("['bv']"):
            return 0.5 * jax.random.normal(key, x.shape, x.dtype)
        return x

    return jax.tree_util.tree_map_with_path(draw, params)


def initial_params(cfg):
    """The init of key 0, the Llama family's gains and biases drawn too, a mixture's router
    meter added: one compiled program (op by op, each leaf's ops compiled for its shape
    took seconds a case)."""

    def init():
        params = model.init_params(cfg, jax.random.key(0))
        if cfg.qkv_bias:  # the Llama family
            params = randomized_gains(params)
        return model.metered(params, cfg)

    return jax.jit(init)()


def batch_of(rows: int, seq: int, vocab: int, packed: bool):
    """Random rows of seq + 1 tokens (numpy's generator, seed 1), or packed documents."""
    if packed:
        return packed_batch(rows, seq, vocab)
    return np.random.default_rng(1).integers(0, vocab, (rows, seq + 1), dtype=np.int32)


def inputs(config, packed: bool = False):
    """(spec, mesh, params, batch) of a config: `initial_params` and `batch_of`."""
    spec = executor.make_spec(config)
    rows, seq = config.train.global_batch_size, config.train.seq_len
    batch = batch_of(rows, seq, spec.cfg.vocab_size, packed)
    return spec, sharding.mesh_of(config), initial_params(spec.cfg), batch


@functools.lru_cache(maxsize=64)
def references(oracle_cfg, rows: int, seq: int, packed: bool):
    """The reference's (loss, gradients) in the case's dtypes and the float64 truth of its
    model and rows, computed once a process: cases of one model and batch on other
    schedules and meshes share them."""
    params = initial_params(oracle_cfg)
    batch = batch_of(rows, seq, oracle_cfg.vocab_size, packed)
    # Closures, jitted here: their executables go with them (jax keeps those of a
    # long-lived function jitted with a static config until `jax.clear_caches`).
    whole = jax.tree.map(jnp.asarray, batch)
    ref = jax.jit(lambda p, b: reference.loss_and_grads(p, b, oracle_cfg))(params, whole)
    return jax.device_get(ref), noise.float64_reference(params, batch, oracle_cfg)


def check(config, packed: bool = False):
    """The pipelined loss and gradients of `config` against the reference (`xla`
    attention, one device), by `noise.judge` as `seqpipe.verify` judges: each within
    `noise.FACTOR` times the reference's own distance from the float64 model, in the
    config's compute dtype (float32's rounding, or bfloat16's)."""
    spec, mesh, params, batch = inputs(config, packed)
    oracle_cfg = dataclasses.replace(spec.cfg, attention="xla", tensor=1)
    rows, seq = config.train.global_batch_size, config.train.seq_len
    ref, truth = references(oracle_cfg, rows, seq, packed)
    where = sharding.batch_sharding(mesh)
    on_mesh = on_device(batch, where) if packed else jax.device_put(batch, where)
    step = jax.jit(lambda p, b: canonical_loss_and_grads(p, b, spec, mesh))
    verdict = noise.judge(step(params, on_mesh), ref, truth)
    assert verdict.ok, f"gradient or loss off: {verdict.line()}"
