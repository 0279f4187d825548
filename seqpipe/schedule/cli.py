"""`python -m seqpipe.schedule`: print or save a schedule; bad arguments exit 2 in one line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from seqpipe.host.files import atomic_write
from seqpipe.schedule import partition
from seqpipe.schedule.render import to_json, to_png, to_text, zero_bubble_table
from seqpipe.schedule.statistics import stats
from seqpipe.schedule.tables import DEPTHS, SCHEDULES, ScheduleError, build


def _parse_inflight(text: str) -> str | int:
    if text in DEPTHS:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be 'minimal', 'full' or an integer, got {text!r}"
        ) from None


def _fail(message: str):
    sys.stderr.write(f"error: {message}\n")
    sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m seqpipe.schedule", description=__doc__.split("\n")[0]
    )
    parser.error = _fail  # one line, no usage dump
    parser.add_argument("--schedule", required=True, help=", ".join(SCHEDULES))
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--microbatches", type=int, required=True)
    parser.add_argument("--segments", type=int, default=1)
    parser.add_argument("--virtual", type=int, default=1)
    parser.add_argument("--inflight", type=_parse_inflight, default="full")
    parser.add_argument("--format", choices=("text", "json", "png"), default="text")
    parser.add_argument("--out", help="output file (required for png; default stdout)")
    parser.add_argument("--seq-len", type=int, help="check K against it; weight stats by it")
    parser.add_argument("--partition", choices=partition.KINDS, default="uniform")
    parser.add_argument("--multiple", type=int, default=1, help="segment lengths multiple")
    for dim in ("d-model", "num-heads", "d-ff", "vocab-size", "num-layers"):
        parser.add_argument(f"--{dim}", type=int, help="model shape: FLOP-weighted costs")
    parser.add_argument(
        "--head",
        action="store_true",
        help="add the head's and embedding's work to the end chunks (needs --seq-len and "
        "the model shape with --num-layers)",
    )
    return parser


def _costs(args) -> tuple:
    """(unit costs, segment lengths, the chunks' extra costs) the arguments ask for; each
    None where not asked. ScheduleError or PartitionError for what does not go together."""
    if args.seq_len is None and args.partition != "flops":
        if args.head:
            raise ScheduleError("--head needs --seq-len and the model shape (--num-layers too)")
        return None, None, None
    if args.seq_len is None:
        raise ScheduleError("--partition flops needs --seq-len")
    shape = ("d_model", "num_heads", "d_ff", "vocab_size")
    if args.partition == "flops" and (missing := [k for k in shape if not getattr(args, k)]):
        flags = " ".join(f"--{k.replace('_', '-')}" for k in missing)
        raise ScheduleError(f"--partition flops needs the model shape: give {flags}")
    dims = {k: getattr(args, k) for k in (*shape, "num_layers")}
    lengths = partition.segment_lengths(
        args.seq_len, args.segments, args.partition, multiple=args.multiple, **dims
    )
    # Weight units by FLOPs whenever the model shape is known.
    costs = None
    if args.partition == "flops" or args.d_model is not None:
        costs = partition.segment_flops(lengths, **dims)
    extra = None
    if args.head:
        if args.d_model is None or args.num_layers is None:
            raise ScheduleError("--head needs --seq-len and the model shape (--num-layers too)")
        extra = partition.chunk_costs(args.stages * args.virtual, args.seq_len, **dims)
    return costs, lengths, extra


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m seqpipe.schedule ...`: print or save a schedule; bad arguments exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    if "--zero-bubble-table" in argv:  # the issue-16 comparison, at --inflight's depth
        rest = argv[argv.index("--inflight") + 1 :] if "--inflight" in argv else ["full"]
        sys.stdout.write(zero_bubble_table(_parse_inflight(rest[0])))
        return 0
    args = _parser().parse_args(argv)
    try:
        costs, lengths, extra = _costs(args)
        sched = build(
            args.schedule,
            args.stages,
            args.microbatches,
            args.segments,
            args.virtual,
            args.inflight,
        )
        if args.format == "png" and not args.out:
            raise ScheduleError("--format png needs --out FILE")
        if args.out:
            _check_out(args.out)
    except ValueError as e:  # ScheduleError and PartitionError
        _fail(str(e))
    st = stats(sched, costs, lengths, extra)
    if args.format == "png":
        write = lambda f: to_png(sched, f, costs, lengths, extra)
    else:
        text = to_text(sched, st) if args.format == "text" else json.dumps(to_json(sched, st))
        text = text if args.format == "text" else text + "\n"
        if not args.out:
            sys.stdout.write(text)
            return 0
        write = lambda f: f.write(text.encode())
    try:
        atomic_write(args.out, write)  # whole or not at all
    except OSError as e:
        _fail(f"--out {args.out}: writing failed ({e.strerror or e}); free space or choose another")
    return 0


def _check_out(path: str) -> None:
    """An --out that cannot be written is refused before any work."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ScheduleError(f"--out {path} is a directory; give a file name")
    if not os.path.isdir(parent):
        raise ScheduleError(
            f"--out {path}: {parent} is not a directory; create it or choose another"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ScheduleError(
            f"--out {path}: {parent} is not writable; make it writable or choose another --out"
        )
