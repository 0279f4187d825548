"""The accelerator's attention check off the GPU: its tile sweep in Pallas interpret mode,
on shapes small enough for the CPU."""

import dataclasses

import numpy as np
import pytest

from seqpipe.kernels.pallas_gpu import Blocks
from seqpipe.tools import attention_check

SMALL = {"forward": (16, 16), "dkv": (16, 16), "dq": (16, 16)}
TINY = {"exact": (1, 40, 24, 2, 16), "cases": ((16, 24),), "heads": 2, "interpret": True}


def test_a_sweep_checks_each_tiling_times_the_exact_ones_and_picks_the_fastest():
    candidates = (
        Blocks(**SMALL),
        Blocks(**{**SMALL, "forward": (8, 16), "dq": (8, 16)}),
        Blocks(**{**SMALL, "dkv": (12, 16)}),  # not a power of two: the kernels refuse it
    )
    # No time budget: on busy cores the first tiling alone can take past the default 100 s
    # (the budget's own test is the next one).
    out = attention_check.sweep(
        candidates, budget_s=float("inf"), reps=1, log=lambda _: None, **TINY
    )
    assert out["shape"] == "b1 P40 Q24 H2 E16 bf16"
    first, second, refused = out["rows"]
    for row, blocks in ((first, candidates[0]), (second, candidates[1])):
        assert row["blocks"] == dataclasses.asdict(blocks)
        assert row["ok"] and max(row["rel_err"].values()) <= attention_check.BOUND
        (case,) = row["timed"]
        assert (case["prefix"], case["q"]) == (16, 24) and row["ms"] == case["ms"] > 0
    assert "powers of two" in refused["error"] and "ms" not in refused
    assert out["fastest"] is min((first, second), key=lambda r: r["ms"])


def test_a_tiling_past_the_budget_is_skipped_and_none_is_fastest():
    out = attention_check.sweep((Blocks(**SMALL),), budget_s=-1, log=lambda _: None, **TINY)
    (row,) = out["rows"]
    assert row["skipped"] == "past -1 s" and out["fastest"] is None


def test_exactness_fails_an_array_off_by_more_than_bf16_rounding():
    rng = np.random.default_rng(0)
    want = [rng.standard_normal((3, 5)).astype(np.float32) for _ in attention_check.NAMES]
    close = [w * (1 + 1e-3) for w in want]
    assert attention_check.exactness(close, want)["ok"]
    off = list(close)
    off[3] = want[3] + 0.05 * np.abs(want[3]).max()  # the prefix's dV
    result = attention_check.exactness(off, want)
    assert not result["ok"]
    assert result["rel_err"]["dv_prefix"] == pytest.approx(0.05, rel=1e-4)
