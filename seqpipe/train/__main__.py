"""`python -m seqpipe.train`: the trainer's command. `python train.py` and the console
script `seqpipe-train` run it too; an installed package has the last two.

`train.py` names the flags. `entry` installs the signal handlers (`seqpipe.host.signals`)
before anything heavy is imported, so a signal at any moment of the start-up is one line.
"""

import json
import sys

from seqpipe.host import signals


def _mesh_text(mesh: dict) -> str:
    """data x stage, and x tensor where it splits, then the context axis where it splits:
    "2x4", "1x8x8", "1x2, context 4"."""
    sizes = [mesh["data"], mesh["stage"]] + ([mesh["tensor"]] if mesh["tensor"] > 1 else [])
    context = mesh.get("context", 1)
    return "x".join(map(str, sizes)) + (f", context {context}" if context > 1 else "")


def summary(result: dict, target=None) -> str:
    """The --compile_only report in one line (the JSON follows it); `target` is the TPU
    slice or GPU system compiled for (`seqpipe.targets.topology.parse`), if any."""
    mem = result["memory_per_device_bytes"]
    gib = lambda key: f"{mem[key] / 2**30:.2f}"
    where = "per device"
    if target is not None:
        where = f"{target.headline()}, mesh {_mesh_text(result['mesh'])}; per {target.unit}"
    line = (
        f"{where}: arguments {gib('arguments')} GiB, outputs {gib('outputs')} GiB (aliased "
        f"{gib('aliased')}), temporaries {gib('temporaries')} GiB; evaluation temporaries "
        f"{result['eval_memory_per_device_bytes']['temporaries'] / 2**30:.2f} GiB"
    )
    if target is not None:
        verdict = "fits" if result["fits"] else "DOES NOT FIT"
        line += (
            f"; peak {result['peak_memory_per_device_bytes'] / 2**30:.2f} of "
            f"{result['hbm_per_chip_bytes'] / 2**30:.0f} GiB HBM "
            f"({100 * result['hbm_fraction']:.0f}%, {verdict})"
        )
    counts = ", ".join(f"{k} {v}" for k, v in result["collectives"].items())
    remat = f"{result['remat']}{' (auto)' if 'remat_auto' in result else ''}"
    attention = f"{result['attention']} attention"
    if "attention_auto" in result:  # chosen by fitting the step: say why
        attention += f" ({result['attention_auto']['line']})"
    return (
        f"{line}; {attention}; remat {remat}; "
        f"{result['flops_per_step']:.3e} model FLOPs per step; collectives: {counts}"
    )


def main(argv: list[str], prog: str = "train.py") -> int:
    """Train, or with --compile_only report the compiled step; `prog` names the command in
    its usage line. Imports here: `entry` installs the signal handlers before any of them."""
    from seqpipe.errors import TrainingError
    from seqpipe.run import cli
    from seqpipe.targets import xla_flags

    config, args = cli.load_or_exit(argv, prog, cli.train_flags, auto_remat=True)
    target = cli.target_or_exit(args)  # before jax is imported
    if target is None:
        cli.quiet_libtpu()
        xla_flags.apply()  # GPU only, before the backend starts; the user's flags win
        cli.init_distributed(args)  # imports jax: only after the device count is set
    else:
        config = cli.resolve_or_exit(config, target.chips, target)
    from seqpipe.train import aot, trainer

    if args.compile_only:
        import jax

        try:
            if target is None:
                run = cli.run_or_exit(lambda: aot.resolve(config))
            else:
                from seqpipe.targets import topology

                try:
                    devices = target.devices()
                except topology.TopologyError as e:
                    cli.fail(str(e))
                run = cli.run_or_exit(lambda: aot.resolve(config, devices, target.budget()))
            result = aot.compile_only(run)
        except jax.errors.JaxRuntimeError as e:  # the compiler's verdict, not a crash
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            cli.fail(f"does not fit: {str(e).splitlines()[0]}", code=1)
        if target is not None:
            result.update(target.report(result["peak_memory_per_device_bytes"]))
        print(summary(result, target))
        print(json.dumps(result))
        return 0 if result.get("fits", True) else 1
    from seqpipe.train import checkpoint

    kept = f"the checkpoints in {checkpoint.directory(args.workdir)} are as they were"
    signals.set_context("before training", f"{kept}; run again to resume")
    try:
        cli.run_or_exit(lambda: trainer.run(config, args.workdir))
    except TrainingError as e:
        # Every file is closed by now; what orbax's threads print on the way out would bury
        # the one line that says what to do.
        cli.fail(str(e), code=1, at_once=True)
    return 0


def entry(prog: str = "seqpipe-train") -> int:
    """The command line's run: the signal handlers first, then `main` on `sys.argv`."""
    signals.install()
    return main(sys.argv[1:], prog)


if __name__ == "__main__":
    sys.exit(entry("python -m seqpipe.train"))
