"""FLOP accounting: the analytic count by hand, and XLA's executed count against it."""

import dataclasses

import numpy as np
import pytest

from seqpipe.kernels import blockwise, pallas_gpu, splash
from seqpipe.models import model
from seqpipe.models.model import GPTConfig
from seqpipe.pipeline import executor
from seqpipe.run import config as config_lib
from seqpipe.schedule import partition
from seqpipe.tools import flops

# Full rematerialisation runs every layer's forward twice: executed / analytic a little
# under 4/3 for the matmuls (the head is not recomputed), plus what XLA counts for
# element-wise work (a few per cent in this model).
BAND = (1.30, 1.42)


def test_analytic_by_hand():
    cfg = GPTConfig(vocab_size=16, num_layers=1, d_model=4, num_heads=2, d_ff=8)
    got = flops.analytic_forward(cfg, (2, 3), rows=1)
    # dense: 2*s*(4*D*D + 2*D*F) = 2*s*128 for s = 2 and 3
    assert got["dense"] == 2 * 2 * 128 + 2 * 3 * 128
    # QK and PV each 2*s*(o+s)*D: (0+2)*2 queries for segment 0, (2+3)*3 for segment 1
    assert got["attention"] == 2 * (2 * 2 * 2 * 4) + 2 * (2 * 3 * 5 * 4)
    assert got["head"] == 2 * 5 * 4 * 16
    assert got["forward"] == 1280 + 304 + 640
    # Padded keys: segment 0 would also see the 3 keys of segment 1.
    assert flops.padded_attention_excess(cfg, (2, 3), rows=1) == 2 * (2 * 2 * 3 * 4)


def test_analytic_by_hand_grouped_and_swiglu():
    """One K/V head of width 2 for two query heads, three MLP matrices: per token
    2*(Q, O: 2*D*D = 32; K, V: 2*D*2 = 16; gate, up, down: 3*D*F = 96) = 2*144."""
    cfg = GPTConfig(
        vocab_size=16, num_layers=1, d_model=4, num_heads=2, d_ff=8, num_kv_heads=1, mlp="swiglu"
    )
    got = flops.analytic_forward(cfg, (2, 3), rows=1)
    assert got["dense"] == 2 * 5 * 144
    assert got["attention"] == 2 * (2 * 2 * 2 * 4) + 2 * (2 * 3 * 5 * 4)  # query heads' work
    assert model.flops_per_token(cfg, 5) == 6 * (144 + 4 * 16) + 12 * 4 * 5
    assert model.flops_per_token(cfg, 5, causal=True) == 6 * (144 + 4 * 16) + 6 * 4 * 5


def _spec(
    stage=2,
    segments=2,
    seq=256,
    microbatches=1,
    remat="full",
    layers=2,
    split="even",
    schedule="seq1f1b",
    arch=None,
    context=1,
    tensor=1,
):
    c = config_lib.base_config()
    # XLA counts a while loop's body once: blockwise's loops are counted by
    # `blockwise.executed_flops` (below), not here.
    c.model.update(
        vocab_size=128, num_layers=layers, d_model=64, num_heads=2, d_ff=128, attention="xla"
    )
    c.model.update(arch or {})
    c.mesh.update(stage=stage, context=context, tensor=tensor)
    c.pipeline.update(
        schedule=schedule,
        microbatches=microbatches,
        segments=segments,
        remat=remat,
        layers_per_stage=split,
    )
    c.train.update(seq_len=seq, global_batch_size=microbatches)
    config_lib.validate(c)
    return executor.make_spec(c)


def test_unit_counts_cover_every_unit_once():
    spec = _spec(stage=2, segments=4, microbatches=3)
    counts = flops.unit_counts(spec.schedule)
    for backward in (False, True):
        total = sum(n for (_, _, _, b, _), n in counts.items() if b == backward)
        assert total == 3 * 4 * 2  # M * K * stages
        assert sum(n for (_, f, _, b, _), n in counts.items() if f and b == backward) == 3 * 4


