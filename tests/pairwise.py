"""All-pairs sampling of a test matrix: every pair of factor values that some valid case
holds is held by at least one sampled case (greedy; deterministic). The sample runs by
default, the rest of the matrix in the shards (`sampled`, `matrix`)."""

import itertools
from collections.abc import Callable, Sequence

import pytest


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


def sampled(default: Sequence, more: Sequence) -> list:
    """pytest parameters: `default` in every run, the rest of `more` marked `slow` (run by
    the shards, `make test-shard`)."""
    rest = [c for c in more if c not in default]
    return [*default, *(pytest.param(c, marks=pytest.mark.slow) for c in rest)]


def matrix(factors: Sequence[Sequence], valid: Callable[..., bool], extra: Sequence = ()) -> list:
    """pytest parameters of a test matrix: an all-pairs sample (and `extra`) in every run,
    the rest of the full product in the shards."""
    return sampled([*all_pairs(factors, valid), *extra], full_product(factors, valid))
