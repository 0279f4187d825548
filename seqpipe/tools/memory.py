"""Per-device memory of the compiled pipelined step: XLA's figures against the carry.

    python -m seqpipe.tools.memory --config CONFIG [--config.key=value ...]
        [--schedules 1f1b,seq1f1b:2,seq1f1b:4,seq1f1b:8] [--depths full,minimal]
        [--json FILE] [--no-unit]

`step_memory(config)` compiles `executor.loss_and_grads` for the configured mesh from
abstract shapes (nothing is allocated) and returns XLA's `memory_analysis()` (temporary,
argument, output, alias and generated-code bytes; per device, since the SPMD module is
the per-device program) next to an analytic breakdown of the scan carry computed from the
lowered schedule (`schedule.Program`) and the shapes the executor uses:

  stash      max(num_stash, 1) x [b, Lseg, D]              inputs kept for the backward
                                                              (remat `full`)
  res        per segment k, max(num_res[k], 1) x its body's residuals (other policies)
  head       per segment k, max(num_head[k], 1) x [b, L_k, D]    the head's dy, computed
                                                              in the last chunk's forward
  messages   (max(num_recv_fwd, 1) + max(num_recv_bwd, 1)) x [b, Lseg, D]
  kv         2 x max(num_kv, 1) x [n, b, Lkv, H, E]          kv_k + kv_v
  dkv        2 x max(num_dkv, 1) x [n, b, Lkv, H, E]         dkv_k + dkv_v
  grads      the stage's layer gradients + the replicated shared ones (param dtype)

b rows per micro-batch, Lseg the longest segment, Lkv the cached prefix (`spec.kv_len`: no
segment reads the last one's K/V, so 0 for K = 1), n layers per model chunk (num_kv and
num_dkv count (micro-batch, chunk) pairs), D model width, H heads of width E. With
mesh.context = C > 1, Lseg and Lkv are one context device's positions (1/C of the
sequence's, `seqpipe.parallel.context`); `seq_len` stays the sequence's.
`temp - carry` is what XLA needs beyond the carry: mostly the working set of one unit's
recomputed forward and its vjp
(attention probabilities of every layer of the chunk for one segment, logits on the last
stage; `unit`), plus any copies of carry buffers it makes (`excess`, `loop_copies`).
See docs/long-context.md for what a unit keeps and what it costs.
"""

from __future__ import annotations

import json
import math
import re
import sys

import numpy as np

from seqpipe import schedule
from seqpipe.run import cli
from seqpipe.run import config as config_lib
from seqpipe.targets import hlo

DEFAULT_SCHEDULES = "1f1b,seq1f1b:2,seq1f1b:4,seq1f1b:8"


def residual_bytes(spec, rows: int) -> int:
    """Bytes of the per-segment residual stashes (remat other than `full`; else 0)."""
    from seqpipe.pipeline import carry as carry_lib  # jax: after main() sets the XLA flags

    return carry_lib.breakdown(spec, rows)["res"]


def _param_counts(cfg) -> tuple[int, int]:
    """(shared, layer) parameter counts, from abstract shapes."""
    import jax  # after main() sets the XLA flags

    from seqpipe.models import model  # jax: after main() sets the XLA flags

    shapes = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    layers = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes["layers"]))
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    return total - layers, layers


def abstract_step(config):
    """(spec, step, params, tokens): the jitted pipelined loss-and-gradients step and
    abstract inputs, sharded as in training (layers in stage order split over `stage`,
    the rest replicated, the batch split over `data`). Nothing is allocated."""
    import jax  # after main() sets the XLA flags
    from jax.sharding import NamedSharding  # after main() sets the XLA flags
    from jax.sharding import PartitionSpec as P  # after main() sets the XLA flags

    from seqpipe.models import model
    from seqpipe.parallel import (
        layout,
        sharding,  # jax: after main() sets the XLA flags
    )
    from seqpipe.pipeline import executor

    spec = executor.make_spec(config)
    mesh = sharding.mesh_of(config)
    shapes = jax.eval_shape(
        lambda: layout.to_stage_order(
            model.init_params(spec.cfg, jax.random.key(0)), spec.placement
        )
    )

    def place(path, x):
        part = NamedSharding(mesh, P(sharding.STAGE) if sharding.in_layers(path) else P())
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=part)

    params = jax.tree_util.tree_map_with_path(place, shapes)
    tokens = jax.ShapeDtypeStruct(
        (config.train.global_batch_size, config.train.seq_len + 1),
        np.int32,
        sharding=sharding.batch_sharding(mesh),
    )
    step = jax.jit(lambda p, t: executor.loss_and_grads(p, t, spec, mesh))
    return spec, step, params, tokens


def compile_step(config):
    """(spec, compiled) for the pipelined step, from abstract inputs."""
    spec, step, params, tokens = abstract_step(config)
    return spec, step.lower(params, tokens).compile()


