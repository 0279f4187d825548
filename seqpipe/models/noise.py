"""The float32 noise floor, and the verdict of a pipelined loss and gradients against it.

A float32 loss or gradient differs from the exact one by rounding, in an amount that
depends on its summation order and on how much its sums cancel: a norm gain's gradient,
summed over every token with both signs, carries far more than a matmul's. So no fixed
tolerance is right for every tensor. Instead each result is measured against a float64
truth (the un-pipelined model in float64 on the CPU, or transformers' float64 fixtures),
norm-wise per tensor, ||x - truth|| / ||truth||, and the float32 reference's own error is
the noise floor: a pipeline passes when its error is at most `FACTOR` times that floor
(never below float32's unit roundoff) for the loss and for every tensor.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from seqpipe.models import reference
from seqpipe.models.model import GPTConfig

# float32's unit roundoff: the least noise assumed (a float32 reference that lands on the
# truth by luck must not make the bound vanish).
UNIT_ROUNDOFF = 2.0**-24
# How many times the float32 reference's error a pipeline's may be: 40 drawn healthy
# configurations reached 2.1, the mildest broken variant 7.9e5 (docs/reliability.md).
FACTOR = 10.0


def normwise(actual, truth) -> dict[str, float]:
    """||actual - truth|| / ||truth|| of each leaf (float64; a zero truth counts as the
    smallest float32 normal), by its path."""
    errors = {}
    for (path, a), t in zip(
        jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(truth), strict=True
    ):
        a, t = np.asarray(a, np.float64), np.asarray(t, np.float64)
        scale = max(float(np.linalg.norm(t)), float(np.finfo(np.float32).tiny))
        errors[jax.tree_util.keystr(path)] = float(np.linalg.norm(a - t)) / scale
    return errors


def float64_reference(params, batch, cfg: GPTConfig):
    """The un-pipelined model's loss and gradients in float64, on the CPU (`xla`
    attention, no remat): the truth float32 results are measured against."""
    cpu = jax.devices("cpu")[0]
    cfg = dataclasses.replace(cfg, dtype="float64", param_dtype="float64", attention="xla")
    host = jax.device_get(batch)
    with jax.enable_x64(True), jax.default_device(cpu):
        params = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float64)), params)
        batch = jax.tree.map(jnp.asarray, host)
        # A closure, not `jit(reference.loss_and_grads, static_argnums=2)`: jax keeps a
        # long-lived function's executables, one per config, until `jax.clear_caches`.
        step = jax.jit(lambda p, b: reference.loss_and_grads(p, b, cfg))
        loss, grads = step(params, batch)
        return float(loss), jax.tree.map(np.asarray, grads)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """How far a float32 result (loss, gradients) is from the truth, in units of the float32
    reference's own distance (`noise`): `ratio` is the worst, at `worst` ("loss" or a
    leaf's path)."""

    ratio: float
    worst: str
    error: float  # the result's own normwise error there
    noise: float  # the float32 reference's there (the floor: at least UNIT_ROUNDOFF)

    @property
    def ok(self) -> bool:
        return bool(np.isfinite(self.ratio)) and self.ratio <= FACTOR

    def line(self) -> str:
        return (
            f"within {self.ratio:.1f}x the float32 noise (worst {self.worst}: "
            f"{self.error:.1e} against the reference's {self.noise:.1e}; at most {FACTOR:g}x)"
        )


def judge(result, float32_reference, truth) -> Verdict:
    """The verdict on `result` ((loss, gradients) in float32) against `truth` (float64),
    with `float32_reference`'s own distance from the truth as the noise floor."""
    (loss, grads), (ref_loss, ref_grads), (true_loss, true_grads) = (
        result,
        float32_reference,
        truth,
    )
    errors = {"loss": abs(float(loss) - true_loss) / abs(true_loss), **normwise(grads, true_grads)}
    noise = {"loss": abs(float(ref_loss) - true_loss) / abs(true_loss)}
    noise.update(normwise(ref_grads, true_grads))
    ratios = {k: errors[k] / max(noise[k], UNIT_ROUNDOFF) for k in errors}
    worst = max(ratios, key=lambda k: ratios[k] if np.isfinite(ratios[k]) else np.inf)
    return Verdict(ratios[worst], worst, errors[worst], max(noise[worst], UNIT_ROUNDOFF))
