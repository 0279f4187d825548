"""All-pairs sampling of a test matrix: every pair of factor values that some valid case
holds is held by at least one sampled case (greedy; deterministic)."""

import itertools
from collections.abc import Callable, Sequence


def _pairs(case: tuple) -> set:
    return {(i, case[i], j, case[j]) for i, j in itertools.combinations(range(len(case)), 2)}


def all_pairs(factors: Sequence[Sequence], valid: Callable[..., bool]) -> list[tuple]:
    cases = [c for c in itertools.product(*factors) if valid(*c)]
    uncovered = set().union(*(_pairs(c) for c in cases))
    chosen = []
    while uncovered:
        best = max(cases, key=lambda c: len(_pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= _pairs(best)
    return chosen


def full_product(factors: Sequence[Sequence], valid: Callable[..., bool]) -> list[tuple]:
    return [c for c in itertools.product(*factors) if valid(*c)]
