"""How a step's work is cut: segments along the sequence, layers across stages.

A micro-batch of length L is cut into K contiguous segments. With causal attention a
later segment attends to a longer prefix, so equal lengths mean unequal work; the
`flops` partition shrinks segments along the sequence so each costs the same.

The model's layers are cut into one block per stage. The last stage also runs the head
(logits over the vocabulary, forward and backward), so with equal blocks every tick
waits for it; the `flops` split moves layers off it (`stage_layers`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

KINDS = ("uniform", "flops")
LAYER_SPLITS = ("even", "flops")  # or an explicit list of per-stage layer counts


class PartitionError(ValueError):
    """Raised, with a one-line message, when a partition is impossible."""


def _dense_and_attn(
    d_model: int,
    num_heads: int,
    d_ff: int,
    vocab_size: int,
    num_layers: int | None,
    num_kv_heads: int = 0,
    mlp: str = "gelu",
    head_dim: int = 0,
) -> tuple[float, int]:
    """Per-token and per-(query, key) coefficients of the per-layer cost model
    (docs/schedules.md, Partition).

    A segment of length s ending at position P costs a*s + c*(s*P - s*s/2) per layer, with
    a = 4*h*h + 4*h*k*d + 2*m*h*F (Q and O projections, K and V projections of the k
    K/V heads, the m MLP matrices: 2, 3 with swiglu; n*d = h; with k = n and m = 2 GPT's
    8*h*h + 4*h*F) and c = (4*d + 3)*n (scores, weighted sum, softmax). The head's 4*h*V
    per token runs once per model, so it is spread over `num_layers` when given and left
    out otherwise.
    """
    for name, value in (
        ("d_model", d_model),
        ("num_heads", num_heads),
        ("d_ff", d_ff),
        ("vocab_size", vocab_size),
    ):
        if value is None or value < 1:
            raise PartitionError(f"kind='flops' needs a positive {name}, got {value}")
    if not head_dim and d_model % num_heads:
        raise PartitionError(f"d_model {d_model} is not a multiple of num_heads {num_heads}")
    head_dim = head_dim or d_model // num_heads  # 0: d_model / num_heads
    q_width, kv_width = num_heads * head_dim, (num_kv_heads or num_heads) * head_dim
    matrices = 3 if mlp == "swiglu" else 2
    dense = 4 * d_model * q_width + 4 * d_model * kv_width + 2 * matrices * d_model * d_ff
    if num_layers is not None:
        if num_layers < 1:
            raise PartitionError(f"num_layers must be >= 1, got {num_layers}")
        dense += 4 * d_model * vocab_size / num_layers
    return dense, (4 * head_dim + 3) * num_heads


def _prefix_cost(pos: float, dense: int, attn: int) -> float:
    # The attention term telescopes: sum over segments of s*P - s*s/2 = P_end**2 / 2.
    return dense * pos + attn * pos * pos / 2


def model_dims(model, with_layers: bool = True) -> dict[str, int]:
    """The model shape the cost model reads, from `config.model` or a `GPTConfig`."""
    names = ("d_model", "num_heads", "d_ff", "vocab_size") + ("num_layers",) * with_layers
    dims = {name: getattr(model, name) for name in names}
    # The Llama family's (`model.num_kv_heads`, `model.mlp`); GPT's where a model has none.
    dims.update(num_kv_heads=getattr(model, "num_kv_heads", 0), mlp=getattr(model, "mlp", "gelu"))
    dims.update(head_dim=getattr(model, "head_dim", 0))  # 0: d_model / num_heads
    return dims


def segment_lengths(
    seq_len: int,
    segments: int,
    kind: str = "uniform",
    *,
    d_model: int | None = None,
    num_heads: int | None = None,
    d_ff: int | None = None,
    vocab_size: int | None = None,
    num_layers: int | None = None,
    multiple: int = 1,
    num_kv_heads: int = 0,
    mlp: str = "gelu",
    head_dim: int = 0,
) -> tuple[int, ...]:
    """Lengths of `segments` contiguous segments summing to `seq_len`.

    Every length is a positive multiple of `multiple`. `uniform` spreads the blocks of
    `multiple` tokens as evenly as possible, giving any extra block to the earliest
    segments (they are the cheapest under causal attention). `flops` equalises the
    per-layer cost model above (the head spread over `num_layers` if given): it
    solves each boundary for an equal share of the cumulative cost (the same as solving
    f(s, P) = T/K from the tail) and rounds it to the nearest multiple.
    """
    if kind not in KINDS:
        raise PartitionError(f"unknown partition kind {kind!r}; choose one of {KINDS}")
    if seq_len < 1 or segments < 1 or multiple < 1:
        raise PartitionError(
            f"seq_len, segments and multiple must be >= 1, got {seq_len}, {segments}, {multiple}"
        )
    if seq_len % multiple:
        raise PartitionError(f"seq_len {seq_len} is not a multiple of {multiple}")
    blocks = seq_len // multiple
    if segments > blocks:
        raise PartitionError(
            f"{segments} segments of at least {multiple} tokens do not fit in {seq_len} tokens"
        )
    if kind == "uniform":
        base, extra = divmod(blocks, segments)
        return tuple((base + (i < extra)) * multiple for i in range(segments))
    dense, attn = _dense_and_attn(
        d_model, num_heads, d_ff, vocab_size, num_layers, num_kv_heads, mlp, head_dim
    )
    total = _prefix_cost(seq_len, dense, attn)
    bounds = [0]
    for j in range(1, segments):
        # Solve dense*P + attn*P*P/2 = total*j/K for P.
        exact = (-dense + math.sqrt(dense * dense + 2 * attn * total * j / segments)) / attn
        # Clamp so every segment keeps at least one block, front and back.
        lo, hi = bounds[-1] // multiple + 1, blocks - (segments - j)
        bounds.append(min(max(round(exact / multiple), lo), hi) * multiple)
    bounds.append(seq_len)
    return tuple(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))


def segment_flops(
    lengths: Sequence[int],
    *,
    d_model: int,
    num_heads: int,
    d_ff: int,
    vocab_size: int,
    num_layers: int | None = None,
    num_kv_heads: int = 0,
    mlp: str = "gelu",
    head_dim: int = 0,
) -> tuple[float, ...]:
    """Each segment's share (summing to 1) of one micro-batch's cost, per the model above."""
    if not lengths or min(lengths) < 1:
        raise PartitionError(f"segment lengths must be positive, got {tuple(lengths)}")
    dense, attn = _dense_and_attn(
        d_model, num_heads, d_ff, vocab_size, num_layers, num_kv_heads, mlp, head_dim
    )
    ends = [0]
    for n in lengths:
        ends.append(ends[-1] + n)
    costs = [
        _prefix_cost(b, dense, attn) - _prefix_cost(a, dense, attn)
        for a, b in zip(ends[:-1], ends[1:], strict=True)
    ]
    total = sum(costs)
    return tuple(c / total for c in costs)


def chunk_costs(
    chunks: int,
    seq_len: int,
    *,
    d_model: int,
    num_heads: int,
    d_ff: int,
    vocab_size: int,
    num_layers: int,
    layers_per_chunk: Sequence[int] | None = None,
    num_kv_heads: int = 0,
    mlp: str = "gelu",
    head_dim: int = 0,
) -> dict[str, tuple[float, ...]]:
    """Work beyond the layers per global chunk, as `schedule.stats(chunk_costs=...)` takes,
    and with `layers_per_chunk` (an uneven split) each chunk's layer count ("layers").

    In units of a mean unit's forward through one chunk (num_layers / chunks layers of
    the per-layer model above, averaged over a sequence of `seq_len`). The head (final
    norm, logits [D, V] and loss, forward and backward: 3 * 2*D*V FLOPs per token in its
    matmuls) runs in the last chunk's forward ("F"); the embedding's gradient (a
    scatter-add, D per token) in the first chunk's backward ("B"); its forward is a gather.
    """
    if chunks < 1 or seq_len < 1:
        raise PartitionError(f"chunks and seq_len must be >= 1, got {chunks}, {seq_len}")
    dense, attn = _dense_and_attn(
        d_model, num_heads, d_ff, vocab_size, None, num_kv_heads, mlp, head_dim
    )
    if num_layers is None or num_layers < 1:
        raise PartitionError(f"num_layers must be >= 1, got {num_layers}")
    per_token = num_layers / chunks * _prefix_cost(seq_len, dense, attn) / seq_len
    head, embed = [0.0] * chunks, [0.0] * chunks
    head[-1] = 3 * 2 * d_model * vocab_size / per_token
    embed[0] = d_model / per_token
    out = {"F": tuple(head), "B": tuple(embed)}
    if layers_per_chunk is not None:
        if len(layers_per_chunk) != chunks or sum(layers_per_chunk) != num_layers:
            raise PartitionError(
                f"layers_per_chunk {tuple(layers_per_chunk)} must give {chunks} chunks "
                f"{num_layers} layers in all"
            )
        out["layers"] = tuple(float(d) for d in layers_per_chunk)
    return out


def stage_layers(
    split: str,
    num_layers: int,
    stages: int,
    virtual: int = 1,
    *,
    seq_len: int | None = None,
    d_model: int | None = None,
    num_heads: int | None = None,
    d_ff: int | None = None,
    vocab_size: int | None = None,
    num_kv_heads: int = 0,
    mlp: str = "gelu",
    head_dim: int = 0,
) -> tuple[int, ...]:
    """Layers of each global chunk (stage r's c-th chunk is chunk c * stages + r).

    `even`: num_layers / (stages * virtual) each. `flops` (virtual = 1): the busiest
    stage's work per micro-batch, forward and backward (3 layer-forwards per layer, the
    head's 6 * D * V per token on the last stage, the embedding's gradient on the first),
    as small as it goes; in the steady state every tick lasts as long as that stage's
    pair. An explicit split is a comma-separated count per stage ("7,7,6,4").
    """
    chunks = stages * virtual
    if split == "even":
        if num_layers % chunks:
            raise PartitionError(
                f"{num_layers} layers do not split evenly into {chunks} chunks "
                f"({stages} stages x {virtual} virtual)"
            )
        return (num_layers // chunks,) * chunks
    if virtual != 1:
        raise PartitionError(
            f"an uneven layer split ({split!r}) needs virtual stages = 1, got {virtual}"
        )
    if split == "flops":
        return _balanced_layers(
            num_layers,
            stages,
            seq_len,
            d_model,
            num_heads,
            d_ff,
            vocab_size,
            num_kv_heads,
            mlp,
            head_dim,
        )
    try:
        depths = tuple(int(x) for x in split.split(","))
    except ValueError:
        raise PartitionError(
            f"layer split {split!r} is not one of {LAYER_SPLITS} or a comma-separated list "
            "of layer counts, one per stage"
        ) from None
    if len(depths) != stages or min(depths) < 1 or sum(depths) != num_layers:
        raise PartitionError(
            f"layer split {split!r} must give each of the {stages} stages at least one "
            f"layer, {num_layers} in all"
        )
    return depths


def _balanced_layers(
    num_layers,
    stages,
    seq_len,
    d_model,
    num_heads,
    d_ff,
    vocab_size,
    num_kv_heads,
    mlp,
    head_dim=0,
):
    if num_layers < stages:
        raise PartitionError(f"{num_layers} layers cannot fill {stages} stages")
    if seq_len is None or seq_len < 1:
        raise PartitionError(f"the 'flops' layer split needs a positive seq_len, got {seq_len}")
    dense, attn = _dense_and_attn(
        d_model, num_heads, d_ff, vocab_size, None, num_kv_heads, mlp, head_dim
    )
    layer = _prefix_cost(seq_len, dense, attn) / seq_len  # one layer's forward per token
    extra = [0.0] * stages  # forward and backward beyond the layers, in layer-forwards
    extra[-1] += 3 * 2 * d_model * vocab_size / layer
    extra[0] += d_model / layer
    depths = [1] * stages
    for _ in range(num_layers - stages):  # each layer to the stage it leaves least loaded
        load = [3 * (d + 1) + e for d, e in zip(depths, extra, strict=True)]
        depths[load.index(min(load))] += 1
    return tuple(depths)


def segment_multiple(config) -> int:
    """What every segment length of `config` (a ConfigDict) is a multiple of:
    `pipeline.partition_multiple`, and the tensor devices, which split each segment's
    positions evenly. With C context devices a segment is 2C pieces, each a multiple of
    `partition_multiple` (the attention kernels' unit), and a device's two of them split
    evenly over the tensor devices (`seqpipe.parallel.context`)."""
    multiple, tensor = config.pipeline.partition_multiple, config.mesh.get("tensor", 1)
    context = config.mesh.get("context", 1)
    if context == 1:
        return math.lcm(multiple, tensor)
    return context * math.lcm(2 * multiple, tensor)
