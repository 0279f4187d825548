# ruff: noqa: E501 (HLO text: one instruction a line)
"""seqpipe.tools.step_cost: kernels, bytes and matmul FLOPs of a step, read from its HLO."""

import json

import jax
import numpy as np
import pytest
from oracle import SEQ_LEN, make_config

from seqpipe.models import model, reference
from seqpipe.parallel import sharding
from seqpipe.pipeline import executor
from seqpipe.tools import step_cost

BATCH, LAYERS = 8, 2


def compiled_text(
    schedule: str, segments: int, microbatches: int, context: int = 1
) -> tuple[str, object]:
    """Optimized CPU HLO of a tiny step (no recompute, `xla` attention) and its model."""
    config = make_config("1f1b" if schedule == "none" else schedule, (1, 1), segments,
                         "uniform", "equal", 1, attention="xla")  # fmt: skip
    config.pipeline.update(microbatches=microbatches, remat="none")
    config.model.num_layers = LAYERS
    config.mesh.context = context
    config.train.global_batch_size = BATCH
    spec = executor.make_spec(config)
    mesh = sharding.make_mesh(1, 1, context=context)
    params = jax.eval_shape(lambda: model.init_params(spec.cfg, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ_LEN + 1), np.int32)
    if schedule == "none":
        fn = lambda p, t: reference.loss_and_grads(p, t, spec.cfg)  # noqa: E731
    else:
        fn = lambda p, t: executor.loss_and_grads(p, t, spec, mesh)  # noqa: E731
    return jax.jit(fn).lower(params, tokens).compile().as_text(), spec.cfg


def matmul_flops(cfg, segments: int) -> float:
    """Forward, input-gradient and weight-gradient matmuls of the step: the dense ones per
    token, and attention's six per layer (scores, values; four in the backward) over the
    keys each segment sees: its prefix and itself, the whole square under `xla`."""
    d, f, v, e = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.head_dim
    dense = 3 * 2 * (LAYERS * (d * 3 * d + d * d + 2 * d * f) + d * v) * BATCH * SEQ_LEN
    q = SEQ_LEN // segments
    pairs = sum(q * (k * q + q) for k in range(segments))  # query-key pairs computed
    return dense + 6 * 2 * LAYERS * BATCH * cfg.num_heads * e * pairs


@pytest.mark.parametrize(
    "schedule,segments,microbatches",
    [
        ("none", 1, 1),
        pytest.param("1f1b", 1, 2, marks=pytest.mark.slow),
        ("1f1b", 1, 4),
        ("seq1f1b", 2, 2),
        pytest.param("seq1f1b", 4, 2, marks=pytest.mark.slow),
    ],
)
def test_a_steps_matmul_flops_are_the_models(schedule, segments, microbatches):
    """Loops count their trips and the tick loop's unit loops their units: the reference
    and every pipelined step, whatever its micro-batches and segments, run the model's
    matmuls once each (no recompute), segments skipping the keys after them."""
    text, cfg = compiled_text(schedule, segments, microbatches)
    cost = step_cost.step_cost(text, microbatches, segments)
    # Unit loops' weights are fractions of the tick count: exact up to float rounding.
    assert cost.total("flops") == pytest.approx(matmul_flops(cfg, segments), rel=1e-12)


def test_the_unit_rule_is_what_makes_the_count_right():
    """Without naming its units (every conditional at the mean of its branches), the same
    pipelined step counts other FLOPs: the rule is not idle."""
    text, cfg = compiled_text("seq1f1b", 2, 4)
    assert step_cost.step_cost(text).total("flops") != pytest.approx(matmul_flops(cfg, 2))


def test_a_context_devices_module_counts_its_share_and_its_gathers():
    """mesh.context=2: the module is one context device's. Its matmuls are half the dense
    ones and its two pieces' attention a segment: each piece of h queries on the keys
    before it and its own h, scores and values 6 times (as above) and the scores once more
    in the backward (`context.attend` is checkpointed: it gathers the K/V again rather
    than keep them). The gathers are kernels of their own kind."""
    context, segments, microbatches = 2, 2, 2
    text, cfg = compiled_text("seq1f1b", segments, microbatches, context)
    cost = step_cost.step_cost(text, microbatches, segments)
    d, f, v, e = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.head_dim
    dense = 3 * 2 * (LAYERS * (d * 3 * d + d * d + 2 * d * f) + d * v) * BATCH * SEQ_LEN
    length = SEQ_LEN // segments
    h = length // (2 * context)
    pairs = sum(2 * h * k * length + (2 * context + 1) * h * h for k in range(segments))
    attention = 7 * 2 * LAYERS * BATCH * cfg.num_heads * e * pairs
    assert cost.total("flops") == pytest.approx(dense / context + attention, rel=1e-12)
    assert cost.total("kernels", "collective") > 0


