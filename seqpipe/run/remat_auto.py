"""`pipeline.remat=auto`: the policy that recomputes least among those whose compiled step
fits the device's memory.

The same model fits `dots` on one GPU and needs `full` on a smaller one (gpt_1b at 2048 x
32, compiled for them: 82 GiB with `dots`, 33 GiB with `full`; an H200 has 141, an H100
79), so no config can name the fastest policy for every device. `auto` asks XLA: it
compiles the step (and the evaluation beside it) for each policy in `ORDER`, from least
recompute to most, and keeps the first whose peak memory is within `HEADROOM` of the
budget. Where there is no budget to compare with (the CPU: its memory is the host's),
`auto` is `full`, the default, and nothing is compiled. `seqpipe.run.run_config.resolve`
compiles the policies' steps and applies `choose`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ml_collections import ConfigDict

# From least recomputation to most (`remat.POLICIES[...].matmul_passes`: 3, 3, 4, 4, 5).
ORDER = ("none", "dots", "layer", "full", "full_layer")
FALLBACK = "full"
# XLA's figure leaves out what the runtime allocates beside the program (cuBLAS and cuDNN
# workspaces, collective buffers) and what fragmentation costs.
HEADROOM = 0.9


@dataclasses.dataclass(frozen=True)
class Choice:
    policy: str
    budget: int | None  # bytes a device may use, None where unknown
    peaks: dict[str, int]  # the policies compiled, in order, and their peak bytes

    def line(self) -> str:
        """One line for the log: what was picked, and why."""
        if self.budget is None:
            return f"auto -> {self.policy} (no device memory to fit: the default)"
        return fit_line(self.policy, self.budget, self.peaks)


def first_fit(peak_of: Callable[[str], int], names, budget: int) -> tuple[str, dict[str, int]]:
    """The first of `names` whose `peak_of(name)` (bytes a device needs) is within HEADROOM
    of `budget`, else the one that needs least; and the peaks compiled, in order. Also
    `attention=auto`'s rule (`seqpipe.run.attention_auto`)."""
    peaks = {}
    for name in names:
        peaks[name] = peak_of(name)
        if peaks[name] <= HEADROOM * budget:
            return name, peaks
    return min(peaks, key=peaks.get), peaks


def fit_line(name: str, budget: int, peaks: dict[str, int]) -> str:
    """`auto -> name (fits or least; the peaks; the limit)`: what `first_fit` picked, why."""
    gib = lambda b: f"{b / 2**30:.1f}"  # noqa: E731
    tried = ", ".join(f"{n} {gib(b)}" for n, b in peaks.items())
    limit = f"{gib(HEADROOM * budget)} GiB ({HEADROOM:.0%} of {gib(budget)})"
    verdict = "fits" if peaks.get(name, 0) <= HEADROOM * budget else "least"
    return f"auto -> {name} ({verdict}; peak GiB: {tried}; limit {limit})"


def device_budget(devices: list) -> int | None:
    """The memory JAX may allocate on a device of `devices` that this process drives (its
    allocator's limit: every process reads its own, so all choose alike); None on the CPU
    and for compile-only devices (a `--topology` target says its own, `budget()`)."""
    import jax

    device = next((d for d in devices if d.process_index == jax.process_index()), devices[0])
    if device.platform == "cpu":
        return None
    try:
        stats = device.memory_stats() or {}
    except Exception:  # compile-only devices have no allocator
        return None
    return stats.get("bytes_limit")


def choose(peak_of, budget: int | None) -> Choice:
    """The first policy of `ORDER` whose `peak_of(policy)` (bytes a device needs) is within
    HEADROOM of `budget`; if none is, the one that needs least."""
    if budget is None:
        return Choice(FALLBACK, None, {})
    policy, peaks = first_fit(peak_of, ORDER, budget)
    return Choice(policy, budget, peaks)


def with_policy(config: ConfigDict, policy: str) -> ConfigDict:
    c = config.copy_and_resolve_references()
    with c.unlocked():
        c.pipeline.remat = policy
    return c
