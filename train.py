"""Train a GPT with seqpipe: python train.py --config configs/tiny.py --workdir runs/demo."""

import argparse
import os
import sys


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2, no usage dump
        sys.exit(f"error: {message}; usage: train.py --config FILE [--workdir DIR] "
                 "[--config.key=value ...]")


def _fake_cpu_devices(count: int) -> None:
    """Give the CPU backend as many devices as the mesh needs (before jax is imported).

    Harmless on GPU/TPU, whose devices are used instead; on CPU it lets the demo run
    a real multi-device mesh."""
    flag = "--xla_force_host_platform_device_count"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={count}".strip()


def main(argv: list[str]) -> int:
    parser = _Parser(description=__doc__)
    parser.add_argument("--config", required=True, help="config file, or a name in configs/")
    parser.add_argument("--workdir", default=None, help="output directory (default runs/NAME)")
    args, rest = parser.parse_known_args(argv)

    from seqpipe import config as config_lib
    from seqpipe.data import DataError

    try:
        config = config_lib.load(args.config, config_lib.parse_overrides(rest))
    except config_lib.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    workdir = args.workdir or f"runs/{config_lib.resolve_path(args.config).stem}"
    _fake_cpu_devices(config.mesh.data * config.mesh.stage)

    from seqpipe import train

    try:
        train.prepare_workdir(workdir)
        train.run(config, workdir)
    except (config_lib.ConfigError, DataError, train.TrainingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if not isinstance(e, train.TrainingError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
