"""The names an attention kernel's forward gives the residuals its backward reads besides
its inputs: the output and the log-sum-exp, each linear in the segment.

A checkpoint policy sees inside a `jax.custom_vjp`'s forward. Where it saves these, a
backward that needs them does not run the kernel's forward again (`dots`); the score
blocks, which grow with the segment times the K/V length, it does not save."""

from jax.ad_checkpoint import checkpoint_name

OUT = "attention_out"
LSE = "attention_lse"
NAMES = (OUT, LSE)


def mark(out, lse):
    """`out` and `lse` under their names, for a policy to save."""
    return checkpoint_name(out, OUT), checkpoint_name(lse, LSE)