@pytest.mark.parametrize("stage", [1, 2])  # two layers per chunk, and one
def test_full_remat_ratio_in_band_and_padding_would_fail(stage):
    spec = _spec(stage=stage)
    got = flops.step_ratio(spec, rows=1)
    assert BAND[0] <= got["ratio"] <= BAND[1], got["ratio"]
    # Attention over the whole padded key range would add >= 5% of the analytic count.
    assert got["padded_ratio"] > BAND[1], got["padded_ratio"]
    # The matmuls alone, read from the jaxpr (scans times their length): the layers' run
    # four times (forward, recomputed, backward 2x), the head's three (its backward runs in
    # the forward; nothing recomputes it).
    parts = flops.breakdown(spec, rows=1)
    cfg, fwd = spec.cfg, flops.analytic_forward(spec.cfg, spec.lengths, rows=1)
    layers = fwd["dense"] + fwd["attention"]
    assert parts["matmul"] == pytest.approx(
        (4 * layers + 3 * fwd["head"]) / (3 * fwd["forward"]), rel=1e-9
    )
    # A one-layer chunk's recompute is no loop: XLA drops its last matmul (the MLP's down
    # projection, whose output only the discarded primal result reads), once per chunk
    # per micro-batch; in a layer scan it runs.
    n = cfg.num_layers // spec.stages
    down = 2 * sum(spec.lengths) * cfg.d_model * cfg.d_ff if n == 1 else 0
    dropped = down * spec.stages * spec.schedule.microbatches / got["analytic"]
    assert got["ratio"] == pytest.approx(sum(parts.values()) - dropped, abs=0.03)


def test_layer_scan_counted_once_and_corrected():
    got = flops.check_layer_scan(_spec(), rows=1)
    assert got["layers"] == 2
    # XLA counts the scan's body once; the correction matches a Python-unrolled chunk.
    assert got["scanned"] < 0.6 * got["unrolled"]
    assert got["corrected"] == pytest.approx(got["unrolled"], rel=0.01)


@pytest.mark.parametrize("stage", [1, 2])  # two layers per chunk, and one
def test_no_recompute_ratio_at_most_1_05(stage):
    """remat=none: the backward does no forward work again, every matmul runs once. `dots`
    keeps the projections' and MLP's matmul outputs and recomputes element-wise work and,
    under `xla` attention, attention's two matmuls (their outputs grow with the segment
    times the K/V length): once more each, the analytic attention forward's share."""
    none, dots = (_spec(stage=stage, segments=4, remat=r) for r in ("none", "dots"))
    got = flops.step_ratio(none, rows=1)
    assert 1.0 <= got["ratio"] <= 1.05, got["ratio"]
    assert got["padded_ratio"] > 1.05, got["padded_ratio"]
    assert got["ratio"] < flops.step_ratio(dots, rows=1)["ratio"]
    attention = flops.analytic_forward(dots.cfg, dots.lengths, rows=1)["attention"]
    recomputed = attention / flops.analytic_step(dots, rows=1)
    for spec, again in ((none, 0.0), (dots, recomputed)):
        parts = flops.breakdown(spec, rows=1)
        assert parts["matmul"] == pytest.approx(1.0 + again, rel=1e-9)
        assert flops.step_ratio(spec, rows=1)["ratio"] == pytest.approx(
            sum(parts.values()), abs=0.03
        )


def test_context_and_tensor_devices_each_execute_their_share():
    """mesh.context=2: a unit is compiled on the two context devices (its K/V gathers
    bound) and counted for both; the analytic count is the sequence's, as on one device.
    XLA's count agrees with the jaxpr's, and each device's two pieces compute their own
    square of scores, not the segment's: fewer matmuls than without context, though the
    checkpointed attention (`context.attend`) computes `xla`'s scores again in the
    backward (the K/V are gathered again rather than kept)."""
    one, two = (_spec(1, seq=128, remat="none", layers=1, context=c) for c in (1, 2))
    got = flops.step_ratio(two, rows=1)
    assert got["analytic"] == flops.analytic_step(one, rows=1)
    parts = flops.breakdown(two, rows=1)
    assert got["ratio"] == pytest.approx(sum(parts.values()), abs=0.03)
    assert 0.9 < parts["matmul"] < flops.breakdown(one, rows=1)["matmul"] == pytest.approx(1.0)
    # Two tensor devices each run half of every matmul: counted for both, all of them.
    tensor = _spec(1, seq=128, remat="none", layers=1, tensor=2)
    assert flops.breakdown(tensor, rows=1)["matmul"] == pytest.approx(1.0)
    assert 1.0 <= flops.step_ratio(tensor, rows=1)["ratio"] <= 1.05


# Multi-query attention, SwiGLU, Q/K/V biases and a tied head: K/V projections of one
# head's width, a third MLP matrix, the head's matmul on the embedding's transpose.
LLAMA = dict(num_kv_heads=1, mlp="swiglu", qkv_bias=True, tie_embeddings=True)


