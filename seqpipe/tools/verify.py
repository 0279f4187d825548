"""Check a config's pipeline against the un-pipelined reference on one real batch.

    python -m seqpipe.tools.verify --config configs/tiny.py [--config.key=value ...]

Computes the loss and gradients with the configured schedule and with the reference,
both in float32, and the reference in float64 on the CPU; prints how far the pipeline is
from the float64 truth in units of the float32 reference's own distance (`noise`), and
exits 0 only within `noise.FACTOR` of it.
"""

import dataclasses
import sys

import jax

from seqpipe.data import loader
from seqpipe.hf import weights
from seqpipe.models import model, noise, reference
from seqpipe.parallel import layout, sharding
from seqpipe.pipeline import executor
from seqpipe.run import cli, run_config


def canonical_loss_and_grads(params, tokens_BxL1, spec, mesh):
    """`executor.loss_and_grads` on and for canonical layers, as the reference has them."""
    placement = spec.placement
    loss, grads = executor.loss_and_grads(
        layout.to_stage_order(params, placement), tokens_BxL1, spec, mesh
    )
    return loss, layout.to_canonical(grads, placement)


def compare(run, tokens_BxL1, mesh) -> dict:
    """A run's pipeline (a `run_config.RunConfig`) against the reference, both in float32,
    each measured from the float64 reference (`noise.judge`), on a batch of tokens
    [B, L+1] or of packed rows (a dict: `seqpipe.data.packing`)."""
    cfg = dataclasses.replace(run.spec.cfg, dtype="float32", param_dtype="float32")
    spec = dataclasses.replace(run.spec, cfg=cfg)
    if run.train.init_from:  # a HF checkpoint's weights (`seqpipe.hf`), in float32
        params = weights.load(run.train.init_from.removeprefix("hf:"))[1]
    else:
        params = model.init_params(spec.cfg, jax.random.key(run.train.seed))
    # A mixture's router losses, metered, are compared as its gradients are.
    params = model.metered(params, spec.cfg)
    ref = jax.jit(lambda p, t: reference.loss_and_grads(p, t, spec.cfg))(params, tokens_BxL1)
    result = jax.jit(lambda p, t: canonical_loss_and_grads(p, t, spec, mesh))(params, tokens_BxL1)
    truth = noise.float64_reference(params, tokens_BxL1, spec.cfg)
    verdict = noise.judge(result, ref, truth)
    router = {  # a mixture's metered router losses, the pipeline's and the reference's
        f"{who}_{k}": float(v)
        for who, (_, grads) in (("router", result), ("reference", ref))
        for k, v in model.router_metrics(grads)[1].items()
    }
    return {
        "loss": float(result[0]),
        "reference_loss": float(ref[0]),
        "float64_loss": truth[0],
        **router,
        "noise_ratio": verdict.ratio,
        "worst": verdict.worst,
        "verdict": verdict.line(),
        "ok": verdict.ok,
    }


def verify(config) -> dict:
    """`compare` on the first batch `config` (resolved: no -1 axis) reads from its corpus;
    the result also says whether the rows were packed (`packed`). Writes nothing but the
    token cache."""
    mesh = sharding.mesh_of(config)
    # The stream keeps its documents, which packed rows (loader.packing) are made of.
    train_stream, _, _ = loader.read_corpus(config)
    rows = loader.local_rows(config, mesh)
    batch = loader.global_batch(
        next(loader.train_iterator(config, train_stream, rows)),
        mesh,
        config.train.global_batch_size,
    )
    run = run_config.resolve(config, list(mesh.devices.flat))
    return {**compare(run, batch, mesh), "packed": isinstance(batch, dict)}


def main(argv: list[str]) -> int:
    config, args = cli.load_or_exit(argv, "python -m seqpipe.tools.verify")
    cli.quiet_libtpu()
    config = cli.resolve_or_exit(config)  # a mesh axis at -1 gets its size

    if config.pipeline.schedule == "none":
        print("error: pipeline.schedule=none: nothing to verify; set a schedule", file=sys.stderr)
        return 2
    r = cli.run_or_exit(lambda: verify(config))
    packed = " on packed rows" if r["packed"] else ""
    router, checked = "", "loss and gradients"
    if "router_aux_loss" in r:  # a mixture's, compared with its gradients
        router = (
            f"  aux_loss {r['router_aux_loss']:.6f} (reference {r['reference_aux_loss']:.6f})"
            f"  z_loss {r['router_z_loss']:.6f} (reference {r['reference_z_loss']:.6f})"
        )
        checked = "loss, router losses and gradients"
    print(
        f"schedule {config.pipeline.schedule}{packed}  loss {r['loss']:.6f} (reference "
        f"{r['reference_loss']:.6f}, float64 {r['float64_loss']:.6f}){router}  {checked} "
        f"{r['verdict']}  {'OK' if r['ok'] else 'MISMATCH'}"
    )
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
