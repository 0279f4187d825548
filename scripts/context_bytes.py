"""Bytes a step moves over the context axis per device: read from the compiled program,
beside an analytic count (context parallelism, `seqpipe.parallel.context`).

    XLA_FLAGS=--xla_dump_to=/tmp/d python train.py --config configs/gpt_1b.py --compile_only \\
        --topology h200-8 --config.mesh.context=8 [--config.pipeline...]
    python scripts/context_bytes.py \\
        --hlo /tmp/d/*jit_train_step*gpu_after_optimizations.txt \\
        --config configs/gpt_1b.py --config.mesh.context=8 [the same overrides]

Measured: each collective of the per-device program, by the mesh axes its groups span,
times how often it runs (`step_cost`'s counting: a loop its trips, the tick loop's units
M times a step; an async collective counted once, at its start; the trip counts are the
GPU compiler's, which a TPU compile's HLO does not carry), as the bytes one device
receives over a ring of n devices: an all-gather (n - 1) x its operand, a reduce-scatter
or all-to-all (n - 1) / n of it, an all-reduce 2 (n - 1) / n of it.

Analytic, per micro-batch, segment k and layer of the stage: the attention all-gathers
its local prefix and segment K and V, receiving (P_k + L_k)(C - 1)/C positions of each
(P_k, L_k the prefix and segment in the sequence); a backward re-gathers them (the
attention keeps only its own residuals) and reduce-scatters their cotangents, and the
remat policy's recomputes gather again (`GATHERS`); after the loop the gradients (and
the loss) are all-reduced over context.
"""

import math
import re
import sys

from seqpipe.targets import hlo
from seqpipe.tools import step_cost

# All-gathers of a layer's K (and of its V) per unit, by `pipeline.remat`: the forward
# unit's, then the backward's. The backward re-gathers for the attention's own vjp
# (always), and once more for each forward of the layer it runs: `full` its vjp of the
# unit, `layer` its vjp of the layer, `full_layer` both (the unit re-run for each layer's
# input, then the layer under its vjp); `dots` and `none` keep the attention's output.
GATHERS = {"full": (1, 2), "full_layer": (1, 3), "layer": (1, 2), "dots": (1, 1), "none": (1, 1)}
_AXES = ("data", "stage", "context", "tensor")
_ASYNC_DONE = ("-done", "async-done", "async-update")


def received(op: str, operand_bytes: float, n: int) -> float:
    """Bytes one device receives in a ring collective of `n` devices."""
    if op == "all-gather":
        return (n - 1) * operand_bytes
    if op == "all-reduce":
        return 2 * (n - 1) / n * operand_bytes
    if op in ("reduce-scatter", "all-to-all"):
        return (n - 1) / n * operand_bytes
    return operand_bytes  # collective-permute: what it sends, it receives


def axes_of(groups, sizes: dict[str, int]) -> tuple[tuple[str, ...], int]:
    """The mesh axes of size > 1 that `groups` (sets of device ids, the mesh's row-major
    order) span, and the group size."""
    n = len(next(iter(groups)))
    split = [a for a in _AXES if sizes.get(a, 1) > 1]
    shape = ",".join(f"'{a}'={sizes.get(a, 1)}" for a in _AXES)
    for r in range(len(split) + 1):
        for subset in _subsets(split, r):
            text = f"mesh[{shape}] {{{','.join(repr(a) for a in subset)}}}"
            if hlo._mesh_groups(text) == groups:
                return tuple(subset), n
    return ("?",), n


def _subsets(items, r):
    if r == 0:
        yield ()
        return
    for i, x in enumerate(items):
        for rest in _subsets(items[i + 1 :], r - 1):
            yield (x, *rest)


class _Collectives(step_cost.Module):
    """`step_cost.Module` whose kernels are the collectives: kind `op@axes`, bytes the
    bytes one device receives (`received`)."""

    def __init__(self, text: str, sizes: dict[str, int]):
        super().__init__(text)
        self.sizes = sizes

    def leaf(self, instr, types, total) -> None:
        if instr.op == "async-start":  # an async collective: its computation holds it
            body = self.comps.get(step_cost.callee(instr, "calls"), [])
            for inner in body:
                self.leaf(inner, self.types(step_cost.callee(instr, "calls")), total)
            return
        op = instr.op.removesuffix("-start")
        if op not in hlo.COLLECTIVES or instr.op.endswith(_ASYNC_DONE):
            return
        operand = sum(_operand_bytes(instr, types))
        groups = hlo._GROUPS.search(instr.line)
        if groups is None:  # a collective permute: source-target pairs
            pairs = re.findall(r"\{(\d+),(\d+)\}", instr.line.split("source_target_pairs=")[-1])
            if all(a == b for a, b in pairs):  # to itself (a mesh axis of size 1)
                return
            axes, n = ("stage",), 2
        else:
            axes, n = axes_of(hlo._parse_groups(groups[1]), self.sizes)
        total.kernel(f"{op}@{'+'.join(axes)}", received(op, operand, n), 0.0)


