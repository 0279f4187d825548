"""The planner's memory estimate against the compiled step, on candidates of its space.

    python scripts/plan_memory_agreement.py --config gpt_1b --topology h200-8 \\
        --seq-len 8192 --global-batch 32 [--pick 10] [--config.key=value ...]

Picks `--pick` candidates spread over meshes, schedules and remat policies (`pick`),
compiles each for the target as the planner does (`confirm.confirm`) and prints estimate,
compiled figure and their ratio as Markdown; the ratios bound `seqpipe.plan.bounds.LOW`
and `HIGH`. A step the TPU compiler refuses as over HBM gives its temporaries, a lower
bound on its peak (and so on its ratio, which is what LOW needs).
"""

import sys
import time


def main(argv):
    import argparse

    from seqpipe.run import config as config_lib
    from seqpipe.targets import topology

    parser = argparse.ArgumentParser()
    for flag in ("--config", "--topology"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--pick", type=int, default=10)
    args, rest = parser.parse_known_args(argv)
    target = topology.parse(args.topology)
    target.prepare_env()
    from seqpipe.plan import confirm, plan, search, space, timing
    from seqpipe.train import aot

    config = config_lib.load(args.config, config_lib.parse_overrides(rest))
    p = plan.problem_of(config, target, args.seq_len, args.global_batch)
    cands = space.candidates(p)
    picks = pick(cands, args.pick)
    devices, rates = target.devices(), timing.rates_for(target)
    print("| candidate | estimate GiB | compiled GiB | compiled / estimate | compile s |")
    print("|---|---|---|---|---|", flush=True)
    for c in picks:
        row = search.evaluate(config, c, p.seq_len, p.global_batch, rates, target.budget(), True)
        if "invalid" in row:
            continue
        t0 = time.perf_counter()
        # Compiled as the planner confirms a candidate: a step the TPU compiler refuses as
        # over HBM comes back with its need, a lower bound on its peak.
        out = confirm.confirm(row, devices, target.budget(), aot.compile_config)
        if "compile_error" in out:
            raise SystemExit(f"{c.label}: {out['compile_error']}")
        est, got = out["memory_estimate_bytes"], out["memory_per_device_bytes"]
        over = "> " if out.get("over_hbm") else ""
        refused = " (temporaries alone, over HBM)" if over else ""
        print(
            f"| {c.label} | {est / 2**30:.2f} | {over}{got / 2**30:.2f}{refused} | "
            f"{over}{got / est:.3f} | {time.perf_counter() - t0:.0f} |",
            flush=True,
        )


def pick(cands, count):
    """`count` candidates spread over the space (a fixed seed): the remat policies, then
    the schedules, in turn, each on a mesh drawn at random."""
    import random

    rng = random.Random(0)
    small = [c for c in cands if c.microbatches * c.segments <= 64]
    remats = sorted({c.remat for c in small})
    names = sorted({c.schedule for c in small})
    out = []
    for i in range(count):
        pool = [c for c in small if c.remat == remats[i % len(remats)]]
        pool = [c for c in pool if c.schedule == names[i % len(names)]] or pool
        out.append(rng.choice(pool))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
