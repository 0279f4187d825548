"""Command-line plumbing shared by train.py and the seqpipe.* tools.

Bad input ends the program with one line on stderr and exit code 2: no traceback,
nothing written. jax is not imported here, so the CPU device count can still be set.
"""

import argparse
import os
import sys
from collections.abc import Callable
from typing import TypeVar

from seqpipe import config as config_lib

T = TypeVar("T")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, not a usage dump
        self.exit(2, f"error: {message}; usage: {self.prog} --config FILE [--workdir DIR] "
                     "[--config.key=value ...]\n")


def fake_cpu_devices(count: int) -> None:
    """Give the CPU backend as many devices as the mesh needs, before jax is imported.

    Harmless on GPU and TPU, whose own devices are used; on CPU it lets a real
    multi-device mesh run on one machine.
    """
    flag = "--xla_force_host_platform_device_count"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={count}".strip()


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def load_or_exit(argv: list[str], prog: str, add_flags: Callable | None = None):
    """Parse `--config FILE [--workdir DIR] [--config.a.b=v ...]`; returns (config, args)."""
    parser = _Parser(prog=prog)
    parser.add_argument("--config", required=True, help="config file, or a name in configs/")
    parser.add_argument("--workdir", default=None, help="output directory (default runs/NAME)")
    if add_flags:
        add_flags(parser)
    args, rest = parser.parse_known_args(argv)
    try:
        config = config_lib.load(args.config, config_lib.parse_overrides(rest))
        args.workdir = args.workdir or f"runs/{config_lib.resolve_path(args.config).stem}"
    except config_lib.ConfigError as e:
        fail(str(e))
    fake_cpu_devices(config.mesh.data * config.mesh.stage)
    return config, args


def run_or_exit(fn: Callable[[], T]) -> T:
    """Run fn; a config or data error becomes one line on stderr and exit code 2."""
    from seqpipe.data import DataError

    try:
        return fn()
    except (config_lib.ConfigError, DataError) as e:
        fail(str(e))
