"""What a compiled step runs, read from XLA's optimized HLO text: kernels, the bytes they
move, matmul FLOPs and host round trips (conditionals, and unit loops' predicates) per
step, by kind of kernel.

    XLA_FLAGS=--xla_dump_to=/tmp/d python train.py --config configs/gpt_1b.py \\
        --compile_only --topology h200 --config.mesh.stage=1 [--config.pipeline...]
    python -m seqpipe.tools.step_cost /tmp/d/*jit_train_step*gpu_after_optimizations.txt \\
        --microbatches 8 --segments 4

Counting rules. An instruction that is not a container (while, conditional, call) and not
free (parameter, tuple, get-tuple-element, bitcast, constant) is one kernel: on a GPU each
fusion, library call or copy is one. A while loop counts its body times its known trip
count. Which branch of a conditional runs depends on the tick, so the pipeline's are
counted from what the schedule runs on one stage: every segment's forward and backward
unit M times a step. A loop of unknown trip count in the tick loop is one segment's unit
(`pipeline.run_if`): it runs M times of the loop's T trips. A two-way conditional there
(the executor before run_if) is a unit's "runs or idles": it runs M x (its segment
switch's width, else 1) times of the T trips; any other conditional counts the mean of
its branches: a context device's `lax.switch` on its place (`seqpipe.parallel.context`)
too, whose branches do equal work. With mesh.context = C the module is one context
device's, so are the figures. (Checked on matmul FLOPs, which must equal the model's:
tests/test_step_cost.py.)

Bytes: a fusion's operands and results, except that an operand only sliced (or updated
in place) inside the fusion counts the slices, and an in-place dynamic-update-slice counts
the update (read and written), not the buffer; a Triton kernel given the K/V cache whole
counts one slot's one layer of it (`operand_bytes`); a collective what it reads and writes
on the device, not its time on the wire. FLOPs: 2 x output elements x
contracted size of each dot, in fusions (Triton GEMMs) and cuBLAS calls alike.

Time: a roofline per kernel, max(FLOPs / F, bytes / B). `H200` holds F and B fitted to
the steps that one H200 ran (../shared/device.md, at 0952314; the fit and its residuals
are in docs/performance.md): it is an estimate that ranks changes, not a measurement.
"""

import argparse
import collections
import dataclasses
import json
import math
import re
import sys

from seqpipe.targets import hlo

FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all"}
# Collectives (context parallelism's K/V gathers, tensor parallelism's reductions, the
# gradients' after the loop): one kernel each, its `-start` where it runs async (the
# `-done` only waits for it).
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
FREE |= {f"{name}-done" for name in COLLECTIVES}
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4}
_BYTES |= {"u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]\w*?)\[([\d,]*)\]")
# Fitted to five measured H200 steps (docs/performance.md): matmuls at 475 TFLOP/s, memory
# at 4.3 TB/s; a fixed cost per kernel fitted to 0 (1 us fitted worse, 6 us far worse).
H200 = (475e12, 4.3e12, 0.0)
_CALLS = r"calls=%?([\w.\-]+)"
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    type: str  # the result's type text: an array or a (tuple)
    op: str
    operands: tuple[str, ...]
    line: str


def _closing(text: str, start: int) -> int:
    """Index just past the parenthesis that closes the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    raise ValueError(f"unbalanced parentheses in {text[:80]!r}")


def parse(line: str) -> Instr | None:
    """One instruction line of HLO text, or None for anything else."""
    m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*", line)
    if not m:
        return None
    rest = line[m.end() :]
    if rest.startswith("("):
        end = _closing(rest, 0)
    else:
        end = rest.find(" ")
    op = re.match(r"\s*([a-z][\w\-]*)\(", rest[end:])
    if not op:
        return None
    start = end + op.end() - 1
    args = rest[start + 1 : _closing(rest, start) - 1]
    operands = tuple(re.findall(r"%([\w.\-]+)", args))
    return Instr(m.group(1), rest[:end], op.group(1), operands, line)


def size_of(type_text: str) -> int:
    """Bytes of every array in a type (a tuple's elements summed)."""
    return sum(
        _BYTES.get(dtype, 0) * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in _ARRAY.findall(type_text)
    )


def dot_flops(instr: Instr, types: dict[str, str]) -> float:
    """2 x output elements x contracted size: of a dot, or of a cuBLAS GEMM call (its dot
    dimensions are in its backend config); 0 for anything else."""
    if instr.op == "dot":
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.line).group(1)
    elif instr.op == "custom-call" and "gemm" in instr.line:
        found = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instr.line)
        contracting = found.group(1).replace('"', "") if found else ""
    else:
        return 0.0
    lhs = dims_of(types.get(instr.operands[0], ""))
    k = math.prod(lhs[int(d)] for d in contracting.split(",") if d)
    return 2.0 * math.prod(dims_of(instr.type)) * k


