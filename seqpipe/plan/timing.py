"""The time model: a candidate's step in seconds from FLOPs and bytes, without a device.

A unit (a segment through a chunk) costs FLOPs / F + bytes / B on one device, plus
its messages and tensor-parallel collectives at the link's bandwidth. With mesh.context =
C a device runs 1/C of every segment's positions: its matmuls' FLOPs and its bytes scale
by 1/C, its attention is 1/C of the segment's causal work (the zigzag split,
`seqpipe.parallel.context`), and every layer all-gathers the other devices' K/V of the
prefix and the segment over the same link (a backward gathers them again and
reduce-scatters their cotangents). A mixture's experts split over the data replicas add
their dispatch, an all-gather and a reduce-scatter per MoE layer over the data link. The
schedule's
tick model (`schedule.stats`: a tick lasts as long as its busiest stage, each segment
its FLOP share, the head on the last stage) turns the mean unit's forward and backward
into the pipeline's time; after the loop come the gradients' reduction over `data` and
the optimizer's update.

F and B (`Rates`) are what the estimate rests on:
- NVIDIA GPUs: the roofline `tools.step_cost.H200` fitted to the steps one H200 ran
  (475 TFLOP/s, 4.3 TB/s); an H100 takes the same FLOP rate and the bandwidth scaled
  by its memory's over the H200's (3.35 / 4.8 TB/s);
- TPUs: the chip's peak bf16 FLOP/s and HBM bandwidth, uncalibrated: no seqpipe step has
  run on a TPU yet.
Bytes per unit: each unit re-reads its layers' weights (copied out of the stack, their
gradients added into the float32 accumulator), its activations and, where attention is
not a fused kernel (`blockwise` on GPUs), its score blocks over the whole K/V buffer.
The three coefficients are a least-squares fit to `tools.step_cost`'s byte counts of
four gpt_1b steps compiled for H200s (1f1b, seq1f1b K=4 with `none` and `full`, one and
eight stages; within 17% of each): an account of traffic, not a timing.
"""

from __future__ import annotations

import dataclasses

from seqpipe import schedule
from seqpipe.models import model
from seqpipe.schedule import partition
from seqpipe.targets import gpu_topology
from seqpipe.tools import step_cost
from seqpipe.train.metrics import peak_flops

# Bytes a unit (forward and backward) moves per parameter of its layers, split 2:5.
WEIGHT_BYTES = {"F": 24.0, "B": 60.0}
# Per token, layer and pass (a forward is one, a backward two, a recompute one more):
# bytes per element of D + d_ff / 4 in the compute dtype.
ACT_BYTES = 0.23
# Unfused attention: bytes per (query, key) pair and head per pass.
SCORE_BYTES = 14.7
NVLINK, INFINIBAND = 450e9, 50e9  # bytes/s a GPU sends inside a host / between hosts


@dataclasses.dataclass(frozen=True)
class Rates:
    """What a device does per second, and what the estimate rests on (`basis`)."""

    flops: float
    bytes: float
    link: float  # collective bandwidth inside the tensor group and between stages
    data_link: float  # between data replicas
    fused_attention: bool  # attention's scores stay on chip (splash)
    peak_flops: float  # for MFU
    basis: str


# This machine's CPU, for ranking on fake devices (scripts/plan_rank_agreement.py):
# nominal rates, neither measured nor fitted; only their ratio shapes a ranking.
CPU = Rates(5e10, 1e10, 1e10, 1e10, False, None, "nominal CPU rates (50 GFLOP/s, 10 GB/s)")

TPU = {  # HBM bytes/s and ICI bytes/s a chip, from the Cloud TPU system architecture pages
    "v4": (1.228e12, 300e9),
    "v5p": (2.765e12, 600e9),
    "v5e": (0.819e12, 200e9),
    "v6e": (1.640e12, 400e9),
}