def carry_avals(config) -> list:
    """Per-device shapes of the tick loop's carry, read from the step's jaxpr: the
    outermost `scan` (breadth first), whose carry is the executor's state."""
    import jax  # after main() sets the XLA flags

    from seqpipe.targets import compat  # jax: after main() sets the XLA flags

    _, step, params, tokens = abstract_step(config)
    todo = [jax.make_jaxpr(step)(params, tokens).jaxpr]
    while todo:
        jaxpr = todo.pop(0)
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan":
                return [v.aval for v in compat.scan_carry(eqn)]
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        todo.append(inner)
    raise ValueError("no scan in the pipelined step")


def loop_copies(hlo_text: str, shapes) -> int:
    """`copy` instructions inside the compiled while loop (its body and everything it
    calls) whose result has one of `shapes`: XLA copying a whole carry buffer per tick."""
    comps = hlo.computations(hlo_text)
    inside = hlo.inside_loops(comps)
    wanted = {tuple(s) for s in shapes}
    count = 0
    for name in inside:
        for dims in re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} copy\(", comps[name]):
            count += tuple(int(d) for d in dims.split(",") if d) in wanted
    return count


def unit_temp_bytes(spec, rows: int, seg: int) -> int:
    """XLA temp bytes of one unit's working set alone: its backward (under `full` remat the
    recomputed body and its vjp, else the body's vjp rebuilt from stashed residuals) or,
    if larger, the last chunk's head with its backward, which runs in the forward.

    From abstract inputs on one device (n layers, the embedding behind a run-time flag, as
    in the executor): the stashed input (or residuals), the K/V prefix and the cotangents
    are arguments here, so this is what the step needs on top of its carry.
    """
    import jax  # after main() sets the XLA flags
    import jax.numpy as jnp  # after main() sets the XLA flags

    from seqpipe.parallel import sharding  # jax: after main() sets the XLA flags
    from seqpipe.pipeline import units

    unit = units.SegmentUnit(spec, seg)
    chunk, shared, x_in, prefix, _, tok, _ = unit.avals(rows)
    own = unit.kv_avals(rows)

    def backward(saved, p, sh, k, v, tokens, first, dy, dk, dv):
        inputs = units.UnitInputs(p, sh, None, k, v, tokens, first)
        return unit.backward(inputs, saved, (dy, dk, dv))

    flag = jax.ShapeDtypeStruct((), jnp.bool_)
    args = (unit.saved_avals(rows), chunk, shared, prefix, prefix, tok, flag, x_in, own, own)

    def compiled(fn, a):  # on a stage's tensor and context devices: its collectives bound
        fn = sharding.bound(fn, spec.tensor, spec.context, jax.devices(), spec.cfg.expert_parallel)
        return jax.jit(fn).lower(*a).compile()

    return max(
        int(compiled(fn, a).memory_analysis().temp_size_in_bytes)
        for fn, a in ((backward, args), (unit.head, (shared, x_in, tok)))
    )


def step_memory(config, unit: bool = True) -> dict:
    """XLA's per-device memory of the compiled step and the analytic carry breakdown.

    Returns a flat dict: schedule, segments (K), depth, stages, microbatches, rows,
    seq_len; the schedule's stage-0 bound (`stash_units`: units held between forward and
    backward; `stash_microbatches`: the same in whole micro-batches of activations); the
    Program's slot counts; XLA's `temp`, `argument`, `output`, `alias`, `code` bytes; the
    carry's `stash`, `messages`, `kv`, `dkv`, `grads`, `carry` bytes; `loop_copies`, the
    copies XLA makes of the stash and K/V buffers inside the tick loop. With `unit`, also
    `unit`, the temp bytes of the largest backward unit compiled alone
    (`unit_temp_bytes`), and `excess = temp - carry - unit`, what XLA holds beyond both
    (copies of carry buffers, overlapping lifetimes).
    """
    from seqpipe.pipeline import carry as carry_lib  # jax: after main() sets the XLA flags

    spec, compiled = compile_step(config)
    rows = config.train.global_batch_size // (config.mesh.data * config.pipeline.microbatches)
    st = schedule.stats(spec.schedule, lengths=spec.lengths)
    prog = spec.program
    ma = compiled.memory_analysis()
    out = {
        "schedule": spec.schedule.name,
        "remat": spec.remat,
        "segments": spec.schedule.segments,
        "depth": str(spec.schedule.inflight),
        "stages": spec.stages,
        "microbatches": spec.schedule.microbatches,
        "rows": rows,
        "context": spec.context,
        "seq_len": sum(spec.sequence_lengths),  # a context device holds 1/context of it
        "stash_units": st["inflight_peak"][0],
        "stash_microbatches": st["activation_fraction"][0],
        "num_stash": prog.num_stash,
        "num_kv": prog.num_kv,
        "num_dkv": prog.num_dkv,
        "num_recv_fwd": prog.num_recv_fwd,
        "num_recv_bwd": prog.num_recv_bwd,
        "temp": int(ma.temp_size_in_bytes),
        "argument": int(ma.argument_size_in_bytes),
        "output": int(ma.output_size_in_bytes),
        "alias": int(ma.alias_size_in_bytes),
        "code": int(ma.generated_code_size_in_bytes),
        **carry_lib.breakdown(spec, rows),
    }
    cfg, prog = spec.cfg, spec.program
    n = cfg.num_layers // (spec.stages * spec.virtual)
    big = [
        (max(prog.num_stash, 1), rows, max(spec.lengths), cfg.d_model),
        (max(prog.num_kv, 1), n, rows, spec.kv_len, cfg.local_kv_heads, cfg.head_dim),
    ]
    out["loop_copies"] = loop_copies(compiled.as_text(), big)
    if unit:
        # The largest working set: the longest segment, or the one with the longest prefix.
        segs = {spec.lengths.index(max(spec.lengths)), len(spec.lengths) - 1}
        out["unit"] = max(unit_temp_bytes(spec, rows, k) for k in segs)
        out["excess"] = out["temp"] - out["carry"] - out["unit"]
    return out


def with_schedule(config, name: str, segments: int, depth: str | int):
    """A copy of `config` with another schedule, segment count and depth."""
    c = config.copy_and_resolve_references()
    with c.unlocked():
        c.pipeline.schedule = name
        c.pipeline.segments = segments
        c.pipeline.inflight = depth
    config_lib.validate(c)
    return c


def parse_schedules(text: str) -> list[tuple[str, int]]:
    """'1f1b,seq1f1b:4' -> [('1f1b', 1), ('seq1f1b', 4)]; a bare seq1f1b keeps K from config."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, k = item.partition(":")
        if k and not k.isdigit():
            raise ValueError(f"--schedules: {item!r}: K must be a positive integer")
        out.append((name, int(k) if k else 0))
    if not out:
        raise ValueError("--schedules is empty")
    return out


def _default_k(config, name: str) -> int:
    gen = schedule.GENERATORS.get(name)
    return config.pipeline.segments if gen and gen.granularity == "segment" else 1


def _mib(x: int) -> str:
    return f"{x / 2**20:.2f}"


def table(rows: list[dict]) -> str:
    """Markdown: one row per (depth, schedule, K), bytes in MiB, ratios to 1f1b's row."""
    head = (
        "| schedule | K | depth | stage-0 bound, units (micro-batches) | bound / 1f1b | "
        "XLA temp MiB | temp / 1f1b | stash MiB (inputs or residuals) | KV MiB | dKV MiB | "
        "KV+dKV % of temp | "
        "grads MiB | carry MiB | unit MiB | excess MiB | loop copies |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    base = {r["depth"]: r for r in rows if r["schedule"] == "1f1b"}

    def ratio(r, key):
        b = base.get(r["depth"])
        return f"{r[key] / b[key]:.2f}" if b else "-"

    for r in rows:
        lines.append(
            f"| {r['schedule']} | {r['segments']} | {r['depth']} | {r['stash_units']} "
            f"({r['stash_microbatches']:g}) | {ratio(r, 'stash_microbatches')} | "
            f"{_mib(r['temp'])} | {ratio(r, 'temp')} | {_mib(r['stash'] + r['res'])} | "
            f"{_mib(r['kv'])} | {_mib(r['dkv'])} | "
            f"{100 * (r['kv'] + r['dkv']) / r['temp']:.0f}% | {_mib(r['grads'])} | "
            f"{_mib(r['carry'])} | {_mib(r['unit']) if 'unit' in r else '-'} | "
            f"{_mib(r['excess']) if 'excess' in r else '-'} | {r['loop_copies']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    def flags(parser):
        parser.add_argument("--schedules", default=DEFAULT_SCHEDULES)
        parser.add_argument("--depths", default=None, help="e.g. full,minimal (default: config)")
        parser.add_argument("--json", default=None, help="also write the rows as JSON here")
        parser.add_argument(
            "--no-unit", action="store_true", help="skip compiling the single-unit working set"
        )

    config, args = cli.load_or_exit(argv, "python -m seqpipe.tools.memory", flags)
    cli.quiet_libtpu()
    config = cli.resolve_or_exit(config)  # a mesh axis at -1 gets its size

    try:
        items = parse_schedules(args.schedules)
        depths = (
            [config.pipeline.inflight]
            if args.depths is None
            else [int(d) if d.isdigit() else d for d in args.depths.split(",") if d]
        )
        configs = [
            with_schedule(config, name, k or _default_k(config, name), depth)
            for depth in depths
            for name, k in items
        ]
    except (ValueError, config_lib.ConfigError) as e:
        cli.fail(str(e))
    rows = []
    for c in configs:
        rows.append(step_memory(c, unit=not args.no_unit))
        print(
            f"# compiled {c.pipeline.schedule} K={c.pipeline.segments} "
            f"depth={c.pipeline.inflight}: temp {_mib(rows[-1]['temp'])} MiB",
            file=sys.stderr,
            flush=True,
        )
    sys.stdout.write(table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
