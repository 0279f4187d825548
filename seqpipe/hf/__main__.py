"""`python -m seqpipe.hf export`: a run's checkpoint as a HuggingFace model directory.

    python -m seqpipe.hf export --workdir W [--step N] [--dtype bfloat16] --out DIR

Writes config.json (rope settings in transformers 5's and 4.x's keys), the weights as
safetensors (shards of at most 5 GB with their index above that) and the run's
tokenizer.json when it has one; `transformers.AutoModelForCausalLM.from_pretrained(DIR)`
loads it. The checkpoint is read as resume reads it, checked against its checksums: a
damaged newest step is skipped for the newest intact one, saying so. DIR appears only once
complete; bad input is one line, exit 2, nothing written.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import jax

from seqpipe.hf import weights
from seqpipe.hf.config import HFError
from seqpipe.host import checkpoint_dir, directories
from seqpipe.models import model
from seqpipe.models.model import GPTConfig
from seqpipe.run import cli
from seqpipe.train import checkpoint

DTYPES = ("float32", "bfloat16", "float16")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = cli._Parser(prog="python -m seqpipe.hf")
    parser.usage_line = "export --workdir W [--step N] [--dtype D] --out DIR"
    parser.add_argument("command", choices=("export",))
    parser.add_argument("--workdir", required=True, help="the run's directory")
    parser.add_argument("--step", type=int, default=None, help="its checkpoint (default newest)")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="default: the run's")
    parser.add_argument("--out", required=True, help="a new directory")
    return parser.parse_args(argv)


def _steps(workdir: str, step: int | None) -> tuple[Path, list[int]]:
    """The checkpoint directory and the steps to try, newest first (only `step` if given)."""
    directory = checkpoint_dir.directory(workdir)
    steps = checkpoint_dir.complete_steps(directory)
    if not steps:
        raise HFError(f"--workdir {workdir} holds no checkpoint ({directory} has none)")
    if step is not None and step not in steps:
        raise HFError(f"--step {step}: {directory} holds steps {steps}")
    return directory, [step] if step is not None else steps[::-1]


def _abstract_params(meta: dict):
    """The shape structs of the parameters the run's meta describes, on the first device."""
    cfg = GPTConfig.from_config(meta["model"])
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), shapes)


def read_intact(workdir: str, step: int | None) -> tuple[Path, dict, model.Params]:
    """(step directory, meta, parameters) of the newest intact checkpoint (or of `step`),
    checked against its checksums as resume checks them. A damaged step is skipped with a
    line that says so, or, when it was asked for by --step, refused."""
    directory, steps = _steps(workdir, step)
    damaged = []
    for s in steps:
        try:
            meta, params = checkpoint.read_params(directory / str(s), _abstract_params)
        except checkpoint.Damaged as e:
            damaged.append(f"{s} ({e})")
            continue
        if damaged:
            print(
                f"warning: checkpoint step {', '.join(damaged)} in {directory} is damaged; "
                f"exporting step {s}, the newest intact one",
                file=sys.stderr,
                flush=True,
            )
        return directory / str(s), meta, params
    if step is not None:
        raise HFError(
            f"--step {damaged[0]} in {directory} is damaged; export another step "
            f"(it holds {checkpoint_dir.complete_steps(directory)})"
        )
    raise HFError(f"no checkpoint in {directory} is intact: step {', '.join(damaged)}")


def export(workdir: str, step: int | None, out: str, dtype: str | None) -> Path:
    directories.check(out)  # before the checkpoint is read
    step_dir, meta, params = read_intact(workdir, step)
    cfg = GPTConfig.from_config(meta["model"])
    seq_len = int(meta.get("data", {}).get("seq_len", 0))
    tokenizer = Path(workdir) / "tokenizer.json"

    def fill(scratch: Path) -> None:
        weights.save(scratch, cfg, params, dtype, context=seq_len)
        if tokenizer.is_file():
            shutil.copyfile(tokenizer, scratch / "tokenizer.json")

    directories.write_new(out, fill, last="config.json")
    return step_dir


def main(argv: list[str]) -> int:
    args = parse(argv)
    cli.quiet_libtpu()
    try:
        step_dir = export(args.workdir, args.step, args.out, args.dtype)
    except (HFError, directories.OutputError) as e:
        cli.fail(str(e))
    files = sorted(p.name for p in Path(args.out).iterdir())
    print(f"exported {step_dir} to {args.out}: {', '.join(files)}")
    print(json.dumps({"out": args.out, "files": files}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
