"""The mixture-of-experts MLP (`seqpipe.models.moe`): the grouped experts against every
expert on every token, the routing against numpy, the router losses' gradients against
autodiff of the explicit objective, every schedule against the un-pipelined reference
(loss and every gradient, router included, and each layer's metered router losses),
the step's router metrics, a capacity against numpy and through the pipeline, broken
variants caught, FLOPs of the active parameters, and bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import PIPELINED, needs_libtpu, run_of, tiny_config
from oracle import CONTEXT_SEQ_LEN as SEQ_LEN
from oracle import check, context_config
from pairwise import sampled

from seqpipe import schedule as schedule_lib
from seqpipe.models import model, moe
from seqpipe.parallel import layout, sharding
from seqpipe.pipeline import executor
from seqpipe.run import config as config_lib
from seqpipe.targets import topology
from seqpipe.train import step, trainer

CFG = model.GPTConfig(
    vocab_size=64,
    num_layers=2,
    d_model=16,
    num_heads=2,
    d_ff=24,
    mlp="swiglu",
    num_experts=4,
    experts_per_token=2,
    moe_aux_loss=0.1,
    moe_z_loss=0.01,
)


def _layer0(cfg=CFG):
    return jax.tree.map(lambda x: x[0], model.init_params(cfg, jax.random.key(0))["layers"])


def _every_expert(h, chosen, weights, p):
    """The oracle: every expert on every token, weighted by a dense gate that holds the
    chosen experts' weights and zeros."""
    outs = jnp.stack(
        [
            (jax.nn.silu(h @ p["e_gate"][e]) * (h @ p["e_in"][e])) @ p["e_out"][e]
            for e in range(p["e_gate"].shape[0])
        ],
        axis=1,
    )
    rows = jnp.arange(h.shape[0])[:, None]
    gate = jnp.zeros(outs.shape[:2]).at[rows, chosen].set(weights)
    return jnp.einsum("te,ted->td", gate, outs)


def _routed(p, tokens=24):
    h = jax.random.normal(jax.random.key(2), (tokens, CFG.d_model))
    _, _, chosen, weights = moe.route(h[None], p["router"], 2, True)
    return h, chosen[0], weights[0]


