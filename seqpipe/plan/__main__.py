"""`python -m seqpipe.plan`: the fastest setting that fits a model, a sequence and a slice.

python -m seqpipe.plan --config CONFIG --topology SLICE [--seq-len L]
    [--global-batch B] [--top 10] [--compile 3] [--json] [--config.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from seqpipe.run import cli
from seqpipe.run import config as config_lib
from seqpipe.targets import topology
from seqpipe.train.metrics import Progress

GiB = 2**30


class Bar:
    """A progress bar on stderr (redrawn on a terminal; a line a phase otherwise)."""

    def __init__(self, phase: str, total: int):
        self.phase, self.tty = phase, sys.stderr.isatty()
        self.progress, self.total = Progress(total, stream=sys.stderr), total
        self.t0 = time.perf_counter()

    def tick(self, note: str = "") -> None:
        self.progress.step += 1
        if self.tty:
            text = self.progress.text().split("  ")[0]
            sys.stderr.write(f"\r{self.phase} {text} {note[:60]}\x1b[K")
            sys.stderr.flush()
        elif self.phase != "estimating" or self.progress.step % max(1, self.total // 10) == 0:
            # Not a terminal (a log): a line every tenth of the estimates, and every compile.
            print(
                f"{self.phase} {self.progress.step}/{self.progress.total}: {note}",
                file=sys.stderr,
                flush=True,
            )

    def done(self) -> None:
        if self.tty:
            sys.stderr.write("\r\x1b[K")
        seconds = time.perf_counter() - self.t0
        print(f"{self.phase}: {self.progress.step} in {seconds:.0f} s", file=sys.stderr, flush=True)


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topology", required=True, help="v5p-16, v4-8, h200-8, h100-16, ...")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the config's")
    parser.add_argument("--global-batch", type=int, default=None, help="default: the config's")
    parser.add_argument("--top", type=int, default=10, help="rows of the ranked table")
    parser.add_argument("--compile", type=int, default=3, help="candidates to confirm")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")


def _target(name: str):
    try:
        target = topology.parse(name)
    except ValueError as e:
        cli.fail(str(e))
    target.prepare_env()
    return target


def main(argv: list[str]) -> int:
    """Plan, or refuse in one line; with `--json` the last line on stdout is JSON either
    way (`{"error": ...}` on failure), so a script reading it never finds nothing."""
    try:
        return _plan(argv)
    except cli.Refused as e:
        if "--json" in argv:
            print(json.dumps({"error": e.message}), flush=True)
        raise
    except Exception as e:  # a bug, not bad input: its traceback follows on stderr
        if "--json" in argv:
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        raise


def _sizes(args: argparse.Namespace, config) -> tuple[int, int]:
    """--seq-len and --global-batch, the config's where left out; 0 or less is refused
    with the value typed (0 is not "the config's")."""
    sizes = []
    for flag, typed, default in (
        ("--seq-len", args.seq_len, config.train.seq_len),
        ("--global-batch", args.global_batch, config.train.global_batch_size),
    ):
        if typed is not None and typed < 1:
            cli.fail(
                f"{flag} {typed}: must be at least 1 (leave it out for the config's {default})"
            )
        sizes.append(default if typed is None else typed)
    return sizes[0], sizes[1]


def _plan(argv: list[str]) -> int:
    parser = cli._Parser(prog="python -m seqpipe.plan")
    parser.usage_line = "--config CONFIG --topology SLICE [--seq-len L] [--global-batch B] [--json]"
    parser.add_argument("--config", required=True, help="config file, a name in configs/")
    _flags(parser)
    args, rest = parser.parse_known_args(argv)
    target = _target(args.topology)
    try:
        config = config_lib.load(args.config, overrides := config_lib.parse_overrides(rest))
    except config_lib.ConfigError as e:
        cli.fail(str(e))
    if args.top < 1 or args.compile < 1:
        cli.fail(f"--top {args.top} --compile {args.compile}: each must be at least 1")
    seq_len, batch = _sizes(args, config)
    # Here: jax loads with the planner and the trainer, after `_target` set the slice's
    # environment.
    from seqpipe.plan import plan
    from seqpipe.train import aot

    return plan.run(args, config, overrides, target, seq_len, batch, Bar, aot.compile_config)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