def _operand_bytes(instr, types: dict[str, str]):
    """Each operand's bytes: a `%name#i` operand is element i of a tuple's."""
    start = instr.line.index(instr.op + "(") + len(instr.op)
    args = instr.line[start + 1 : step_cost._closing(instr.line, start) - 1]
    for name, index in re.findall(r"%([\w.\-]+)(?:#(\d+))?", args):
        text = types.get(name, "")
        yield step_cost.size_of(_elements(text)[int(index)] if index else text)


def _elements(tuple_type: str) -> list[str]:
    """The element types of a tuple type `(a, b, ...)`."""
    out, depth, start = [], 0, 1
    for i, ch in enumerate(tuple_type):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
        if (ch == "," and depth == 1) or depth == 0:
            out.append(tuple_type[start:i].strip())
            start = i + 1
        if depth == 0:
            break
    return out


def measured(text: str, sizes: dict[str, int], microbatches: int = 1, segments: int = 1):
    """{'op@axes': bytes received per device per step} of an optimized HLO module."""
    units = step_cost.Units(microbatches, segments) if microbatches > 1 or segments > 1 else None
    cost = _Collectives(text, sizes).cost(units)
    return {kind: cost.total("bytes", kind) for kind in sorted({k[0] for k in cost.kernels})}


def analytic(spec, rows: int, grad_bytes: int) -> dict[str, float]:
    """Bytes one device receives over `context` per step: the K/V all-gathers and the
    cotangents' reduce-scatters of `spec`'s units (`rows` rows per micro-batch, the
    busiest stage's layers), and the gradients' all-reduce (`grad_bytes` on a device)."""
    c, cfg = spec.context, spec.cfg
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[cfg.dtype]
    position = rows * cfg.kv_heads * cfg.head_dim * itemsize  # one of K or V, one position
    layers = max(sum(spec.layers_per_chunk[r :: spec.stages]) for r in range(spec.stages))
    seen = 0  # P_k + L_k
    keys = 0  # of every segment: the positions its attention sees
    for length in spec.sequence_lengths:
        seen += length
        keys += seen
    gather = spec.schedule.microbatches * layers * 2 * keys * (c - 1) / c * position
    forward, backward = GATHERS[spec.remat]
    return {
        "all-gather": (forward + backward) * gather,
        "reduce-scatter": gather,
        "all-reduce": 2 * (c - 1) / c * grad_bytes,
    }


def grad_bytes(spec) -> int:
    """Bytes of a device's gradients (the parameters' dtype), tensor 1: the stage's
    layer block (V chunks of the deepest chunk's layers) and the shared parameters."""
    import jax

    from seqpipe.models import model

    params = jax.eval_shape(lambda: model.init_params(spec.cfg, jax.random.key(0)))
    block = spec.virtual * spec.chunk_layers
    out = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        size = math.prod(leaf.shape) * leaf.dtype.itemsize
        out += size // leaf.shape[0] * block if path[0].key == "layers" else size
    return out


def main(argv: list[str]) -> int:
    from seqpipe.pipeline import spec as spec_lib
    from seqpipe.run import cli

    def flags(parser):
        parser.add_argument("--hlo", required=True, help="the step's optimized HLO dump")

    prog = "python scripts/context_bytes.py"
    config, args = cli.load_or_exit(argv, prog, flags)
    config = cli.resolve_or_exit(config)
    sizes = {a: config.mesh.get(a, 1) for a in _AXES}
    if sizes["tensor"] > 1:
        cli.fail("context_bytes counts the gradients of mesh.tensor=1 only")
    try:
        text = open(args.hlo).read()
    except OSError as e:
        cli.fail(f"context_bytes: cannot read {args.hlo} ({e.strerror})")
    p = config.pipeline
    spec = spec_lib.make_spec(config)
    rows = config.train.global_batch_size // (sizes["data"] * p.microbatches)
    if " while(" in text and '"known_trip_count"' not in text:
        print(
            "context_bytes: the loops carry no known trip count (a TPU compile's HLO does not "
            "say it): each counts once, so the measured column falls short; read a GPU "
            "compile's HLO (--topology h200-N)",
            file=sys.stderr,
        )
    got = measured(text, sizes, p.microbatches, p.segments)
    want = analytic(spec, rows, grad_bytes(spec))
    print(f"{'per device, GB (1e9 B)':<26} {'measured':>10} {'analytic':>10}")
    for op in ("all-gather", "reduce-scatter", "all-reduce"):
        mine = sum(b for k, b in got.items() if k.split("@")[0] == op and "context" in k)
        print(f"{op + ' over context':<26} {mine / 1e9:>10.3f} {want[op] / 1e9:>10.3f}")
    mine = sum(b for k, b in got.items() if "context" in k.split("@")[1])
    print(f"{'all over context':<26} {mine / 1e9:>10.3f} {sum(want.values()) / 1e9:>10.3f}")
    for kind, b in got.items():  # the other axes', for comparison
        if "context" not in kind.split("@")[1]:
            print(f"{kind:<26} {b / 1e9:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
