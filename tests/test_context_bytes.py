"""scripts/context_bytes.py: the bytes a step moves over the context axis, counted in its
compiled program, equal the analytic count."""

import importlib.util

import jax
import numpy as np
import pytest
from helpers import PIPELINED, REPO, tiny_config

from seqpipe.models import model
from seqpipe.parallel import sharding
from seqpipe.pipeline import executor

_SPEC = importlib.util.spec_from_file_location("context_bytes", REPO / "scripts/context_bytes.py")
context_bytes = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(context_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["full_layer", "dots"])
def test_the_compiled_steps_context_collectives_are_the_analytic_count(remat):
    overrides = {"mesh.data": "1", "mesh.stage": "2", "mesh.context": "2"}
    config = tiny_config(**{**PIPELINED, **overrides, "pipeline.remat": remat})
    spec = executor.make_spec(config)
    mesh = sharding.mesh_of(config)
    params = jax.eval_shape(lambda: model.init_params(spec.cfg, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct(
        (config.train.global_batch_size, config.train.seq_len + 1), np.int32
    )
    fn = jax.jit(lambda p, t: executor.loss_and_grads(p, t, spec, mesh))
    text = fn.lower(params, tokens).compile().as_text()
    sizes = {"data": 1, "stage": 2, "context": 2, "tensor": 1}
    got = context_bytes.measured(text, sizes, microbatches=2, segments=2)
    rows = config.train.global_batch_size // config.pipeline.microbatches
    want = context_bytes.analytic(spec, rows, context_bytes.grad_bytes(spec))
    for op in ("all-gather", "reduce-scatter"):
        assert got[f"{op}@context"] == pytest.approx(want[op]) and want[op] > 0
    # The gradients: the layers' over context, the shared ones (summed over stage first)
    # over context too; the loss over stage and context.
    reduced = sum(b for k, b in got.items() if k.startswith("all-reduce") and "context" in k)
    assert reduced == pytest.approx(want["all-reduce"], rel=1e-3)


def test_groups_are_named_by_the_axes_they_span():
    sizes = {"data": 2, "stage": 1, "context": 4, "tensor": 1}
    groups = frozenset(frozenset(range(i * 4, i * 4 + 4)) for i in range(2))
    assert context_bytes.axes_of(groups, sizes) == (("context",), 4)
    assert context_bytes.axes_of(frozenset([frozenset(range(8))]), sizes) == (
        ("data", "context"),
        8,
    )
    assert context_bytes.received("all-gather", 10, 4) == 30
    assert context_bytes.received("reduce-scatter", 40, 4) == 30
    assert context_bytes.received("all-reduce", 40, 4) == 60