def operand_bytes(type_text: str, instr: Instr) -> float:
    """Bytes a kernel reads of an operand: all of it, except that a Triton kernel (the
    Pallas attention) given the executor's K/V cache words whole ([slots, n, b, Lkv, H,
    E]) reads one slot's one layer of them at most."""
    dims = dims_of(type_text)
    if instr.op == "custom-call" and "triton" in instr.line and len(dims) == 6:
        return size_of(type_text) / (dims[0] * dims[1])
    return size_of(type_text)


def dims_of(type_text: str) -> list[int]:
    """The dimensions of the first array in a type."""
    m = _ARRAY.search(type_text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


@dataclasses.dataclass
class Cost:
    """Kernels by (kind, FLOPs, bytes), each with how many times it runs; and host round
    trips (conditionals, whose predicate the host reads)."""

    kernels: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    round_trips: float = 0.0

    def add(self, other: "Cost", times: float = 1.0) -> None:
        for key, n in other.kernels.items():
            self.kernels[key] += times * n
        self.round_trips += times * other.round_trips

    def kernel(self, kind: str, nbytes: float, flops: float) -> None:
        self.kernels[(kind, flops, nbytes)] += 1

    def total(self, what: str, kind: str | None = None) -> float:
        """Step total of "kernels", "flops" or "bytes", of one kind or all."""
        col = {"kernels": None, "flops": 1, "bytes": 2}[what]
        return sum(
            n * (1 if col is None else key[col])
            for key, n in self.kernels.items()
            if kind is None or key[0] == kind
        )

    def seconds(self, flop_rate: float, byte_rate: float, per_kernel: float) -> float:
        """A roofline estimate: each kernel takes its FLOPs or its bytes' time, whichever
        is longer, plus a fixed cost per kernel."""
        return sum(
            n * (max(flops / flop_rate, nbytes / byte_rate) + per_kernel)
            for (_, flops, nbytes), n in self.kernels.items()
        )


def kind_of(instr: Instr) -> str:
    """A kernel's kind, by what XLA named it: GEMMs, weight and stash slicing, in-place
    updates, memsets, copies, custom kernels, the rest elementwise or reductions."""
    name = instr.name
    if instr.op.removesuffix("-start") in COLLECTIVES:
        return "collective"
    if instr.op == "custom-call":
        return "gemm" if "gemm" in instr.line.split("custom_call_target=")[-1][:40] else "custom"
    if instr.op == "copy" or name.startswith("copy"):
        return "copy"
    if "gemm" in name or "dot" in name.split("_fusion")[0]:
        return "gemm"
    if "dynamic_update_slice" in name or instr.op == "dynamic-update-slice":
        return "update"
    if "dynamic_slice" in name or "slice_fusion" in name or instr.op in ("dynamic-slice", "slice"):
        return "slice"
    if name.startswith("loop_broadcast") or instr.op == "broadcast":
        return "memset"
    if name.startswith("input_") or "reduce" in name:
        return "reduce"
    return "elementwise"


class Module:
    """An optimized HLO module's computations, parsed."""

    def __init__(self, text: str):
        self.comps = {
            name: [i for line in body.splitlines()[1:] if (i := parse(line))]
            for name, body in hlo.computations(text).items()
        }
        self.entry = re.search(r"^ENTRY %?([\w.\-]+)", text, re.M).group(1)
        self._flops, self._costs = {}, {}  # per computation (and units, tick trips)

    def types(self, comp: str) -> dict[str, str]:
        return {i.name: i.type for i in self.comps[comp]}

    def fused_flops(self, comp: str) -> float:
        """FLOPs of the dots in a fused computation and what it calls."""
        if comp in self._flops:
            return self._flops[comp]
        types = self.types(comp)
        self._flops[comp] = sum(
            dot_flops(i, types) + sum(self.fused_flops(c) for c in re.findall(_CALLS, i.line))
            for i in self.comps[comp]
        )
        return self._flops[comp]

    def fusion_bytes(self, instr: Instr, types: dict[str, str]) -> float:
        """Bytes a fusion moves: slices of operands only sliced, updates of buffers updated
        in place, everything else whole."""
        body = self.comps[callee(instr, "calls")]
        params = {
            int(re.search(r"parameter\((\d+)\)", i.line).group(1)): i
            for i in body
            if i.op == "parameter"
        }
        users = collections.defaultdict(list)
        for i in body:
            for position, name in enumerate(i.operands):
                users[name].append((i, position))

        def uses_of(name):  # through bitcasts, which move nothing
            out = []
            for user, position in users[name]:
                out += uses_of(user.name) if user.op == "bitcast" else [(user, position)]
            return out

        total = 0.0
        for index, operand in enumerate(instr.operands):
            param = params.get(index)
            uses = uses_of(param.name) if param else []
            windowed = ("dynamic-slice", "slice", "dynamic-update-slice")
            if uses and all(u.op in windowed and p == 0 for u, p in uses):
                # Read in windows (the slices count), or updated in place (the update
                # counts, on the result's side), or both: a window read, added to, written.
                total += sum(size_of(u.type) for u, _ in uses if u.op != "dynamic-update-slice")
            else:
                total += size_of(types.get(operand, ""))
        by_name = {i.name: i for i in body}
        root = next((i for i in body if i.line.lstrip().startswith("ROOT")), None)
        outputs = [root] if root and root.op != "tuple" else []
        if root and root.op == "tuple":
            outputs = [by_name[n] for n in root.operands if n in by_name]
        for out in outputs:
            if out.op == "dynamic-update-slice":
                update = by_name.get(out.operands[1])
                total += 2 * size_of(update.type if update else "")  # read-modify-write
            else:
                total += size_of(out.type)
        return total if outputs else total + size_of(instr.type)

    def cost(self, units: "Units | None" = None) -> Cost:
        """The entry computation's cost, one run of the step."""
        return self._cost(self.entry, units, None)

    def _cost(self, comp: str, units, tick_trips: int | None) -> Cost:
        """Cost of one run of `comp`. `tick_trips`: None outside any loop or conditional;
        the tick loop's trips in its body (and calls from there); 0 elsewhere."""
        key = (comp, units, tick_trips)
        if key not in self._costs:
            self._costs[key] = self._cost_of(comp, units, tick_trips)
        return self._costs[key]

    def _cost_of(self, comp: str, units, tick_trips: int | None) -> Cost:
        types, total = self.types(comp), Cost()
        for i in self.comps[comp]:
            if i.op in FREE:
                continue
            if i.op == "while":
                if m := _TRIPS.search(i.line):
                    n = int(m.group(1))
                elif units and tick_trips:  # a unit's loop (`pipeline.run_if`)
                    n = units.microbatches / tick_trips
                    total.round_trips += 1 + n  # its predicate, read before each trip
                else:
                    n = 1
                body = callee(i, "body")
                # The tick loop: outside any other, at least a trip per unit.
                outer = tick_trips is None and units and n >= units.microbatches * units.segments
                ticks = n if outer else 0
                total.add(self._cost(body, units, ticks), n)
            elif i.op == "conditional":
                total.round_trips += 1
                names = branches(i.line)
                each = [self._cost(b, units, 0) for b in names]
                weights = self.branch_weights(names, each, units, tick_trips)
                for w, c in zip(weights, each, strict=True):
                    total.add(c, w)
            elif i.op == "call":
                total.add(self._cost(callee(i, "to_apply"), units, tick_trips))
            else:
                self.leaf(i, types, total)
        return total

    def leaf(self, i: Instr, types: dict[str, str], total: Cost) -> None:
        """Add a kernel (an instruction that is no container) to `total`."""
        if i.op == "fusion":
            flops = self.fused_flops(callee(i, "calls"))
            total.kernel(kind_of(i), self.fusion_bytes(i, types), flops)
        else:
            operands = [types.get(o, "") for o in i.operands]
            nbytes = sum(map(operand_bytes, operands, [i] * len(operands)))
            total.kernel(kind_of(i), nbytes + size_of(i.type), dot_flops(i, types))

    def top_level(self, comp: str):
        """The instructions of `comp` and of the computations it calls, not those inside
        its loops or conditionals."""
        for i in self.comps[comp]:
            yield from self.top_level(callee(i, "to_apply")) if i.op == "call" else [i]

    def has_switch(self, comp: str, width: int) -> bool:
        """Whether `comp` (or a call from it) holds the executor's `width`-way switch over
        segments: a conditional of that width traced outside any unit (a unit's own are
        traced under `jvp`, by JAX's names)."""
        return any(
            i.op == "conditional"
            and len(branches(i.line)) == width
            and "jvp(" not in (re.search(r'op_name="([^"]*)"', i.line) or [""])[0]
            for i in self.top_level(comp)
        )

    def branch_weights(self, names, each, units, trips) -> list[float]:
        """How often each branch runs per execution of the conditional."""
        if units is None or not trips or len(names) != 2:
            return [1.0 / len(names)] * len(names)
        run = max(range(2), key=lambda b: each[b].total("kernels"))
        width = units.segments if units.segments > 1 else 0
        runs = units.microbatches * (width if width and self.has_switch(names[run], width) else 1)
        p = min(1.0, runs / trips)
        return [p if b == run else 1.0 - p for b in range(2)]


@dataclasses.dataclass(frozen=True)
class Units:
    """What the tick loop runs on one stage: each segment's units M times a step."""

    microbatches: int
    segments: int


def callee(instr: Instr, attribute: str) -> str:
    """The computation an instruction names by `attribute` (body, calls, to_apply)."""
    return re.search(attribute + r"=%?([\w.\-]+)", instr.line).group(1)


def branches(line: str) -> list[str]:
    """The branch computations of a conditional: true/false, or an indexed list."""
    names = re.findall(r"(?:true_computation|false_computation)=%?([\w.\-]+)", line)
    listed = re.search(r"branch_computations=\{([^}]*)\}", line)
    return names + ([n.strip().lstrip("%") for n in listed.group(1).split(",")] if listed else [])


def step_cost(text: str, microbatches: int = 1, segments: int = 1) -> Cost:
    """The cost of one step from its optimized HLO text; a pipelined step on one stage
    names its micro-batches and segments."""
    units = Units(microbatches, segments) if microbatches > 1 or segments > 1 else None
    return Module(text).cost(units)


def summary(cost: Cost) -> dict:
    kinds = sorted({key[0] for key in cost.kernels}, key=lambda k: -cost.total("bytes", k))

    def row(kind=None):
        return {
            "kernels": round(cost.total("kernels", kind)),
            "gbytes": round(cost.total("bytes", kind) / 1e9, 1),
            "tflops": round(cost.total("flops", kind) / 1e12, 2),
        }

    return {
        **row(),
        "round_trips": round(cost.round_trips),
        "h200_estimate_s": round(cost.seconds(*H200), 3),
        "by_kind": {k: row(k) for k in kinds},
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hlo", help="an optimized HLO dump (*after_optimizations.txt)")
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--segments", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        cost = step_cost(open(args.hlo).read(), args.microbatches, args.segments)
    except (OSError, AttributeError, KeyError) as e:  # no file, or not HLO module text
        name = type(e).__name__
        sys.exit(f"step_cost: cannot read {args.hlo} as optimized HLO module text ({name})")
    json.dump(summary(cost), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
