"""Kernels a compiled step launches, read from XLA's optimized HLO text: each while body
times its known trip count, and for each conditional the kernels of its branches (which
branch runs depends on the tick, so the step's total is given as a lower and an upper
bound), then the branches of the big conditionals (the pipeline's units) one by one.

    XLA_FLAGS=--xla_dump_to=/tmp/d python train.py --config configs/gpt_1b.py \\
        --compile_only --topology h200 --config.mesh.stage=1 [--config.pipeline...]
    python scripts/gpu_kernel_count.py /tmp/d/*jit_train_step*gpu_after_optimizations.txt

An instruction that is not a container (while, conditional, call) and not free (parameter,
tuple, get-tuple-element, bitcast, constant) counts as one kernel: on a GPU each fusion,
library call or copy is one.
"""

import functools
import re
import sys

from seqpipe import hlo

FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all"}
_OPCODE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][\w\-]*)\(")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def branches(line: str) -> list[str]:
    names = re.findall(r"(?:true_computation|false_computation)=%?([\w.\-]+)", line)
    listed = re.search(r"branch_computations=\{([^}]*)\}", line)
    return names + ([n.strip().lstrip("%") for n in listed.group(1).split(",")] if listed else [])


def main(path: str) -> None:
    text = open(path).read()
    comps = hlo.computations(text)
    entry = re.search(r"^ENTRY %?([\w.\-]+)", text, re.M).group(1)

    @functools.cache
    def count(name: str) -> tuple[int, int]:
        lo = hi = 0
        for line in comps[name].splitlines()[1:]:
            m = _OPCODE.match(line)
            if not m or m.group(1) in FREE:
                continue
            op = m.group(1)
            if op == "while":
                trips = _TRIPS.search(line)
                body = count(re.search(r"body=%?([\w.\-]+)", line).group(1))
                n = int(trips.group(1)) if trips else 1
                lo, hi = lo + n * body[0], hi + n * body[1]
            elif op == "conditional":
                each = [count(b) for b in branches(line)]
                lo, hi = lo + 1 + min(c[0] for c in each), hi + 1 + max(c[1] for c in each)
            elif op == "call":
                body = count(re.search(r"to_apply=%?([\w.\-]+)", line).group(1))
                lo, hi = lo + body[0], hi + body[1]
            else:
                lo, hi = lo + 1, hi + 1
        return lo, hi

    print(f"step: {count(entry)[0]:,} to {count(entry)[1]:,} kernels")
    for name, body in comps.items():
        for line in body.splitlines():
            if " conditional(" in line:
                each = [count(b) for b in branches(line)]
                if max(c[1] for c in each) >= 500:
                    print(f"conditional in {name}: branches {each}")


if __name__ == "__main__":
    main(sys.argv[1])