MODULE = """HloModule m

%fused_slice (param_0: f32[24,1024], param_1: s32[]) -> f32[1,1024] {
  %param_0 = f32[24,1024]{1,0} parameter(0)
  %bitcast.1 = f32[24,1024]{1,0} bitcast(%param_0)
  %param_1 = s32[] parameter(1)
  %constant.0 = s32[] constant(0)
  ROOT %dynamic-slice.0 = f32[1,1024]{1,0} dynamic-slice(%bitcast.1, %param_1, %constant.0), dynamic_slice_sizes={1,1024}
}

%fused_update (param_0.1: f32[24,1024], param_1.1: f32[1,1024], param_2: s32[]) -> f32[24,1024] {
  %param_0.1 = f32[24,1024]{1,0} parameter(0)
  %param_1.1 = f32[1,1024]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %constant.1 = s32[] constant(0)
  ROOT %dynamic-update-slice.0 = f32[24,1024]{1,0} dynamic-update-slice(%param_0.1, %param_1.1, %param_2, %constant.1)
}

%fused_matmul (param_0.2: bf16[64,32], param_1.2: bf16[32,16]) -> f32[64,16] {
  %param_0.2 = bf16[64,32]{1,0} parameter(0)
  %param_1.2 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.0 = f32[64,16]{1,0} dot(%param_0.2, %param_1.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (arg: (s32[], f32[24,1024])) -> (s32[], f32[24,1024]) {
  %arg = (s32[], f32[24,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %buffer = f32[24,1024]{1,0} get-tuple-element(%arg), index=1
  %loop_dynamic_slice_fusion = f32[1,1024]{1,0} fusion(%buffer, %i), kind=kLoop, calls=%fused_slice
  %loop_dynamic_update_slice_fusion = f32[24,1024]{1,0} fusion(%buffer, %loop_dynamic_slice_fusion, %i), kind=kLoop, calls=%fused_update
  ROOT %out = (s32[], f32[24,1024]{1,0}) tuple(%i, %loop_dynamic_update_slice_fusion)
}

%cond (arg.1: (s32[], f32[24,1024])) -> pred[] {
  %arg.1 = (s32[], f32[24,1024]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (a: f32[24,1024], x: bf16[64,32], w: bf16[32,16]) -> (f32[64,16], f32[24,1024]) {
  %a = f32[24,1024]{1,0} parameter(0)
  %x = bf16[64,32]{1,0} parameter(1)
  %w = bf16[32,16]{1,0} parameter(2)
  %gemm_fusion = f32[64,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_matmul
  %zero = s32[] constant(0)
  %init = (s32[], f32[24,1024]{1,0}) tuple(%zero, %a)
  %loop = (s32[], f32[24,1024]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"24"}}
  %copy.0 = f32[64,16]{1,0} copy(%gemm_fusion)
  %rows = f32[24,1024]{1,0} get-tuple-element(%loop), index=1
  ROOT %result = (f32[64,16]{1,0}, f32[24,1024]{1,0}) tuple(%copy.0, %rows)
}
"""


def test_bytes_count_slices_in_place_updates_and_loop_trips():
    """A row sliced from a buffer reads the row; updating it in place reads and writes the
    row, not the buffer; the loop runs 24 times; a matmul moves its operands and result."""
    cost = step_cost.step_cost(MODULE)
    row = 1024 * 4
    assert cost.total("bytes", "slice") == 24 * (row + 4 + row)  # row and index in, row out
    assert cost.total("bytes", "update") == 24 * (row + 4 + 2 * row)
    assert cost.total("bytes", "gemm") == 64 * 32 * 2 + 32 * 16 * 2 + 64 * 16 * 4
    assert cost.total("flops") == 2 * 64 * 16 * 32
    assert cost.total("kernels") == 24 * 2 + 2  # the loop's two, the matmul, the copy
    assert cost.total("bytes", "copy") == 2 * 64 * 16 * 4


