"""The run configuration: a user's config resolved once, for its devices."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from helpers import PIPELINED, tiny_config

from seqpipe.kernels import attention
from seqpipe.pipeline import remat
from seqpipe.run import config as config_lib
from seqpipe.run import run_config


def test_auto_and_the_open_axis_are_resolved_for_the_devices_and_said_in_one_line():
    overrides = {"mesh.data": "-1", "pipeline.remat": "auto", "model.attention": "auto"}
    config = tiny_config(**{**PIPELINED, **overrides})
    run = run_config.resolve(config, jax.devices())  # the 8 CPU devices
    assert run.mesh == run_config.Mesh(data=2, stage=4, tensor=1)
    assert run.model.attention == run.spec.cfg.attention == "blockwise"  # auto on the CPU
    assert run.remat == run.spec.remat == "full" and run.spec.policy is remat.POLICIES["full"]
    assert run.remat_choice.budget is None  # the CPU's memory is the host's: no fit
    # What checkpoints record stays the user's: auto, with the mesh sized.
    assert run.config.model.attention == "auto" and run.config.mesh.data == 2
    assert run.line() == (
        "attention: blockwise (auto on cpu); pipeline.remat: auto -> full (no device memory "
        "to fit: the default); mesh: data 2, stage 4, tensor 1 (8 cpu); pipeline.schedule: "
        "seq1f1b"
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.remat = "none"


def test_the_context_axis_is_said_where_it_splits():
    import train

    config = tiny_config(**{**PIPELINED, "mesh.data": "-1", "mesh.stage": "2", "mesh.context": "2"})
    run = run_config.resolve(config, jax.devices())
    assert run.mesh.sizes() == {"data": 2, "stage": 2, "context": 2, "tensor": 1}
    assert "; mesh: data 2, stage 2, context 2, tensor 1 (8 cpu);" in run.line()
    assert train._mesh_text(run.mesh.sizes()) == "2x2, context 2"
    one = run_config.Mesh(data=2, stage=4, tensor=1)  # no context axis: as before it existed
    assert (
        one.sizes() == {"data": 2, "stage": 4, "tensor": 1}
        and train._mesh_text(one.sizes()) == "2x4"
    )


def test_what_is_named_is_kept_and_a_run_without_a_pipeline_has_no_spec():
    config = tiny_config(**{"model.attention": "xla", "pipeline.remat": "dots"})
    run = run_config.resolve(config, jax.devices())
    assert (run.model.attention, run.remat, run.spec) == ("xla", "dots", None)
    assert run.line().startswith("attention: xla; pipeline.remat: dots; mesh: data 8, stage 1")


def test_a_mesh_that_does_not_fit_the_devices_is_one_line_naming_the_keys():
    config = tiny_config(**{"mesh.data": "4"})
    with pytest.raises(config_lib.ConfigError, match=r"^mesh.data \* mesh.stage = 4 but 8"):
        run_config.resolve(config, jax.devices())


def test_remat_auto_with_a_budget_and_nothing_to_measure_it_is_refused():
    """A tool (no compiling function) may not guess the policy where memory is known."""
    config = tiny_config(**PIPELINED, **{"pipeline.remat": "auto"})
    with pytest.raises(config_lib.ConfigError, match="pipeline.remat=auto is chosen by train.py"):
        run_config.resolve(config, jax.devices(), budget=2**30)


def test_auto_never_reaches_the_trace():
    x = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="`auto` is resolved before tracing"):
        attention.attend("auto", x, x[:, :0], x[:, :0], x, x)
