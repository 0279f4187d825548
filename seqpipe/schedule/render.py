"""A table as text, JSON and PNG, and the zero-bubble comparison table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from seqpipe.schedule.statistics import op_costs, stats
from seqpipe.schedule.tables import (
    GENERATORS,
    KINDS,
    NAMES,
    B,
    F,
    Schedule,
    Unit,
    W,
    build,
    cell_unit,
    has_weight_ops,
)


def _label(u: Unit, virtual: int) -> str:
    return f"{u.mb}.{u.seg}" + (f"c{u.chunk}" if virtual > 1 else "")


def to_text(s: Schedule, st: dict | None = None) -> str:
    """A grid, ticks across and stages down, cells like `F3.1/B2.0/W1.0`, then the statistics."""
    cells = [
        ["/".join(op.kind.value + _label(op.unit, s.virtual) for op in cell) or "." for cell in row]
        for row in s.ticks
    ]
    width = max(len(c) for row in cells for c in row)
    lines = ["tick     " + " ".join(f"{t:<{width}}" for t in range(len(cells)))]
    for r in range(s.stages):
        lines.append(f"stage {r:<2} " + " ".join(f"{row[r]:<{width}}" for row in cells))
    st = stats(s) if st is None else st
    lines.append("")
    lines.append(
        f"{s.name}  S={s.stages} M={s.microbatches} K={s.segments} V={s.virtual} "
        f"inflight={s.inflight}"
    )
    lines += [f"{k}: {v}" for k, v in st.items()]
    return "\n".join(lines) + "\n"


def to_json(s: Schedule, st: dict | None = None) -> dict:
    """The stable JSON form: header, ticks (one entry per stage per tick: its forward,
    backward and weight unit or null) and stats."""

    def unit(u: Unit | None):
        return None if u is None else {"mb": u.mb, "seg": u.seg, "chunk": u.chunk}

    return {
        "schedule": s.name,
        "stages": s.stages,
        "microbatches": s.microbatches,
        "segments": s.segments,
        "virtual": s.virtual,
        "ticks": [
            [
                {"stage": r, **{NAMES[k]: unit(cell_unit(cell, k)) for k in KINDS}}
                for r, cell in enumerate(row)
            ]
            for row in s.ticks
        ],
        "stats": stats(s) if st is None else st,
    }


_STYLE = {F: dict(alpha=0.45), B: dict(alpha=1.0, hatch="///"), W: dict(alpha=0.75, hatch="...")}


def to_png(
    s: Schedule,
    path: str,
    costs: Sequence[float] | None = None,
    lengths: Sequence[int] | None = None,
    chunk_costs: Mapping | None = None,
) -> None:
    """A timeline: one row per stage, x is synchronous time, boxes coloured by micro-batch.

    Time is in units of one whole micro-batch's forward on a stage (a unit costs 1/(K*V)
    of it), so pictures with different K or V share a scale. Forwards are light,
    backwards dark and hatched, weight gradients dotted; white gaps are bubbles. Ticks
    are drawn as long as their busiest stage, as the synchronous executor runs them.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    scale = s.segments * s.virtual
    width = op_costs(s, costs, lengths, chunk_costs) / scale
    st = stats(s, costs, lengths, chunk_costs)
    cmap = plt.get_cmap("tab10" if s.microbatches <= 10 else "tab20")
    total = st["time"] / scale
    fig, ax = plt.subplots(figsize=(max(8.0, total * 0.45), 0.55 * s.stages + 1.4))
    x = 0.0
    for t, row in enumerate(s.ticks):
        for r, cell in enumerate(row):
            y, x0 = s.stages - 1 - r, x
            for op in cell:
                u, w = op.unit, width[t, r, KINDS.index(op.kind)]
                ax.add_patch(
                    Rectangle(
                        (x0, y + 0.1),
                        w,
                        0.8,
                        facecolor=cmap(u.mb % cmap.N),
                        edgecolor="black",
                        linewidth=0.4,
                        **_STYLE[op.kind],
                    )
                )
                if w >= 0.2:
                    label = _label(u, s.virtual) if w >= 0.45 else str(u.mb)
                    if op.kind == W:
                        label = "W" + label
                    ax.text(x0 + w / 2, y + 0.5, label, ha="center", va="center", fontsize=6)
                x0 += w
        x += width[t].sum(axis=1).max()
    ax.set_xlim(0, x)
    ax.set_ylim(0, s.stages)
    ax.set_yticks([s.stages - 1 - r + 0.5 for r in range(s.stages)])
    ax.set_yticklabels([f"stage {r}" for r in range(s.stages)])
    ax.set_xlabel(
        "time (one micro-batch forward on a stage = 1; light = forward, hatched = backward"
        + (", dotted = W)" if has_weight_ops(s) else ")")
    )
    ax.set_title(
        f"{s.name}  S={s.stages} M={s.microbatches} K={s.segments} V={s.virtual} "
        f"inflight={s.inflight}: bubble {st['bubble']:.3f}, stage-0 peak "
        f"{st['inflight_peak'][0]} units = {st['activation_fraction'][0]:g} micro-batches"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")  # a path or a binary file
    plt.close(fig)


ZB_TABLE = ("1f1b", "zb_h1", "seq1f1b", "seq_zb_h1")


def zero_bubble_table(inflight: str | int = "full") -> str:
    """Bubble and stage-0 peak (micro-batches of activations) of 1F1B, Seq1F1B and their
    zero-bubble forms over S = 4, 8; M = 8, 16; K = 1, 2, 4 (the unit cost model)."""
    lines = [
        f"inflight={inflight}; each cell: bubble / stage-0 peak in micro-batches",
        "| S | M | K | " + " | ".join(ZB_TABLE) + " |",
        "|---|---|---|" + "---|" * len(ZB_TABLE),
    ]
    for S in (4, 8):
        for M in (8, 16):
            for K in (1, 2, 4):
                cells = []
                for name in ZB_TABLE:
                    k = K if GENERATORS[name].granularity == "segment" else 1
                    st = stats(build(name, S, M, k, inflight=inflight))
                    cells.append(f"{st['bubble']:.3f} / {st['activation_fraction'][0]:g}")
                lines.append(f"| {S} | {M} | {K} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