ACCUMULATE = """HloModule m

%fused_add (param_0: f32[24,1024], param_1: bf16[1,1024], param_2: s32[]) -> f32[24,1024] {
  %param_0 = f32[24,1024]{1,0} parameter(0)
  %param_1 = bf16[1,1024]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %constant.0 = s32[] constant(0)
  %dynamic-slice.0 = f32[1,1024]{1,0} dynamic-slice(%param_0, %param_2, %constant.0), dynamic_slice_sizes={1,1024}
  %convert.0 = f32[1,1024]{1,0} convert(%param_1)
  %add.0 = f32[1,1024]{1,0} add(%dynamic-slice.0, %convert.0)
  ROOT %dynamic-update-slice.0 = f32[24,1024]{1,0} dynamic-update-slice(%param_0, %add.0, %param_2, %constant.0)
}

ENTRY %main (acc: f32[24,1024], g: bf16[1,1024], i: s32[], q: bf16[4,64,2,16], cache: u16[3,24,4,512,2,16]) -> (f32[24,1024], bf16[4,64,2,16]) {
  %acc = f32[24,1024]{1,0} parameter(0)
  %g = bf16[1,1024]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %q = bf16[4,64,2,16]{3,2,1,0} parameter(3)
  %cache = u16[3,24,4,512,2,16]{5,4,3,2,1,0} parameter(4)
  %loop_dynamic_update_slice_fusion = f32[24,1024]{1,0} fusion(%acc, %g, %i), kind=kLoop, calls=%fused_add
  %pallas_call = bf16[4,64,2,16]{3,2,1,0} custom-call(%q, %cache), custom_call_target="__gpu$xla.gpu.triton"
  ROOT %result = (f32[24,1024]{1,0}, bf16[4,64,2,16]{3,2,1,0}) tuple(%loop_dynamic_update_slice_fusion, %pallas_call)
}
"""


def test_an_add_in_place_counts_its_window_and_a_kernel_one_layer_of_the_cache():
    """A window of an accumulator read, added to and written in place moves the window
    (read, written) and the addend, not the accumulator; a Triton kernel handed the
    K/V cache whole ([slots, n, b, Lkv, H, E]) counts one slot's one layer of it."""
    cost = step_cost.step_cost(ACCUMULATE)
    row = 1024 * 4
    assert cost.total("bytes", "update") == row + 1024 * 2 + 4 + 2 * row
    q = 4 * 64 * 2 * 16 * 2
    assert cost.total("bytes", "custom") == q + 4 * 512 * 2 * 16 * 2 + q


def test_the_roofline_takes_the_longer_of_compute_and_memory_per_kernel():
    cost = step_cost.Cost()
    cost.kernel("gemm", nbytes=1e9, flops=1e15)  # compute-bound: 2 s at 5e14
    cost.kernel("elementwise", nbytes=4e9, flops=0.0)  # memory-bound: 2 s at 2e9
    cost.kernel("elementwise", nbytes=4e9, flops=0.0)
    assert cost.seconds(5e14, 2e9, 0.0) == pytest.approx(2.0 + 2 * 2.0)
    assert cost.seconds(5e14, 2e9, 1e-3) == pytest.approx(6.0 + 3e-3)
    assert step_cost.summary(cost)["by_kind"]["elementwise"] == {
        "kernels": 2,
        "gbytes": 8.0,
        "tflops": 0.0,
    }


def test_the_command_prints_the_summary_as_json(tmp_path, capsys):
    path = tmp_path / "module.txt"
    path.write_text(MODULE)
    step_cost.main([str(path)])
    summary = json.loads(capsys.readouterr().out)
    assert summary["kernels"] == 50 and summary["round_trips"] == 0
    assert summary["h200_estimate_s"] >= 0 and set(summary["by_kind"]) == {
        "slice",
        "update",
        "gemm",
        "copy",
    }


def test_a_file_that_is_not_hlo_is_one_line(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("not HLO\n")
    for arg in (str(path), str(tmp_path / "missing.txt")):
        with pytest.raises(SystemExit) as e:
            step_cost.main([arg])
        assert str(e.value).startswith(f"step_cost: cannot read {arg} as optimized HLO")
        assert "\n" not in str(e.value)