def test_the_grouped_experts_equal_every_expert_on_every_token():
    p = _layer0()
    h, chosen, weights = _routed(p)
    got = moe.experts(h, chosen, weights, p["e_gate"], p["e_in"], p["e_out"])
    want = _every_expert(h, chosen, weights, p)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # And their gradients, every expert's weights and the routing weights.
    args = (h, weights, p["e_gate"], p["e_in"], p["e_out"])

    def grouped(h, w, g, i, o):
        return jnp.sum(jnp.sin(moe.experts(h, chosen, w, g, i, o)))

    def dense(h, w, g, i, o):
        q = {"e_gate": g, "e_in": i, "e_out": o}
        return jnp.sum(jnp.sin(_every_expert(h, chosen, w, q)))

    want = jax.grad(dense, range(5))(*args)
    for a, b in zip(jax.grad(grouped, range(5))(*args), want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _combined_with_the_next_tokens_experts(h, chosen, weights, e_gate, e_in, e_out):
    """A broken dispatch: each token gets the outputs the next token's experts computed."""
    y = moe.experts(h, chosen, weights, e_gate, e_in, e_out)
    return jnp.roll(y, 1, axis=0)


def test_a_broken_dispatch_is_caught():
    p = _layer0()
    h, chosen, weights = _routed(p)
    broken = _combined_with_the_next_tokens_experts(
        h, chosen, weights, p["e_gate"], p["e_in"], p["e_out"]
    )
    want = _every_expert(h, chosen, weights, p)
    # Off by as much as the outputs themselves, where the grouped experts agree to 1e-5.
    assert float(jnp.max(jnp.abs(broken - want))) > 0.5 * float(jnp.max(jnp.abs(want)))


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_is_softmax_then_top_k(renormalize):
    """Mixtral: softmax over every expert, the top k renormalized; Qwen3-MoE without
    norm_topk_prob: the top k's probabilities as they are."""
    p = _layer0()
    h = np.asarray(jax.random.normal(jax.random.key(3), (1, 9, CFG.d_model)))
    probs, logits, chosen, weights = moe.route(jnp.asarray(h), p["router"], 2, renormalize)
    z = h[0] @ np.asarray(p["router"], np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    want_probs = e / e.sum(-1, keepdims=True)
    top = np.argsort(-want_probs, axis=-1)[:, :2]
    want = np.take_along_axis(want_probs, top, -1)
    if renormalize:
        want = want / want.sum(-1, keepdims=True)
    np.testing.assert_array_equal(chosen[0], top)
    np.testing.assert_allclose(weights[0], want, rtol=1e-5)
    np.testing.assert_allclose(probs[0], want_probs, rtol=1e-5)
    assert np.allclose(np.sum(weights, -1), 1.0) == renormalize


def _explicit_objective(params, tokens, cfg, segments):
    """The language model's mean loss plus every layer's router losses as values (not
    through `moe`'s gradient hook)."""
    lm, aux, z = _explicit_losses(params, tokens, cfg, segments)
    return lm + cfg.moe_aux_loss * aux + cfg.moe_z_loss * z


def _explicit_losses(params, tokens, cfg, segments):
    """(the language model's mean loss, the load-balancing loss, the z-loss), the router
    losses summed from each layer's values: layer by layer, segment by segment."""
    losses = []
    plain = dataclasses.replace(cfg, moe_aux_loss=0.0, moe_z_loss=0.0)
    rows, length = tokens[:, :-1].shape
    routed = dataclasses.replace(cfg, router_tokens=rows * length)
    x_all, offset = [], 0
    k_cache = [jnp.zeros((rows, 0, cfg.kv_heads, cfg.head_dim))] * cfg.num_layers
    v_cache = list(k_cache)
    for seg in segments:
        x = model.embed(params, tokens[:, offset : offset + seg], cfg)
        for i in range(cfg.num_layers):
            p = jax.tree.map(lambda w, i=i: w[i], params["layers"])
            y, k, v = model.layer(p, x, k_cache[i], v_cache[i], offset, plain)
            # The MLP input is that of the layer's attention output added: recompute it.
            attn, _, _ = model._self_attention(
                model._Matmuls(p, None, 1), x, k_cache[i], v_cache[i], offset, plain, None, None
            )
            h = model.rms_norm(x + attn, p["mlp_norm"], cfg.norm_eps)
            probs, logits, chosen, _ = moe.route(h, p["router"], 2, cfg.router_renormalize)
            losses.append(moe.router_losses(probs, logits, chosen, routed, ()))
            k_cache[i] = jnp.concatenate([k_cache[i], k], 1)
            v_cache[i] = jnp.concatenate([v_cache[i], v], 1)
            x = y
        x_all.append(x)
        offset += seg
    y = jnp.concatenate(x_all, 1)
    lm = model.head_loss_sum(params, y, tokens[:, 1:], cfg) / tokens[:, 1:].size
    aux, z, _ = sum(losses)
    return lm, aux, z


@pytest.mark.parametrize("segments", [(4, 8)])
def test_the_router_losses_gradients_equal_autodiff_of_the_explicit_objective(segments):
    params = model.init_params(CFG, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (3, 13), 0, CFG.vocab_size)
    cfg = dataclasses.replace(CFG, router_segments=segments)
    got = jax.jit(jax.grad(model.loss), static_argnums=2)(params, tokens, cfg)
    explicit = jax.jit(jax.grad(_explicit_objective), static_argnums=(2, 3))
    want = explicit(params, tokens, CFG, segments)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7, err_msg=str(path))
    # The losses move the router: without them its gradient differs.
    none = dataclasses.replace(cfg, moe_aux_loss=0.0, moe_z_loss=0.0)
    plain = jax.grad(model.loss)(params, tokens, none)["layers"]["router"]
    assert float(jnp.max(jnp.abs(plain - got["layers"]["router"]))) > 1e-4


def test_the_router_losses_are_switch_transformers_per_row():
    """X * sum_e f_e * P_e per row (f: the share of its k assignments, P: the mean
    probability), and the mean squared logsumexp, against numpy."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 6, 4)).astype(np.float32)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    chosen = np.argsort(-probs, -1)[..., :2]
    cfg = dataclasses.replace(CFG, num_layers=1, router_tokens=12)
    f = np.stack([np.bincount(c.ravel(), minlength=4) / 6 for c in chosen])
    aux = np.mean([4 * np.sum(f[r] * probs[r].mean(0)) for r in range(2)])
    lse = np.log(np.exp(logits).sum(-1))
    got = moe.router_losses(jnp.asarray(probs), jnp.asarray(logits), chosen, cfg, ())
    np.testing.assert_allclose(got, [aux, np.mean(lse**2), 0.0], rtol=1e-5)


# (schedule, (data, stage, context, tensor), segments, remat, routing, rows); data 2 splits
# the experts over two devices. The default run takes SAMPLE, the shards MORE: every schedule.
SAMPLE = [
    ("seq1f1b", (2, 2, 1, 2), 2, "full", "mixtral", "plain"),
    ("seq_zb_h1", (2, 2, 1, 2), 2, "none", "qwen2", "packed"),
    ("seq_zb_h1", (1, 2, 2, 1), 4, "dots", "qwen", "packed"),
]
MORE = [
    ("seq1f1b", (1, 2, 1, 2), 2, "full", "mixtral", "plain"),
    ("seq1f1b_interleaved", (2, 2, 2, 1), 2, "full_layer", "qwen", "packed"),
    ("1f1b", (2, 2, 1, 1), 1, "layer", "mixtral", "plain"),
    ("gpipe", (1, 2, 2, 2), 2, "full", "mixtral", "packed"),
    ("seq1f1b", (2, 2, 1, 2), 2, "dots", "mixtral", "plain"),
    ("seq1f1b", (1, 2, 2, 2), 2, "full_layer", "qwen2", "plain"),
    ("interleaved_1f1b", (2, 2, 1, 2), 1, "dots", "qwen", "plain"),
    ("zb_h1", (2, 2, 1, 1), 1, "none", "mixtral", "packed"),
]


def _id(case):
    return "-".join(map(str, case))


def test_every_schedule_runs_a_mixture():
    assert {c[0] for c in SAMPLE + MORE} == set(schedule_lib.SCHEDULES)


@pytest.mark.parametrize("case", sampled(SAMPLE, MORE), ids=_id)
def test_the_pipeline_matches_the_reference(case):
    """Loss and every gradient, router and experts included, with both router losses on:
    tensor-split experts, packed rows, context, the split backward (experts' gradients in
    B), segments the router losses are taken over; `qwen2`: a gated shared expert."""
    schedule, mesh, segments, remat, routing, rows = case
    c = context_config(schedule, mesh, segments, remat, "llama")
    c.model.update(
        num_experts=4,
        experts_per_token=2,
        expert_d_ff=16,
        shared_expert_d_ff=24 if routing == "qwen2" else 0,
        moe_aux_loss=0.1,
        moe_z_loss=0.01,
        router_renormalize=routing == "mixtral",
    )
    check(c, rows == "packed")


# (schedule, (data, stage, context, tensor), segments, remat, rows) for 4 layers of which
# 1 and 2 are dense: each stage holds both kinds (each chunk, interleaved, one).
MIXED = [("seq_zb_h1", (1, 2, 2, 1), 2, "dots", "packed")]
MIXED_MORE = [
    ("seq1f1b", (2, 2, 1, 2), 2, "full", "plain"),
    ("seq_zb_h1", (2, 2, 1, 2), 2, "none", "packed"),
    ("seq1f1b_interleaved", (2, 2, 2, 1), 2, "full_layer", "packed"),
    ("1f1b", (2, 2, 1, 1), 1, "layer", "plain"),
]


def _mixed_config(schedule, mesh, segments, remat):
    c = context_config(schedule, mesh, segments, remat, "llama")
    c.model.update(
        num_layers=4,
        num_experts=4,
        experts_per_token=2,
        expert_d_ff=16,
        dense_layers=(1, 2),
        moe_aux_loss=0.1,
        moe_z_loss=0.01,
    )
    config_lib.validate(c, num_devices=int(np.prod(mesh)))
    return c


@pytest.mark.parametrize("case", sampled(MIXED, MIXED_MORE), ids=_id)
def test_layers_mixing_dense_and_sparse_mlps_match_the_reference(case):
    """A model whose layers 1 and 2 are dense (Qwen's mlp_only_layers): each layer runs its
    own MLP wherever the pipeline places it (the split backward's dense MLP gradients in
    B), loss and every gradient, router losses averaged over the sparse layers."""
    schedule, mesh, segments, remat, rows = case
    check(_mixed_config(schedule, mesh, segments, remat), rows == "packed")


def test_a_layer_running_another_layers_mlp_is_caught(monkeypatch):
    """Each layer given the kind of the layer before it (in the stage order the executor
    reads): a dense layer runs its (zero) experts, a sparse one its (zero) dense MLP, and
    the pipeline no longer equals the reference."""
    real = model.kinds

    def shifted(cfg, positions=None):
        kinds = real(cfg, positions)
        return kinds if positions is None else np.roll(kinds, 1)

    monkeypatch.setattr(model, "kinds", shifted)
    with pytest.raises(AssertionError):
        check(_mixed_config("seq1f1b", (1, 2, 1, 1), 2, "full"))


def test_a_mixed_models_other_mlp_is_zeros_and_flops_are_the_mean():
    """init: a dense layer's experts and router, a sparse layer's dense MLP, are zeros; the
    active parameters are the mean over the layers of each kind's."""
    cfg = dataclasses.replace(CFG, num_layers=3, dense_layers=(1,))
    layers = model.init_params(cfg, jax.random.key(0))["layers"]
    for name in ("router", "e_gate", "e_in", "e_out"):
        assert not np.any(layers[name][1]) and np.all(np.any(layers[name][::2], axis=(1, 2)))
    for name in model.DENSE_MLP:
        assert np.any(layers[name][1]) and not np.any(layers[name][::2])
    sparse, dense = (
        model.layer_matmul_params(dataclasses.replace(cfg, dense_layers=())),
        model.layer_matmul_params(dataclasses.replace(cfg, num_experts=0, dense_layers=())),
    )
    assert model.layer_matmul_params(cfg) == (2 * sparse + dense) / 3


def _moe_config(mesh, schedule="seq1f1b"):
    c = context_config(schedule, mesh, 2, "full", "llama")
    c.model.update(num_experts=4, experts_per_token=2, expert_d_ff=16, moe_aux_loss=0.1)
    return c


def test_the_step_reports_the_router_losses_each_layer_computes():
    """The training step's `aux_loss` and `z_loss` metrics, metered through a pipeline with
    the experts over 2 replicas and tensor 2, equal the sums of each layer's losses."""
    c = _moe_config((2, 2, 1, 2))
    c.model.update(moe_z_loss=0.01)
    run, mesh = run_of(c), sharding.mesh_of(c)
    params = model.init_params(run.model, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (c.train.global_batch_size, SEQ_LEN + 1), 0, 64)
    grad_fn = step.make_grad_fn(run, mesh)
    staged = layout.to_stage_order(params, run.placement)
    _, grads = jax.jit(grad_fn)(staged, jax.device_put(tokens, sharding.batch_sharding(mesh)))
    _, reported = model.router_metrics(grads)
    segments = run.spec.cfg.router_segments
    _, aux, z = _explicit_losses(params, tokens, dataclasses.replace(run.model, tensor=1), segments)
    assert len(segments) == 2
    np.testing.assert_allclose(reported["aux_loss"], aux, rtol=1e-5)
    np.testing.assert_allclose(reported["z_loss"], z, rtol=1e-5)


def test_a_capacity_keeps_each_experts_highest_weights():
    """Per row, each expert keeps its ceil(factor x L x k / X) assignments of the highest
    weights, against numpy; the others go to no expert, weight zero."""
    rng = np.random.default_rng(0)
    chosen = np.stack([rng.permutation(4)[:2] for _ in range(3 * 10)]).reshape(3, 10, 2)
    weights = rng.uniform(size=(3, 10, 2)).astype(np.float32)
    cfg = dataclasses.replace(CFG, moe_capacity_factor=1.0)  # ceil(1.0 * 20 / 4) = 5
    kept, kept_weights, dropped = moe.capped(jnp.asarray(chosen), jnp.asarray(weights), cfg, ())
    want = np.array(chosen)
    for r in range(3):
        for e in range(4):
            at = np.argwhere(chosen[r] == e)
            lowest = at[np.argsort(-weights[r][tuple(at.T)])][5:]
            want[r][tuple(lowest.T)] = 4
    np.testing.assert_array_equal(kept, want)
    np.testing.assert_array_equal(kept_weights, np.where(want < 4, weights, 0))
    np.testing.assert_array_equal(dropped, np.sum(want == 4, axis=(1, 2)))
    assert 0 < np.sum(dropped) < chosen.size


@pytest.mark.parametrize(
    "schedule, mesh, dispatch",
    [
        ("seq1f1b", (2, 2, 1, 2), "all_gather"),
        ("seq_zb_h1", (1, 2, 2, 1), "all_gather"),
        pytest.param("seq1f1b", (2, 2, 1, 2), "all_to_all", marks=pytest.mark.slow),
        ("seq_zb_h1", (2, 2, 2, 1), "all_to_all"),
    ],
    ids=str,
)
def test_a_capacity_drops_what_the_reference_drops(schedule, mesh, dispatch):
    """With a capacity factor the pipeline (experts over 2 replicas and tensor 2, or
    context 2, their tokens gathered or each sent to its expert by all-to-all) equals the
    reference, loss, gradients and each layer's dropped share."""
    c = _moe_config(mesh, schedule)
    c.model.update(moe_capacity_factor=1.0, moe_dispatch=dispatch)
    check(c)
    # And the reference does drop assignments, a share of them the step reports.
    cfg = dataclasses.replace(executor.make_spec(c).cfg, tensor=1, expert_parallel=1)
    params = model.metered(model.init_params(cfg, jax.random.key(0)), cfg)
    tokens = jax.random.randint(jax.random.key(1), (4, SEQ_LEN + 1), 0, 64)
    _, dropped = model.router_metrics(jax.grad(model.loss)(params, tokens, cfg))
    assert 0.01 < float(dropped["dropped"]) < 0.5, dropped


def test_all_to_all_buffers_short_of_the_capacity_are_caught(monkeypatch):
    """The all-to-all's buffers one slot short of what the capacity keeps: the assignments
    past them are sent nowhere, and the pipeline no longer equals the reference."""
    real = moe.exchanged
    monkeypatch.setattr(moe, "exchanged", lambda *args: real(*args[:-1], args[-1] - 1))
    c = _moe_config((2, 2, 1, 1))
    c.model.update(moe_capacity_factor=1.0, moe_dispatch="all_to_all")
    with pytest.raises(AssertionError):
        check(c)


def test_a_device_running_another_devices_experts_is_caught(monkeypatch):
    """Expert parallelism with every device's assignments offset as device 0's: the
    tokens meet the wrong experts, and the pipeline no longer equals the reference."""
    local = moe.local_experts
    monkeypatch.setattr(
        moe, "local_experts", lambda h, c, w, g, i, o, first: local(h, c, w, g, i, o, 0)
    )
    with pytest.raises(AssertionError):
        check(_moe_config((2, 2, 1, 1)))


def test_a_run_resumes_across_expert_splits(tmp_path):
    """Saved with the experts over 2 replicas (and the optimizer sharded over them),
    resumed over 4 and then over none: the losses of a straight run."""
    moe_keys = {
        **PIPELINED,
        "model.mlp": "swiglu",
        "model.num_experts": "4",
        "model.expert_d_ff": "32",
        "model.moe_aux_loss": "0.01",
    }
    meshes = {
        "2x2x2": {"mesh.data": "2", "mesh.stage": "2", "mesh.tensor": "2"},
        "4x2x1": {"mesh.data": "4", "mesh.stage": "2", "mesh.tensor": "1"},
        "1x4x2": {"mesh.data": "1", "mesh.stage": "4", "mesh.tensor": "2"},
    }

    def config(mesh, stop):
        return tiny_config(**{**moe_keys, **meshes[mesh], "train.stop_at": str(stop)})

    straight = trainer.run(config("2x2x2", 3), str(tmp_path / "a"))
    run = str(tmp_path / "b")
    resumed = trainer.run(config("2x2x2", 1), run)
    resumed += trainer.run(config("4x2x1", 2), run)
    resumed += trainer.run(config("1x4x2", 3), run)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for metric in ("loss", "aux_loss", "z_loss"):  # the router losses' values, reported
        np.testing.assert_allclose(
            [r[metric] for r in resumed], [r[metric] for r in straight], rtol=1e-5
        )
    assert all(r["aux_loss"] > 1.0 for r in straight)  # k = 2: 2 where perfectly balanced


def test_each_device_holds_its_experts_alone():
    """The train state over 2 data replicas: each device's block of an expert weight (and
    of its Adam moments) holds 2 of the 4 experts; the router stays whole."""
    from seqpipe.parallel import sharding

    c = tiny_config(**{**PIPELINED, "model.mlp": "swiglu", "model.num_experts": "4"})
    mesh = sharding.mesh_of(c)
    shapes = {"layers": {"e_in": jax.ShapeDtypeStruct((4, 4, 32, 64), jnp.float32)}}
    shapes["layers"]["router"] = jax.ShapeDtypeStruct((4, 32, 4), jnp.float32)
    placed = sharding.state_shardings({"params": shapes}, mesh)["params"]["layers"]
    assert placed["e_in"].shard_shape((4, 4, 32, 64)) == (1, 2, 32, 64)
    assert placed["router"].shard_shape((4, 32, 4)) == (1, 32, 4)


@needs_libtpu
def test_a_tpu_compile_executes_the_active_experts_alone(monkeypatch):
    """XLA's count of a layer's grouped experts, compiled for a TPU v5p (its grouped-matmul
    kernel), is the analytic count of the chosen experts: 1/X of the dense form's, which
    XLA's CPU lowering executes (every expert, the others' rows masked)."""
    for key, value in [
        ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
        ("TPU_ACCELERATOR_TYPE", "v5p-8"),
        ("TPU_WORKER_HOSTNAMES", "localhost"),
    ]:
        monkeypatch.setenv(key, value)
    device = topology.devices(topology.parse("v5p-8"))[0]
    tokens, k, d, f, x = 512, 2, 128, 256, 16
    where = jax.sharding.SingleDeviceSharding(device)
    args = [
        jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16, sharding=where),
        jax.ShapeDtypeStruct((tokens, k), jnp.int32, sharding=where),
        jax.ShapeDtypeStruct((tokens, k), jnp.float32, sharding=where),
        jax.ShapeDtypeStruct((x, d, f), jnp.bfloat16, sharding=where),
        jax.ShapeDtypeStruct((x, d, f), jnp.bfloat16, sharding=where),
        jax.ShapeDtypeStruct((x, f, d), jnp.bfloat16, sharding=where),
    ]
    compiled = jax.jit(moe.experts).lower(*args).compile()
    active = 3 * 2 * tokens * k * d * f  # the three matrices of each chosen expert
    assert compiled.cost_analysis()["flops"] == pytest.approx(active, rel=0.02)
    cpu = jax.jit(moe.experts).lower(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args))
    assert cpu.compile().cost_analysis()["flops"] > 0.9 * x * active


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"model.num_experts": "4", "model.experts_per_token": "5"},
            "model.experts_per_token=5 is more than model.num_experts=4; choose at most 4",
        ),
        ({"model.num_experts": "4", "model.mlp": "gelu"}, "model.num_experts=4 runs swiglu"),
        (
            {"model.num_experts": "4", "model.expert_d_ff": "6", "mesh.tensor": "4"},
            "each expert's width 6 (model.expert_d_ff, or model.d_ff) is not divisible by "
            "mesh.tensor=4",
        ),
        (
            {"model.num_experts": "6", "mesh.data": "4"},
            "model.num_experts=6 is not divisible by mesh.data=4, over which the experts are "
            "split; set mesh.data to a divisor of it (e.g. 3)",
        ),
        (
            {"model.moe_capacity_factor": "1.5"},
            "model.moe_capacity_factor=1.5 caps a mixture's experts, and model.num_experts=0",
        ),
        (
            {"model.num_experts": "4", "model.moe_dispatch": "all_to_all"},
            "model.moe_dispatch=all_to_all sends each expert a buffer its capacity bounds; set "
            "model.moe_capacity_factor > 0",
        ),
        (
            {"model.num_experts": "4", "model.dense_layers": "(0, 9)"},
            "model.dense_layers=(0, 9) must be a tuple of distinct layers in [0, 4)",
        ),
        (
            {"model.num_experts": "4", "model.dense_layers": "(0, 1, 2, 3)"},
            "model.dense_layers makes all 4 layers dense; set model.num_experts=0",
        ),
        (
            {"model.dense_layers": "(0,)"},
            "model.dense_layers=(0,) names a mixture's dense layers, and model.num_experts=0",
        ),
    ],
)
def test_bad_input_is_one_line(overrides, message):
    with pytest.raises(config_lib.ConfigError) as e:
        config_lib.load("tiny", {"model.mlp": "swiglu", **overrides})
    assert str(e.value).startswith(message) and "\n" not in str(e.value), e.value


@pytest.mark.parametrize(
    "name, total, active", [("mixtral_8x7b", 46.7, 12.9), ("qwen3_30b_a3b", 30.5, 3.3)]
)
def test_the_configs_have_the_published_parameter_counts(name, total, active):
    """Billions of parameters, all and those a token goes through (the chosen experts), to
    the published figure's last digit (Mistral rounds 12.88 up; Qwen cuts 3.35 to 3.3)."""
    cfg = model.GPTConfig.from_config(config_lib.load(name).model)
    shapes = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    count = model.num_params(shapes)
    idle = (cfg.num_experts - cfg.experts_per_token) * 3 * cfg.d_model * cfg.expert_width
    assert abs(count / 1e9 - total) < 0.06
    assert abs((count - idle * cfg.num_layers) / 1e9 - active) < 0.06
