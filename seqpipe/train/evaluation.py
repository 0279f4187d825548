"""Evaluation: the mean loss of held-out batches through the pipeline's forwards alone."""

import sys
from collections.abc import Callable

import jax

from seqpipe.models import reference
from seqpipe.pipeline import executor
from seqpipe.pipeline import spec as spec_lib
from seqpipe.run.run_config import RunConfig


def make_eval_fn(run: RunConfig, mesh: jax.sharding.Mesh) -> Callable:
    """Mean loss of a [B, L+1] batch, no gradients: through the pipeline's forwards alone
    (the training step's stages, segments and micro-batches) when there is a pipeline."""
    if not run.pipelined:
        cfg = run.model
        return jax.jit(
            reference.unpipelined(
                lambda params, batch: reference.batch_loss(params, batch, cfg), cfg, mesh
            )
        )
    spec = spec_lib.forward_only(run.spec)
    return jax.jit(lambda params, tokens: executor.eval_loss(params, tokens, spec, mesh))


def evaluate(eval_fn: Callable, params, batches: list, step: int, kept: str) -> list | None:
    """The eval losses of `params`, at most two batches in flight (as the steps:
    dispatching a hundred at once stalled XLA's CPU collectives until it aborted); None,
    with a line that ends in `kept`, if the backend fails: training goes on."""
    losses = []
    try:
        for i, batch in enumerate(batches):
            losses.append(eval_fn(params, batch))
            if i:
                jax.block_until_ready(losses[i - 1])
        return jax.block_until_ready(losses)
    except jax.errors.JaxRuntimeError as e:
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        print(
            f"warning: the evaluation at step {step} failed ({reason}); {kept}, training goes on",
            file=sys.stderr,
            flush=True,
        )
        return None
