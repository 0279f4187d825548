"""The planner's ranking on CPU against `make bench`'s unit-based prediction.

    python scripts/plan_rank_agreement.py [--top 5] [--pool 12]

For the bench model (configs/bench.py) on 4 stages, data 1, its remat: the planner's time
model (`seqpipe.plan.timing`, at nominal CPU rates: `timing.CPU`) ranks the candidates of
its space; the best `--pool` of them are then predicted as `make bench` predicts (every
one-layer unit compiled and timed on this CPU, `tick_model.UnitTimer`, the tick model
`tick_model.predicted`), and the two rankings of the planner's top `--top` are compared
(Kendall's tau, and how many of the planner's top are the measured top).
"""

import argparse
import sys


def kendall_tau(a: list, b: list) -> float:
    """Kendall's tau between two orderings of the same items."""
    pos = {x: i for i, x in enumerate(b)}
    n, score = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            score += 1 if pos[a[i]] < pos[a[j]] else -1
    return score / (n * (n - 1) / 2) if n > 1 else 1.0


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--pool", type=int, default=12)
    args = parser.parse_args(argv)
    from seqpipe.plan import rank, search, space, timing
    from seqpipe.run import config as config_lib
    from seqpipe.tools import tick_model

    config = config_lib.load("bench", {})
    t, m = config.train, config.model
    p = space.Problem(m.num_layers, m.num_heads, m.num_heads, 4, t.seq_len, t.global_batch_size)
    cands = [
        c
        for c in space.candidates(p, remats=(config.pipeline.remat,))
        if c.stage == 4 and c.tensor == 1
    ]
    rows = [search.evaluate(config, c, p.seq_len, p.global_batch, timing.CPU, 2**40) for c in cands]
    pool = rank.ranked(rows)[: args.pool]
    measured = {}
    for row in pool:
        c = row["candidate"]
        spec = search.dataclasses.replace(search.spec_of(row["config"], c), remat=c.remat)
        rows_mb = p.global_batch // (c.data * c.microbatches)
        timer = tick_model.UnitTimer(rows_mb, repeats=5)
        predicted = tick_model.predicted(spec, lambda sp, *a, t=timer: t.unit(sp, *a))
        measured[c.label] = predicted["time"]
        print(
            f"# {c.label}: planner {row['step_s'] * 1e3:.2f} ms, units "
            f"{measured[c.label] * 1e3:.2f} ms",
            file=sys.stderr,
            flush=True,
        )
    planner = [r["label"] for r in pool]
    by_units = sorted(planner, key=measured.get)
    top = planner[: args.top]
    print("| planner rank | candidate | planner ms | unit-based ms | unit-based rank |")
    print("|---|---|---|---|---|")
    for i, r in enumerate(pool[: args.top], 1):
        print(
            f"| {i} | {r['label']} | {r['step_s'] * 1e3:.2f} | "
            f"{measured[r['label']] * 1e3:.2f} | {by_units.index(r['label']) + 1} |"
        )
    tau = kendall_tau(top, sorted(top, key=measured.get))
    shared = len(set(top) & set(by_units[: args.top]))
    print(
        f"\nKendall tau of the top {args.top}: {tau:.2f}; {shared} of the planner's top "
        f"{args.top} are in the unit-based top {args.top} of the {len(pool)} timed"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