@pytest.mark.parametrize("schedule", ["seq1f1b", "seq_zb_h1"])
def test_grouped_swiglu_model_counts_match_xla(schedule):
    """XLA's executed matmuls of the whole step (remat none: each once) equal the analytic
    count exactly (GPT's layer formula counts 11% fewer layer matmuls for this model)."""
    spec = _spec(segments=4, remat="none", schedule=schedule, arch=LLAMA)
    got = flops.step_ratio(spec, rows=1)
    assert 1.0 <= got["ratio"] <= 1.05, got["ratio"]
    assert flops.breakdown(spec, rows=1)["matmul"] == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize(
    "unsplit,split,segments", [("1f1b", "zb_h1", 1), ("seq1f1b", "seq_zb_h1", 4)]
)
def test_the_weight_split_adds_no_flops(unsplit, split, segments):
    """remat=none: a split table's B and W together execute what the unsplit backward does
    (W's six einsums are the weight matmuls' gradients B left out), so executed / analytic
    stays at most 1.05 and equal to the unsplit table's; W units really are counted."""
    a, b = (_spec(segments=segments, remat="none", schedule=n) for n in (unsplit, split))
    got, want = flops.step_ratio(b, rows=1), flops.step_ratio(a, rows=1)
    assert 1.0 <= got["ratio"] <= 1.05, got["ratio"]
    assert got["ratio"] == pytest.approx(want["ratio"], rel=1e-3)
    weight = [u for name, u in got["units"].items() if name.startswith("wgt")]
    assert weight and all(u["flops"] > 0 for u in weight)


def test_layer_remat_recomputes_the_layers_not_the_head():
    full, layer = (flops.step_ratio(_spec(stage=1, remat=r), rows=1) for r in ("full", "layer"))
    none = flops.step_ratio(_spec(stage=1, remat="none"), rows=1)
    assert none["ratio"] < layer["ratio"] < full["ratio"]


def test_full_layer_remat_runs_the_layers_forward_once_more():
    """remat=full_layer trades a third forward of every layer (5 passes, not 4) for
    keeping one layer's residuals in the backward: XLA must count that forward."""
    full, full_layer = (
        flops.step_ratio(_spec(stage=1, remat=r), rows=1)["ratio"] for r in ("full", "full_layer")
    )
    assert full_layer > full + 0.2, (full, full_layer)


def test_an_uneven_split_counts_only_the_layers_it_runs():
    """Layers 2 + 1 on two stages: the second stage's padding layer is skipped, so the step
    executes the analytic count of three layers, as an even split of the same model would
    (remat none: every matmul once)."""
    uneven = _spec(layers=3, split="2,1", remat="none", segments=4)
    got = flops.step_ratio(uneven, rows=1)
    assert 1.0 <= got["ratio"] <= 1.05, got["ratio"]
    assert flops.breakdown(uneven, rows=1)["matmul"] == pytest.approx(1.0, rel=1e-9)
    names = " ".join(got["units"])
    assert "2 layers" in names and "1 layers" in names


