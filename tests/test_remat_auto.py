"""pipeline.remat=auto: the least recompute whose compiled step fits the device."""

import jax
import pytest
from helpers import PIPELINED, tiny_config

from seqpipe.pipeline import spec
from seqpipe.run import config as config_lib
from seqpipe.run import remat_auto
from seqpipe.targets import gpu_topology
from seqpipe.train import aot, trainer

GiB = 2**30


def test_choose_takes_the_first_policy_that_fits_in_order_of_recompute():
    peaks = {"none": 120 * GiB, "dots": 80 * GiB, "layer": 30 * GiB, "full": 30 * GiB}
    asked = []

    def peak_of(policy):
        asked.append(policy)
        return peaks.get(policy, 25 * GiB)

    choice = remat_auto.choose(peak_of, budget=100 * GiB)  # 90 GiB with the headroom
    assert choice.policy == "dots" and asked == ["none", "dots"]
    assert choice.peaks == {"none": 120 * GiB, "dots": 80 * GiB}
    assert "auto -> dots (fits; peak GiB: none 120.0, dots 80.0; limit 90.0 GiB" in choice.line()
    # 85 GiB is within 90% of 100 GiB, 95 GiB is not.
    assert remat_auto.choose(lambda p: 85 * GiB, 100 * GiB).policy == "none"
    # None fits and all need the same: the least recompute of the least memory.
    assert remat_auto.choose(lambda p: 95 * GiB, 100 * GiB).policy == "none"


def test_nothing_fits_picks_the_policy_that_needs_least_and_no_budget_compiles_nothing():
    peaks = dict(zip(remat_auto.ORDER, (200, 180, 150, 140, 120), strict=True))
    choice = remat_auto.choose(lambda p: peaks[p] * GiB, budget=100 * GiB)
    assert choice.policy == "full_layer" and list(choice.peaks) == list(remat_auto.ORDER)
    assert choice.line().startswith("auto -> full_layer (least;")

    def never(policy):
        raise AssertionError("compiled without a budget")

    choice = remat_auto.choose(never, None)
    assert choice.policy == "full" and choice.line() == (
        "auto -> full (no device memory to fit: the default)"
    )


def test_the_gpu_budget_is_what_jax_allocates_of_it(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert gpu_topology.gpu_budget(100 * GiB) == 75 * GiB
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    assert gpu_topology.gpu_budget(100 * GiB) == 95 * GiB
    assert remat_auto.device_budget(jax.devices()) is None  # the CPU: its host's memory


def test_compile_only_fits_a_budget_with_the_compiler_s_own_figures():
    """The tiny pipelined model on 8 CPU devices: each policy's real peak, then a budget
    between `none`'s and a policy that needs less, which auto must pick and report."""
    config = tiny_config(**PIPELINED)
    peaks = {}
    for policy in ("none", "dots", "layer"):
        result = aot.compile_only(aot.resolve(remat_auto.with_policy(config, policy)))
        peaks[policy] = result["peak_memory_per_device_bytes"]
    assert peaks["layer"] < peaks["none"]  # else the budget below could not split them
    fits = "dots" if peaks["dots"] < peaks["none"] else "layer"
    budget = int((peaks[fits] + peaks["none"]) / 2 / remat_auto.HEADROOM)
    auto = tiny_config(**PIPELINED, **{"pipeline.remat": "auto"})
    result = aot.compile_only(aot.resolve(auto, budget=budget))
    assert result["remat"] == fits
    assert result["remat_auto"]["policy"] == fits and result["remat_auto"]["budget"] == budget
    assert result["remat_auto"]["peaks"]["none"] == peaks["none"]
    assert result["peak_memory_per_device_bytes"] == peaks[fits]
    assert f"pipeline.remat: auto -> {fits} (fits; peak GiB: none " in result["run"]


def test_a_run_with_auto_on_the_cpu_trains_with_the_default_and_says_so(tmp_path, capsys):
    config = tiny_config(**{"train.steps": "2", "pipeline.remat": "auto"})
    records = trainer.run(config, str(tmp_path))
    assert [r["step"] for r in records] == [1, 2]
    out = capsys.readouterr().out
    assert "pipeline.remat: auto -> full (no device memory to fit: the default)" in out


def test_auto_outside_train_py_is_a_config_error_that_says_what_to_do():
    config = tiny_config(**PIPELINED, **{"pipeline.remat": "auto"})
    with pytest.raises(config_lib.ConfigError, match="pipeline.remat=auto is chosen by train.py"):
        _ = spec.make_spec(config).policy


def test_a_tool_given_auto_refuses_it_in_one_line(capsys):
    from seqpipe.tools import verify

    with pytest.raises(SystemExit) as e:
        verify.main(["--config", "tiny", "--config.pipeline.remat=auto"])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: pipeline.remat=auto is chosen by train.py")


def test_auto_tries_every_policy_from_least_recompute_to_most():
    from seqpipe.pipeline import remat

    assert sorted(remat_auto.ORDER) == sorted(remat.POLICIES)
    passes = [remat.POLICIES[p].matmul_passes for p in remat_auto.ORDER]
    assert passes == sorted(passes)
