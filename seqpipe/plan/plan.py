"""The planner's steps: enumerate, estimate, refine, compile the best, print."""

from __future__ import annotations

import sys

from seqpipe import errors
from seqpipe.plan import bounds, confirm, rank, render, search, space, timing
from seqpipe.plan.space import Candidate
from seqpipe.run import cli

GiB = 2**30
LIMIT = 3000  # candidates estimated at most, in the bound's order (the rest: unexplored)
REFINE = 5  # the fastest candidates whose equal-FLOP segments and layer split are tried


def problem_of(config, target, seq_len: int, batch: int) -> space.Problem:
    m = config.model
    per_host = getattr(target, "chips", 8) if not hasattr(target, "hosts") else 8
    return space.Problem(
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.get("num_kv_heads", 0) or m.num_heads,
        devices=target.chips,
        seq_len=seq_len,
        global_batch=batch,
        devices_per_host=min(per_host, 8),
        partition_multiple=config.pipeline.partition_multiple,
        num_experts=m.get("num_experts", 0),
    )


def hand_picked(config, p: space.Problem) -> list[tuple[str, Candidate]]:
    """The README's recommended setting (the config's own pipeline, or the README's
    8-stage Seq1F1B M=8 K=4 where the config does not pipeline), 1F1B with S = 8, M = 8,
    and Seq1F1B with S = 8, M = 8, K = 4; the data replicas take the other devices."""
    pp = config.pipeline
    own = config.mesh.stage if config.mesh.stage > 1 else 0
    data = max(1, p.devices // 8)
    context = config.mesh.get("context", 1)
    readme = (
        Candidate(
            p.devices // (own * context * config.mesh.tensor) or 1,
            own,
            config.mesh.tensor,
            pp.schedule,
            pp.microbatches,
            pp.segments,
            pp.virtual_stages,
            str(pp.inflight),
            pp.remat if pp.remat != "auto" else "full",
            context=context,
        )
        if own
        else Candidate(data, 8, 1, "seq1f1b", 8, 4, 1, "full", "full")
    )
    return [
        ("README's recommended", readme),
        ("1f1b S=8 M=8", Candidate(data, 8, 1, "1f1b", 8, 1, 1, "full", "full")),
        ("seq1f1b S=8 M=8 K=4", Candidate(data, 8, 1, "seq1f1b", 8, 4, 1, "full", "full")),
    ]


def estimate_all(config, p, rates, budget, Bar, keep: int) -> list[dict]:
    """The candidates in the order of their lower bound (`search.lower_bound`), each
    estimated until the bound passes the `keep`-th fastest runnable estimate: the rest
    are `pruned` (no schedule of theirs can be faster). Then the equal-FLOP segments and
    layer splits of the fastest few."""
    cands = space.candidates(p)
    order = sorted(
        (
            (search.lower_bound(config, c, p.seq_len, p.global_batch, rates), i, c)
            for i, c in enumerate(cands)
        ),
    )
    bar = Bar("estimating", min(len(order), LIMIT))
    rows, times = [], []
    for n, (bound, _, c) in enumerate(order):
        if (len(times) >= keep and bound > times[keep - 1]) or n >= LIMIT:
            rest = order[n:]
            if not times and n >= LIMIT:  # nothing fits yet: try the leanest next
                rest.sort(key=lambda o: lean(o[2]))
                rows += estimate_some(config, p, rates, budget, [o[2] for o in rest[:LIMIT]])
                rest = rest[LIMIT:]
            why = "pruned" if n < LIMIT else "unexplored"
            rows += [{"candidate": x, "label": x.label, why: b} for b, _, x in rest]
            break
        rows += estimate_some(config, p, rates, budget, [c])
        if rank.runnable(rows[-1]):
            times = sorted(times + [rows[-1]["step_s"]])
        bar.tick(c.label)
    bar.done()
    for row in rank.ranked(rows)[:REFINE]:
        for c in space.refinements(row["candidate"]):
            rows.append(search.evaluate(config, c, p.seq_len, p.global_batch, rates, budget))
    return rows


REMAT_LEAN = ("full_layer", "full", "layer", "dots", "none")  # least memory first


def lean(c: Candidate) -> tuple:
    """Memory-lean first: the most devices a replica's work is split over (stages, tensor
    and context), then most segments, then the least-keeping remat."""
    return (-c.stage * c.tensor * c.context, -c.segments, REMAT_LEAN.index(c.remat), c.label)


def estimate_some(config, p, rates, budget, cands: list) -> list[dict]:
    """Rows for `cands`: exact rejections by the state alone, else the models' estimates."""
    out = []
    for c in cands:
        state = search.state_of(config, c, p.seq_len, p.global_batch)
        if state > budget:  # the parameters and moments alone: exact, no model
            out.append({"candidate": c, "label": c.label, "state_over": state})
        else:
            out.append(search.evaluate(config, c, p.seq_len, p.global_batch, rates, budget))
    return out


def fits_nowhere(rows: list[dict], budget: int, target) -> str:
    """The one line for a model no candidate fits."""
    low = rank.smallest(rows)
    if low is None:
        return f"no valid setting on {target.name}"
    need = rank.need(low)
    where = {"compiled": "compiled", "estimated": "estimated"}.get(
        low.get("memory_source"), "exact"
    )
    least = need * bounds.LOW if where == "estimated" else need
    priced = sum("memory_per_device_bytes" in r or "state_over" in r for r in rows)
    return (
        f"the model fits nowhere on {target.name} ({priced} candidates priced): the "
        f"smallest ({low['label']}) "
        f"needs {least / GiB:.1f} GiB a device ({where}) of {budget / GiB:.1f}; use a slice "
        f"with at least {least / budget:.1f}x the devices or the memory a device"
    )


def no_winner(rows: list[dict], budget: int, target, tries: int) -> str:
    """The one line where no compile confirmed a candidate: the model fits nowhere, or
    candidates the estimate says fit were left uncompiled when the tries ran out."""
    left = rank.ranked(rows)
    if not left:
        return fits_nowhere(rows, budget, target)
    failed = [r for r in rows if r.get("memory_source") == "compiled" and not r.get("fits")]
    least = min(
        (r["memory_per_device_bytes"] for r in failed if "memory_per_device_bytes" in r),
        default=None,
    )
    lean = min(left, key=rank.need)
    compiled = f"the compiled ones need {least / GiB:.1f} GiB or more" if least else "none compiled"
    return (
        f"no candidate confirmed on {target.name} in {tries} compiles ({compiled} of "
        f"{budget / GiB:.1f}); {len(left)} more are estimated to fit, the leanest "
        f"{lean['label']} at {rank.need(lean) / GiB:.1f} GiB: rerun with a larger --compile"
    )


def run(args, config, overrides, target, seq_len, batch, Bar, compile_step) -> int:
    """The planner, start to end; `compile_step` is `train.compile_config` (the caller
    passes it in, so the planner does not import the trainer)."""
    p = problem_of(config, target, seq_len, batch)
    try:
        space.check(p)
    except space.PlanError as e:
        cli.fail(str(e))
    rates, budget = timing.rates_for(target), target.budget()
    rows = estimate_all(config, p, rates, budget, Bar, args.top + args.compile)
    if not rank.ranked(rows):
        cli.fail(fits_nowhere(rows, budget, target))
    try:
        devices = target.devices()
    except errors.TopologyError as e:
        cli.fail(str(e))
    tries = 3 * args.compile
    bar = Bar("compiling", tries)  # at most: until --compile fit, then faster challengers
    rows = confirm.confirm_best(rows, devices, budget, args.compile, tries, bar.tick, compile_step)
    bar.done()
    best = rank.winner(rows)
    if best is None:
        cli.fail(no_winner(rows, budget, target, tries))
    picks = [
        (name, search.evaluate(config, c, seq_len, batch, rates, budget, True))
        for name, c in hand_picked(config, p)
    ]
    report(args, config, overrides, target, rows, best, picks, rates, budget)
    return 0


def report(args, config, overrides, target, rows, best, picks, rates, budget) -> None:
    """Print the table, the rejected, the comparison, the time model and the command."""
    seq_len, batch = best["config"].train.seq_len, best["config"].train.global_batch_size
    order = rank.ranked(rows)
    shown = order[: args.top]
    compiled = [r for r in rows if r.get("memory_source") == "compiled"]
    ids = {id(r) for r in shown}
    others = [r for r in shown + [c for c in compiled if id(c) not in ids] if r is not best]
    lost = [r for r in rows if not rank.runnable(r) or id(r) not in ids]
    cmd = render.command(args.config, best["candidate"], seq_len, batch, overrides)
    out = sys.stdout
    print(
        f"{target.headline()}: {len(rows)} candidates for "
        f"{args.config} at {seq_len} tokens x {batch}; budget {budget / GiB:.1f} GiB a "
        f"device",
        file=out,
    )
    print(
        f"time model: {rates.basis}; the schedule's tick model with the head on the last "
        "stage (estimates that rank, not measurements)",
        file=out,
    )
    print(
        f"memory: 'compiled' is the target's compiler ({target.name}), 'estimated' the "
        f"analytic model (rejected alone only above {1 / bounds.LOW:.2f}x the budget)\n",
        file=out,
    )
    print(render.table(shown), "\n", file=out)
    print("rejected:", file=out)
    print(
        render.rejected([r for r in lost if "invalid" not in r], best, budget, 12), "\n", file=out
    )
    comp = rank.comparison(best, picks)
    print("the winner against hand-picked settings (same model):", file=out)
    print(render.comparison(comp), "\n", file=out)
    left = confirm.unconfirmed(rows, best)
    if left:
        lean = min(left, key=rank.need)
        print(
            f"not confirmed: {len(left)} faster candidates were not compiled (the leanest, "
            f"{lean['label']}, estimated at {rank.need(lean) / GiB:.1f} GiB of "
            f"{budget / GiB:.1f}); a larger --compile tries them",
            file=out,
        )
    print(
        f"winner: {best['label']}, {best['step_s']:.4g} s a step (estimated), "
        f"{best['memory_per_device_bytes'] / GiB:.2f} GiB a device (compiled)",
        file=out,
    )
    print(cmd, file=out)
    if args.json:
        extra = {
            "topology": target.name,
            "time_model": rates.basis,
            "budget_bytes": budget,
            "comparison": comp,
            "unconfirmed_faster": len(left),
        }
        print(render.last_line(best, cmd, others, extra), file=out, flush=True)