def rates_for(target) -> Rates:
    """The rates of a `topology.Slice` or `gpu_topology.System`."""
    if isinstance(target, gpu_topology.System):
        f, b, _ = step_cost.H200
        scale = target.spec.memory_bandwidth / gpu_topology.MODELS["h200"].memory_bandwidth
        data = INFINIBAND if target.hosts > 1 else NVLINK
        basis = (
            "the roofline fitted to one H200's measured steps (tools.step_cost.H200: "
            f"{f / 1e12:.0f} TFLOP/s, {b / 1e12:.1f} TB/s"
            + (f", bandwidth x{scale:.2f} for the H100)" if scale != 1 else ")")
        )
        peak = peak_flops(target.spec.device_kind)
        return Rates(f, b * scale, NVLINK, data, False, peak, basis)
    hbm, ici = TPU[target.generation]
    peak = peak_flops(target.spec.device_kind)
    basis = (
        f"{target.generation}'s peak ({peak / 1e12:.0f} TFLOP/s bf16, {hbm / 1e12:.2f} TB/s HBM,"
        f" {ici / 1e9:.0f} GB/s ICI), not calibrated: no measured TPU step yet"
    )
    return Rates(peak, hbm, ici, ici, True, peak, basis)


def unit_cost(spec, rows: int, rates: Rates) -> dict:
    """Seconds of the mean unit's forward (F) and backward (B, with its recompute) on one
    device, and their FLOPs and bytes."""
    cfg, t, c = spec.cfg, spec.cfg.tensor, spec.context
    dims = partition.model_dims(cfg)
    dense, attn = partition._dense_and_attn(**dims | {"num_layers": None})
    n, seq, k = spec.chunk_layers, sum(spec.lengths), spec.segments  # seq: this device's
    tokens = rows * seq / k  # the mean unit's
    whole = seq * c  # the sequence: a context device's queries see keys of all of it
    pairs = rows * whole * whole / 2 / k / c  # (query, key) pairs of the mean unit, causal
    fwd_flops = n * (dense * tokens + attn * pairs) / t
    passes = spec.policy.matmul_passes  # forwards' worth of matmuls a layer runs a step

    layer_params = model.layer_matmul_params(cfg) / t
    act = 2 if cfg.dtype == "bfloat16" else 4
    seg = seq / k
    # Blockwise attention runs a segment over the whole K/V buffer, masked; a context
    # device's piece over the gathered keys before it and its own (mean: half the segment
    # and half a piece, after the prefix).
    keys = spec.kv_len + seg if k > 1 else seq
    if c > 1:
        keys = whole * (k - 1) / (2 * k) + whole / k * (c + 1) / (2 * c)
    act_pass = n * tokens * (cfg.d_model + cfg.d_ff / 4) * act * ACT_BYTES / t
    score_pass = 0 if rates.fused_attention else n * rows * seg * keys * cfg.num_heads / t
    score_pass *= SCORE_BYTES
    recompute = passes - 3  # forwards a backward re-runs (full: 1, full_layer: 2)
    fwd_bytes = n * layer_params * WEIGHT_BYTES["F"] + act_pass + score_pass
    bwd_flops = (2 + recompute) * fwd_flops
    bwd_bytes = n * layer_params * WEIGHT_BYTES["B"] + (2 + recompute) * (act_pass + score_pass)
    message = tokens * cfg.d_model * act / t
    tp = 0.0 if t == 1 else 4 * n * tokens * cfg.d_model * act * (t - 1) / t
    # Each layer gathers the K/V (2 of kv heads x head dim) of the prefix and the segment,
    # (P + L_k)(C - 1)/C positions from the others (mean P + L_k: (K + 1) / 2K of the
    # sequence); the backward gathers again and reduce-scatters as much, a recompute again.
    kv = 2 * cfg.local_kv_heads * cfg.head_dim * act
    ctx = 0.0 if c == 1 else n * rows * whole * (k + 1) / (2 * k) * (c - 1) / c * kv
    ep = expert_dispatch_bytes(cfg, n, tokens, act, c)
    # In sequence, as the roofline per kernel adds up: the matmuls are compute-bound, the
    # rest (most of the bytes) memory-bound.
    f = fwd_flops / rates.flops + fwd_bytes / rates.bytes + (message + tp + ctx) / rates.link
    f += ep / rates.data_link
    b = bwd_flops / rates.flops + bwd_bytes / rates.bytes
    b += (message + 2 * tp + (2 + recompute) * ctx) / rates.link
    b += (1 + recompute) * ep / rates.data_link  # the transposes, and each recompute's
    return {"F": f, "B": b, "flops": fwd_flops + bwd_flops, "bytes": fwd_bytes + bwd_bytes}


