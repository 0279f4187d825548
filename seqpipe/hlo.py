"""Reading a compiled program's HLO text."""

import re

COLLECTIVES = ("all-reduce", "all-gather", "collective-permute", "all-to-all", "reduce-scatter")
# `%name = shape op(...)`: the op follows a space (the name after `%` never does). An async
# collective is one `-start` and one `-done`; the start counts it.
_OP = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """How many of each collective the program holds: instructions in the text, not
    executions (one in a loop body counts once)."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    for match in _OP.finditer(hlo_text):
        counts[match[1]] += 1
    return counts
