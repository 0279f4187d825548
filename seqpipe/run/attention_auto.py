"""`model.attention=auto` where its kernel may not fit: on a TPU, splash if the step it
compiles fits the device's memory, else blockwise.

splash is the fused kernel, but under `pipeline.remat=none` every layer keeps splash's
residuals as long as the context: gpt_30b at 65536 on v5p-128 (seq1f1b K=4 M=16) needs
109.8 GiB a chip with it and 53.8 with blockwise, of 95. Where a budget is known (the
device's allocator, a `--topology` target), `auto` compiles the kernel's step and keeps it
if its peak is within `remat_auto.HEADROOM` of the budget; else the exact fallback
(`FALLBACK`) if that fits; else whichever needs less. Without a budget, or where `auto`
picks no kernel with a fallback (CPUs, GPUs), `attention.resolve` picks without compiling.
`seqpipe.run.run_config.resolve` compiles the candidates and applies `choose`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ml_collections import ConfigDict

from seqpipe.run.remat_auto import first_fit, fit_line

# The kernel `auto` prefers on a platform, and what it falls back to when that kernel's
# step does not fit.
FALLBACK = {"splash": "blockwise"}


@dataclasses.dataclass(frozen=True)
class Choice:
    name: str
    budget: int  # bytes a device may use
    peaks: dict[str, int]  # the implementations compiled, in order, and their peak bytes

    def line(self) -> str:
        """One line for the log: what was picked, and why."""
        return fit_line(self.name, self.budget, self.peaks)


def candidates(first: str) -> tuple[str, ...]:
    """What `auto` may run where it resolves to `first` (`attention.resolve`), in order of
    preference."""
    return (first, FALLBACK[first]) if first in FALLBACK else (first,)


def choose(peak_of: Callable[[str], int], names: tuple[str, ...], budget: int) -> Choice:
    """The first of `names` whose `peak_of(name)` (bytes a device) is within HEADROOM of
    `budget`; if none is, the one that needs least."""
    name, peaks = first_fit(peak_of, names, budget)
    return Choice(name, budget, peaks)


def with_attention(config: ConfigDict, name: str) -> ConfigDict:
    c = config.copy_and_resolve_references()
    with c.unlocked():
        c.model.attention = name
    return c