def _keys_visited_by_brute_force(q_len, prefix_len, bq, bk):
    """Keys blockwise's query blocks compute against: every prefix block, and each own key
    block (of min(bk, Q)) that holds a key at or below one of the block's rows."""
    size_q, size_p, size_k = min(bq, q_len), min(bk, prefix_len), min(bk, q_len)
    keys = 0
    for lo in range(0, q_len, size_q):
        last = min(lo + size_q, q_len) - 1
        keys += -(-prefix_len // size_p) * size_p if prefix_len else 0
        keys += sum(size_k for kl in range(0, q_len, size_k) if kl <= last)
    return size_q, keys


@pytest.mark.parametrize("q_len, prefix_len", [(7, 0), (9, 13), (12, 12), (1, 5)])
def test_blockwise_flops_count_the_blocks_it_visits(q_len, prefix_len):
    size_q, keys = _keys_visited_by_brute_force(q_len, prefix_len, 4, 3)
    assert blockwise.executed_flops(q_len, prefix_len, 6, 4, 3) == 4 * size_q * keys * 6


def test_splash_flops_count_the_blocks_its_mask_keeps():
    """splash.executed_flops against the blocks the kernel's own mask info marks non-empty."""
    for q_len, prefix_len in [(130, 0), (6, 130), (512, 1024), (700, 300)]:
        bq = min(splash.BLOCK, -(-q_len // 128) * 128)
        bkv = min(splash.BLOCK, -(-(prefix_len + q_len) // 128) * 128)
        q_pad, kv_pad = -(-q_len // bq) * bq, -(-(prefix_len + q_len) // bkv) * bkv
        kernel = splash._kernel(1, q_pad, kv_pad, prefix_len, bq, bkv, True)
        blocks = int((np.asarray(kernel.fwd_mask_info.block_mask) > 0).sum())
        assert splash.executed_flops(q_len, prefix_len, 1) == 4 * blocks * bq * bkv


@pytest.mark.parametrize("q_len, prefix_len", [(7, 0), (9, 13), (12, 12), (1, 5)])
def test_pallas_gpu_flops_count_the_blocks_it_visits(q_len, prefix_len):
    """pallas_gpu.executed_flops against the (query block, key block) pairs where some
    row, padding included (the kernel computes it), sees some key: every prefix block,
    own blocks up to the diagonal."""
    bq, bk = 4, 2
    q_blocks = -(-q_len // bq)
    rows, cols = np.arange(q_blocks * bq), np.arange(q_len)
    seen = np.nonzero(cols[None, :] <= rows[:, None])
    own = len({(r // bq, c // bk) for r, c in zip(*seen, strict=True)})
    pairs = own + q_blocks * -(-prefix_len // bk)
    blocks = pallas_gpu.Blocks(forward=(bq, bk))
    assert pallas_gpu.executed_flops(q_len, prefix_len, 6, blocks) == 4 * pairs * bq * bk * 6


# Forward attention FLOPs each implementation runs, against the analytic count (every
# query times its prefix plus its whole segment, as `xla` computes it), for gpt_1b's
# long-context settings. Both skip the own blocks above the diagonal (so with equal
# segments of whole blocks they run less than the analytic count), and both compute
# partly filled blocks whole: blockwise re-runs the rows its last, overlapping query block
# shares with the one before, splash pads to its blocks. With the `flops` partition's
# lengths (off the 512-block) that adds 3.7% at 131072: pipeline.partition_multiple=512
# removes it. pallas_gpu's tiles are smaller (128 x 64, padded at the end): it runs at most
# 0.98x the analytic count in all four.
GPT_1B = GPTConfig(vocab_size=50304, num_layers=24, d_model=2048, num_heads=16, d_ff=8192)
EXCESS = {  # (seq, K, partition): (blockwise, splash, pallas_gpu) / analytic, measured
    (32768, 8, "uniform"): (0.9028, 0.9028, 0.8924),
    (32768, 8, "flops"): (0.9781, 0.9764, 0.8953),
    (131072, 32, "uniform"): (0.9735, 0.9735, 0.9706),
    (131072, 32, "flops"): (1.0374, 1.0370, 0.9765),
}


@pytest.mark.parametrize("case", EXCESS, ids=str)
def test_attention_flops_of_each_implementation(case):
    seq, segments, part = case
    lengths = partition.segment_lengths(seq, segments, part, **partition.model_dims(GPT_1B))
    analytic = flops.analytic_forward(GPT_1B, lengths, rows=1)["attention"] / GPT_1B.num_layers
    got = []
    for count in (blockwise.executed_flops, splash.executed_flops, pallas_gpu.executed_flops):
        offsets = np.cumsum((0,) + tuple(lengths[:-1]))
        got.append(
            sum(count(s, int(o), GPT_1B.d_model) for s, o in zip(lengths, offsets, strict=True))
        )
    assert np.asarray(got) / analytic == pytest.approx(EXCESS[case], abs=1e-4)


def test_flops_count_the_active_experts():
    """remat none: the jaxpr's matmuls of the whole step equal the analytic count, which
    counts each token's chosen experts (and the router), not all of them."""
    arch = dict(mlp="swiglu", num_experts=4, experts_per_token=2, expert_d_ff=32)
    spec = _spec(segments=2, remat="none", arch=arch)
    assert flops.breakdown(spec, rows=1)["matmul"] == pytest.approx(1.0, rel=1e-9)
    dense = dataclasses.replace(spec.cfg, num_experts=0, d_ff=2 * 32)
    assert model.layer_matmul_params(spec.cfg) == model.layer_matmul_params(dense) + 64 * 4
    shared = _spec(segments=2, remat="none", arch={**arch, "shared_expert_d_ff": 16})
    assert flops.breakdown(shared, rows=1)["matmul"] == pytest.approx(1.0, rel=1e-9)