def expert_dispatch_bytes(cfg, layers: int, tokens: float, act: int, context: int = 1) -> float:
    """Bytes one device receives in a forward of `layers` layers (the sparse share of
    them) over `tokens` (the segment's, gathered over tensor) with the experts split over
    d = `cfg.expert_parallel` data replicas (`seqpipe.models.moe.mlp`). All-gather: the
    others' tokens, routing weights and choices, (d - 1) T (act D + 8 k), and the
    reduce-scatter of their outputs, (d - 1) T act D. All-to-all: two exchanges of the
    buffers, each (d - 1) / d of X slots of act D, the slots bounding a row's segment's
    kept assignments (f k T in all, times the `context` devices that split the segment,
    at most X k T). A backward moves as much (the transposes), and again for each
    forward it re-runs."""
    d = cfg.expert_parallel
    if not cfg.num_experts or d == 1:
        return 0.0
    sparse = layers * len(cfg.sparse_layers) / cfg.num_layers
    if cfg.moe_dispatch == "all_to_all":
        slots = min(cfg.moe_capacity_factor * context, cfg.num_experts) * cfg.experts_per_token
        return sparse * 2 * (d - 1) / d * slots * tokens * act * cfg.d_model
    return sparse * (d - 1) * tokens * (2 * act * cfg.d_model + 8 * cfg.experts_per_token)


_STATS: dict = {}


def table_stats(spec) -> dict:
    """`schedule.stats` of the spec's table with each segment's FLOP share and the head's
    and embedding's work on their chunks; once a table (the remat policies share it)."""
    # The sequence's segments: a context device runs 1/C of each, the same shares.
    lengths = spec.sequence_lengths
    key = (id(spec.schedule), lengths, spec.layers_per_chunk, spec.cfg)
    if key not in _STATS:
        dims = partition.model_dims(spec.cfg)
        costs = partition.segment_flops(lengths, **dims)
        chunks = partition.chunk_costs(
            spec.stages * spec.virtual,
            sum(lengths),
            **dims,
            layers_per_chunk=spec.layers_per_chunk,
        )
        _STATS[key] = (spec.schedule, schedule.stats(spec.schedule, costs, lengths, chunks))
    return _STATS[key][1]


def pipeline_time(spec, rows: int, rates: Rates) -> dict:
    """Seconds of the tick loop and its bubble, under `schedule.stats`'s tick model with
    each segment's FLOP share and the head's and embedding's work on their chunks."""
    st = table_stats(spec)
    unit = unit_cost(spec, rows, rates)
    # stats counts a mean unit's forward as 1 and its backward as 2 (B + W when split).
    per = (unit["F"] + unit["B"]) / 3
    return {"loop_s": st["time"] * per, "bubble": st["bubble"], "unit": unit}


def after_loop(
    state: dict, data: int, shard_optimizer: bool, rates: Rates, context: int = 1
) -> float:
    """Seconds of the gradients' reduction over `data` (reduce-scatter and all-gather: twice
    the float32 gradients' bytes on the wire), and over `context` (each device's sum over
    its positions, inside a host), and the AdamW update (parameters, moments and
    gradients read and written, over the replicas when the optimizer is sharded)."""
    grads = state["count"] * 4
    wire = 0.0 if data == 1 else 2 * (data - 1) / data * grads / rates.data_link
    wire += 2 * (context - 1) / context * grads / rates.link
    update = 2 * (state["params"] + state["moments"] + grads)
    update /= data if shard_optimizer else 1
    return wire + update / rates.bytes


def step_time(spec, rows: int, data: int, shard_optimizer: bool, state: dict, rates) -> dict:
    """The step's seconds, bubble, tokens/s and MFU: PaLM's FLOPs with causal attention's
    half of the score matrix (what splash and the fused kernels compute; the full count
    would read above 100% at a TPU's peak) over every device's peak."""
    pipe = pipeline_time(spec, rows, rates)
    seconds = pipe["loop_s"] + after_loop(state, data, shard_optimizer, rates, spec.context)
    m, seq = spec.schedule.microbatches, sum(spec.sequence_lengths)
    tokens = rows * m * data * seq
    devices = data * spec.stages * spec.context * spec.cfg.tensor
    flops = model.flops_per_token(spec.cfg, seq, causal=True) * tokens
    return {
        "step_s": seconds,
        "bubble": pipe["bubble"],
        "tokens_per_s": tokens / seconds,
        "mfu": flops / (seconds * devices * rates.peak_flops) if rates.peak_flops else None,
    }
