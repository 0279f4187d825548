"""`python -m seqpipe.hf export`: a run's checkpoint as a HuggingFace model directory.

    python -m seqpipe.hf export --workdir W [--step N] [--dtype bfloat16] --out DIR

Writes config.json (rope settings in transformers 5's and 4.x's keys), the weights as
safetensors (shards of at most 5 GB with their index above that) and the run's
tokenizer.json when it has one; `transformers.AutoModelForCausalLM.from_pretrained(DIR)`
loads it. DIR appears only once complete; bad input is one line, exit 2, nothing written.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from seqpipe.hf import weights
from seqpipe.hf.config import HFError
from seqpipe.host import checkpoint_dir
from seqpipe.models import model
from seqpipe.models.model import GPTConfig
from seqpipe.run import cli

DTYPES = ("float32", "bfloat16", "float16")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(
            2,
            f"error: {message}; usage: python -m seqpipe.hf export --workdir W [--step N] "
            "[--dtype D] --out DIR\n",
        )


def parse(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="python -m seqpipe.hf")
    parser.add_argument("command", choices=("export",))
    parser.add_argument("--workdir", required=True, help="the run's directory")
    parser.add_argument("--step", type=int, default=None, help="its checkpoint (default newest)")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="default: the run's")
    parser.add_argument("--out", required=True, help="a new directory")
    return parser.parse_args(argv)


def pick_step(workdir: str, step: int | None) -> Path:
    """The step directory to export; HFError naming what there is if it is not there."""
    directory = checkpoint_dir.directory(workdir)
    steps = checkpoint_dir.complete_steps(directory) if directory.is_dir() else []
    if not steps:
        raise HFError(f"--workdir {workdir} holds no checkpoint ({directory} has none)")
    chosen = max(steps) if step is None else step
    if chosen not in steps:
        raise HFError(f"--step {step}: {directory} holds steps {sorted(steps)}")
    return directory / str(chosen)


def restore_params(step_dir: Path):
    """(model config, run meta, parameters on this process's first device) of a step."""
    meta = ocp.JsonCheckpointHandler().restore(step_dir / "meta", args=ocp.args.JsonRestore())
    cfg = GPTConfig.from_config(meta["model"])
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    item = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), shapes)}
    restore_args = ocp.checkpoint_utils.construct_restore_args(
        item, jax.tree.map(lambda _: device, item)
    )
    handler = ocp.PyTreeCheckpointHandler()
    try:
        args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
        state = handler.restore(step_dir / "state", args=args)
    finally:
        handler.close()
    return cfg, meta, state["params"]


def export(workdir: str, step: int | None, out: str, dtype: str | None) -> Path:
    step_dir = pick_step(workdir, step)
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise HFError(f"--out {target} exists and is not empty; give a new directory")
    cfg, meta, params = restore_params(step_dir)
    seq_len = int(meta.get("data", {}).get("seq_len", 0))
    tokenizer = Path(workdir) / "tokenizer.json"

    def fill(scratch: Path) -> None:
        weights.save(scratch, cfg, params, dtype, context=seq_len)
        if tokenizer.is_file():
            shutil.copyfile(tokenizer, scratch / "tokenizer.json")

    weights.write_new(out, fill)
    return step_dir


def main(argv: list[str]) -> int:
    args = parse(argv)
    cli.quiet_libtpu()
    try:
        step_dir = export(args.workdir, args.step, args.out, args.dtype)
    except HFError as e:
        cli.fail(str(e))
    files = sorted(p.name for p in Path(args.out).iterdir())
    print(f"exported {step_dir} to {args.out}: {', '.join(files)}")
    print(json.dumps({"out": args.out, "files": files}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
