"""AdamW with linear warm-up, cosine decay and global-norm clipping."""

import jax
import optax
from ml_collections import ConfigDict


def lr_schedule(train_cfg: ConfigDict) -> optax.Schedule:
    peak = train_cfg.learning_rate
    warmup = min(train_cfg.warmup_steps, max(train_cfg.steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=warmup,
        decay_steps=max(train_cfg.steps, warmup + 1),
        end_value=peak * train_cfg.min_lr_ratio,
    )


def schedule_count(opt_state) -> jax.Array:
    """The count the learning-rate schedule reads: the updates applied so far.

    Kept by optax's `scale_by_schedule`; a skipped step keeps the old optimizer state, so
    this stays behind the train state's step. Found by its state's name, not a position
    in the chain, and an error (not a wrong rate) if the optimizer has no such count."""
    count = optax.tree_utils.tree_get(
        opt_state,
        "count",
        filtering=lambda path, _: getattr(path[-1], "tuple_name", "") == "ScaleByScheduleState",
    )
    if count is None:
        raise ValueError("the optimizer state holds no ScaleByScheduleState count")
    return count


def _decay_mask(params):
    """Weight decay on matrices only, not on norm gains."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "norm" not in jax.tree_util.keystr(path), params
    )


def make_optimizer(train_cfg: ConfigDict) -> optax.GradientTransformation:
    clip = train_cfg.grad_clip
    return optax.chain(
        optax.clip_by_global_norm(clip) if clip > 0 else optax.identity(),
        optax.adamw(
            lr_schedule(train_cfg),
            b1=train_cfg.b1,
            b2=train_cfg.b2,
            weight_decay=train_cfg.weight_decay,
            mask=_decay_mask,
        ),
    )
