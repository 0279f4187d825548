"""`model.attention=auto` on a TPU: splash where its step fits the device, else blockwise,
saying which and why (`seqpipe.attention_auto`)."""

import pytest

from seqpipe import attention_auto
from seqpipe.remat_auto import HEADROOM

GiB = 2**30


def compiles(peaks: dict[str, float]):
    """A `peak_of` over `peaks` (GiB) that records what it was asked to compile."""
    asked = []

    def peak_of(name):
        asked.append(name)
        return int(peaks[name] * GiB)

    return peak_of, asked


def test_on_a_tpu_auto_prefers_splash_and_falls_back_to_blockwise():
    assert attention_auto.candidates("tpu") == ("splash", "blockwise")
    assert attention_auto.candidates("cpu") == ("blockwise",)
    assert attention_auto.candidates("cuda") == ("blockwise",)


def test_splash_that_fits_is_kept_without_compiling_blockwise():
    peak_of, asked = compiles({"splash": 50.0, "blockwise": 53.8})
    choice = attention_auto.choose(peak_of, ("splash", "blockwise"), 95 * GiB)
    assert (choice.name, asked) == ("splash", ["splash"])
    assert choice.line() == "auto -> splash (fits; peak GiB: splash 50.0; limit 85.5 GiB (90% of 95.0))"


def test_splash_that_does_not_fit_gives_way_to_blockwise_and_says_why():
    """The 30B at 64k on v5p-128 (README): splash 109.8 GiB a chip, blockwise 53.8."""
    peak_of, asked = compiles({"splash": 109.8, "blockwise": 53.8})
    choice = attention_auto.choose(peak_of, ("splash", "blockwise"), 95 * GiB)
    assert (choice.name, asked) == ("blockwise", ["splash", "blockwise"])
    assert choice.line() == (
        "auto -> blockwise (fits; peak GiB: splash 109.8, blockwise 53.8; "
        "limit 85.5 GiB (90% of 95.0))"
    )


def test_when_neither_fits_the_smaller_is_taken():
    peak_of, _ = compiles({"splash": 120.0, "blockwise": 90.0})
    choice = attention_auto.choose(peak_of, ("splash", "blockwise"), 95 * GiB)
    assert choice.name == "blockwise" and choice.line().startswith("auto -> blockwise (least;")
    assert 90 * GiB > HEADROOM * 95 * GiB
