"""How far the analytic memory model (`plan.memory`) is trusted: `LOW` and `HIGH` bound
the compiled total over the estimate (measured, `docs/planner.md`); pruning rejects a
candidate only when even LOW times its estimate exceeds the budget (`verdict`).
"""

# The compiled peak over the estimate stayed within [LOW, HIGH] on the checked
# candidates (docs/planner.md: 0.742 to 1.187 on an H200 board, 0.916 to 1.871 on TPU
# slices): pruning trusts no more than that. HIGH only labels a candidate `fits` before
# it compiles.
LOW = 0.7
HIGH = 1.9


def verdict(estimate_bytes: int, budget: int) -> str:
    """`fits` (even at HIGH times the estimate), `over` (even at LOW times it: the
    analytic model rejects it alone) or `boundary` (only a compile decides)."""
    if estimate_bytes * HIGH <= budget:
        return "fits"
    if estimate_bytes * LOW > budget:
        return "over"
    return "boundary"
