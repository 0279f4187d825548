"""Train a GPT with seqpipe: python train.py --config configs/tiny.py --workdir runs/demo."""

import sys

from seqpipe import cli


def main(argv: list[str]) -> int:
    config, args = cli.load_or_exit(argv, "train.py")
    from seqpipe import train  # imports jax: only after the device count is set

    try:
        cli.run_or_exit(lambda: train.run(config, args.workdir))
    except train.TrainingError as e:
        cli.fail(str(e), code=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
