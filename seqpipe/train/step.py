"""The train state and the jitted training step: gradients from the pipeline (or the
un-pipelined model), clipped and applied by the optimizer, a non-finite step skipped."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from seqpipe.hf import weights
from seqpipe.models import model, reference
from seqpipe.parallel import layout, sharding
from seqpipe.pipeline import executor, remat
from seqpipe.run.run_config import RunConfig
from seqpipe.train import checkpoint, optim

State = dict[str, Any]
GradFn = Callable[[model.Params, jax.Array], tuple[jax.Array, model.Params]]


def make_grad_fn(run: RunConfig, mesh: jax.sharding.Mesh) -> GradFn:
    """Loss and gradients of a [B, L+1] batch under the run's schedule; a mixture's
    gradients also hold its router meter's (`model.metered`)."""
    cfg = run.model
    if not run.pipelined:
        checkpoint = remat.POLICIES[run.remat].reference
        grad_fn = lambda params, tokens: reference.loss_and_grads(params, tokens, cfg, checkpoint)
        grad_fn = reference.unpipelined(grad_fn, cfg, mesh)
    else:
        spec, scatter = run.spec, run.shard_optimizer
        grad_fn = lambda params, tokens: executor.loss_and_grads(
            params, tokens, spec, mesh, scatter
        )
    return lambda params, tokens: grad_fn(model.metered(params, cfg), tokens)


def _init_fn(run: RunConfig, tx: optax.GradientTransformation) -> Callable:
    def init(key):
        params = model.init_params(run.model, key)
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}
        # Born in the order the step reads, as the state stays (checkpoints excepted).
        return layout.to_stage_order(state, run.placement)

    return init


def abstract_state(
    run: RunConfig, mesh: jax.sharding.Mesh, tx: optax.GradientTransformation
) -> State:
    """Shapes, dtypes and shardings of the train state, with nothing allocated."""
    shapes = jax.eval_shape(_init_fn(run, tx), jax.random.key(run.train.seed))
    shardings = sharding.state_shardings(shapes, mesh, run.shard_optimizer)
    return checkpoint.abstract(shapes, shardings)


def init_state(run: RunConfig, mesh: jax.sharding.Mesh, tx: optax.GradientTransformation) -> State:
    """Parameters and optimizer state, created directly in their shardings."""
    abstract = abstract_state(run, mesh, tx)
    shardings = jax.tree.map(lambda s: s.sharding, abstract)
    if run.train.get("init_from"):
        return _imported_state(run, abstract, shardings, tx)
    init = jax.jit(_init_fn(run, tx), out_shardings=shardings)
    return init(jax.random.key(run.train.seed))


def _imported_state(run: RunConfig, abstract: State, shardings, tx) -> State:
    """The state at step 0 with train.init_from's weights (`seqpipe.hf`), each device's
    block read from the files, and fresh optimizer moments."""
    positions = run.placement.positions()
    params = weights.initial_params(run.train.init_from, run.model, abstract["params"], positions)

    def init(params):
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}

    return jax.jit(init, out_shardings=shardings, donate_argnums=0)(params)


def make_train_step(
    grad_fn: GradFn,
    tx: optax.GradientTransformation,
    lr_fn,
    mesh: jax.sharding.Mesh,
    shard_optimizer: bool = False,
    inject_nan_at: tuple = (),
) -> Callable:
    """The jitted step. A non-finite loss or gradient norm leaves the parameters and the
    optimizer state as they were (`metrics["skipped"]` is 1); only the step count moves on.

    With `shard_optimizer` the gradients arrive (or are put) in the moments' shardings,
    split over `data`; each replica updates its share of the moments and the parameters,
    and pinning the new state to `sharding.state_shardings` makes XLA all-gather the
    parameters back onto every replica. The state leaves in the shardings it came in.

    `inject_nan_at` (tests only) makes the loss and gradients of those steps NaN.
    """

    def train_step(state: State, tokens: jax.Array) -> tuple[State, dict]:
        shardings = sharding.state_shardings(state, mesh, shard_optimizer)
        loss, grads = grad_fn(state["params"], tokens)
        grads, router = model.router_metrics(grads)  # a mixture's, as metrics
        # The pipeline already returns them so; without one, XLA reduce-scatters here.
        grads = jax.lax.with_sharding_constraint(
            grads, sharding.gradient_shardings(grads, mesh, shard_optimizer)
        )
        if inject_nan_at:
            poison = jnp.isin(state["step"] + 1, jnp.asarray(inject_nan_at))
            loss = jnp.where(poison, jnp.nan, loss)
            grads = jax.tree.map(lambda g: jnp.where(poison, jnp.nan, g), grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        # A select on device, not a branch on the host: no sync, and NaNs never reach state.
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        new_state = {
            "step": state["step"] + 1,
            "params": keep(params, state["params"]),
            "opt_state": keep(opt_state, state["opt_state"]),
        }
        new_state = jax.lax.with_sharding_constraint(new_state, shardings)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            # The rate this step's update used: the schedule at the optimizer's own count,
            # which a skipped step does not advance (the train state's step does).
            "learning_rate": lr_fn(optim.schedule_count(state["opt_state"])),
            "skipped": (~finite).astype(jnp.int32),
            **router,
        }
        return new_state, metrics

    return jax.jit(train_step, donate_argnums=0)


def abstract_batch(run: RunConfig, mesh: jax.sharding.Mesh):
    """The step's batch, abstract: tokens, and with `data.packing` the packed rows' ids
    and positions (`seqpipe.models.document_mask`)."""
    t = run.train
    rows = jax.ShapeDtypeStruct(
        (t.global_batch_size, t.seq_len + 1), jnp.int32, sharding=sharding.batch_sharding(mesh)
    )
    if run.config.data.packing == "none":
        return rows
    return {"tokens": rows, "documents": rows, "positions": rows}
