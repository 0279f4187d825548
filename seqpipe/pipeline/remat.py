"""What a pipelined forward keeps for its backward: the one table of `pipeline.remat` policies.

Pure data (no jax), so the config can validate against it cheaply. The behaviour lives in
`seqpipe.pipeline.remat_strategies`, in the class a row names (`strategy`): a new policy is a row
here and, if no strategy there runs it, a class there.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Policy:
    name: str
    keeps_residuals: bool  # the forward stashes its vjp's residuals; else only its input
    checkpoint: str | None  # per-layer policy inside a unit (`model.CHECKPOINT_POLICIES`)
    reference: str | None  # the un-pipelined oracle's per-layer policy under this setting
    matmul_passes: int  # forward-equivalents a layer's matmuls run per step (`tools.flops`)
    doc: str
    strategy: str  # the `remat_strategies` class that runs its forward and backward
    # The executor casts the weights to the compute dtype once a step (a copy of them beside
    # the step) rather than in each unit's each layer. Required where a vjp keeps residuals
    # (else each stashed unit keeps its own cast copy); off for `full_layer`, whose point
    # is long context's memory (gpt_1b at 131072: +4.7 GiB on CPU, +1.9 at 32768 on H200).
    casts_once: bool = True


_KEEP = "KeepLayerResiduals"  # the strategy of the policies that keep residuals
POLICIES = {
    p.name: p
    for p in (
        # With no stage to recompute, the reference recomputes layer by layer.
        Policy(
            "full",
            False,
            None,
            "layer",
            4,
            "the stage input; the backward re-runs the unit",
            "RecomputeInput",
        ),
        # Long context: the unit's recompute keeps one layer's residuals, not every
        # layer's (each [b, L_k, ...] per layer), for one more forward of the chunk.
        Policy(
            "full_layer",
            False,
            "layer",
            "layer",
            5,
            "the stage input; the backward re-runs the unit, then each layer under its vjp",
            "LayerwiseRecompute",
            casts_once=False,
        ),
        Policy(
            "layer", True, "layer", "layer", 4, "each layer's input; recompute one layer", _KEEP
        ),
        Policy("dots", True, "dots", "dots", 3, "each layer's matmul outputs", _KEEP),
        Policy("none", True, None, None, 3, "every residual (the paper's setting)", _KEEP),
    )
}
