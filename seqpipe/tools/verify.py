"""Check a config's pipeline against the un-pipelined reference on one real batch.

    python -m seqpipe.tools.verify --config configs/tiny.py [--config.key=value ...]

Computes loss and gradients with the configured schedule and with the reference, both in
float32, prints the largest relative differences, and exits 0 only within tolerance.
"""

import dataclasses
import sys

import jax
import numpy as np

from seqpipe.data import loader
from seqpipe.hf import weights
from seqpipe.models import model, reference
from seqpipe.parallel import layout, sharding
from seqpipe.pipeline import executor
from seqpipe.run import cli, run_config

# Relative to each gradient leaf's largest magnitude; float32 summation-order noise is
# about 1e-6 here, whatever the schedule.
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5


def max_relative_error(actual, expected) -> tuple[str, float]:
    """The worst leaf and its max |actual - expected| / max |expected|."""
    worst = ("", 0.0)
    for (path, a), e in zip(
        jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True
    ):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        scale = max(float(np.max(np.abs(e))), np.finfo(np.float32).tiny)
        err = float(np.max(np.abs(a - e))) / scale
        if err > worst[1] or not np.isfinite(err):
            worst = (jax.tree_util.keystr(path), err)
    return worst


def canonical_loss_and_grads(params, tokens_BxL1, spec, mesh):
    """`executor.loss_and_grads` on and for canonical layers, as the reference has them."""
    placement = spec.placement
    loss, grads = executor.loss_and_grads(
        layout.to_stage_order(params, placement), tokens_BxL1, spec, mesh
    )
    return loss, layout.to_canonical(grads, placement)


def compare(run, tokens_BxL1, mesh) -> dict:
    """Loss and gradient differences between a run's pipeline (a `run_config.RunConfig`)
    and the reference, both in float32, on a batch of tokens [B, L+1] or of packed rows
    (a dict: `seqpipe.data.packing`)."""
    cfg = dataclasses.replace(run.spec.cfg, dtype="float32", param_dtype="float32")
    spec = dataclasses.replace(run.spec, cfg=cfg)
    if run.train.init_from:  # a HF checkpoint's weights (`seqpipe.hf`), in float32
        params = weights.load(run.train.init_from.removeprefix("hf:"))[1]
    else:
        params = model.init_params(spec.cfg, jax.random.key(run.train.seed))
    ref_loss, ref_grads = jax.jit(reference.loss_and_grads, static_argnums=2)(
        params, tokens_BxL1, spec.cfg
    )
    loss, grads = jax.jit(lambda p, t: canonical_loss_and_grads(p, t, spec, mesh))(
        params, tokens_BxL1
    )
    leaf, grad_err = max_relative_error(grads, ref_grads)
    loss_err = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
    return {
        "loss": float(loss),
        "reference_loss": float(ref_loss),
        "loss_rel_err": loss_err,
        "grad_rel_err": grad_err,
        "worst_leaf": leaf,
        "ok": loss_err <= LOSS_RTOL and grad_err <= GRAD_RTOL,
    }


def main(argv: list[str]) -> int:
    config, args = cli.load_or_exit(argv, "python -m seqpipe.tools.verify")
    cli.quiet_libtpu()
    config = cli.resolve_or_exit(config)  # a mesh axis at -1 gets its size

    if config.pipeline.schedule == "none":
        print("error: pipeline.schedule=none: nothing to verify; set a schedule", file=sys.stderr)
        return 2
    mesh = sharding.mesh_of(config)
    # A check writes nothing: no workdir, only the token cache. The stream keeps its
    # documents, which packed rows (loader.packing) are made of.
    train_stream, _, _ = cli.run_or_exit(lambda: loader.read_corpus(config))
    rows = cli.run_or_exit(lambda: loader.local_rows(config, mesh))
    batch = loader.global_batch(
        next(loader.train_iterator(config, train_stream, rows)),
        mesh,
        config.train.global_batch_size,
    )
    run = cli.run_or_exit(lambda: run_config.resolve(config, list(mesh.devices.flat)))
    r = cli.run_or_exit(lambda: compare(run, batch, mesh))
    packed = " on packed rows" if isinstance(batch, dict) else ""
    print(
        f"schedule {config.pipeline.schedule}{packed}  loss {r['loss']:.6f} (reference "
        f"{r['reference_loss']:.6f}, rel err {r['loss_rel_err']:.1e} <= {LOSS_RTOL:.0e})  "
        f"max grad rel err {r['grad_rel_err']:.1e} <= {GRAD_RTOL:.0e} at {r['worst_leaf']}  "
        f"{'OK' if r['ok'] else 'MISMATCH'}"
    )
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
