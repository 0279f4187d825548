"""Command-line plumbing shared by train.py and the seqpipe.* tools.

Bad input ends the program with one line on stderr and exit code 2: no traceback,
nothing written. jax is not imported here, so the CPU device count can still be set.
"""

import argparse
import glob
import math
import os
import sys
from collections.abc import Callable
from typing import TypeVar

from seqpipe.errors import DataError, RestoreError
from seqpipe.hf.config import HFError
from seqpipe.host import logs, peers, runtime_log
from seqpipe.host.workdir import WorkdirError
from seqpipe.run import config as config_lib
from seqpipe.targets import topology

T = TypeVar("T")


class Refused(SystemExit):
    """The exit of a one-line refusal, carrying its line (less `error: `) for a command
    that also reports it elsewhere (`--json`'s last line)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(code)
        self.message = message


class _Parser(argparse.ArgumentParser):
    usage_line = "--config FILE [--workdir DIR] [--config.key=value ...]"

    def error(self, message):  # one line and exit code 2, not a usage dump
        fail(f"{message}; usage: {self.prog} {self.usage_line}")


def fake_cpu_devices(count: int) -> None:
    """Give the CPU backend as many devices as the mesh needs, before jax is imported.

    Harmless on GPU and TPU, whose own devices are used; on CPU it lets a real
    multi-device mesh run on one machine.
    """
    flag = "--xla_force_host_platform_device_count"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={count}".strip()


def quiet_libtpu() -> None:
    """On a machine with no TPU, keep libtpu (installed with the dev extras, to compile for
    TPU slices) from printing half a dozen errors while jax starts: it reads the TPU's type
    and hosts from the environment before probing, finds nothing, and jax falls back to the
    other backends as it would anyway. A TPU VM has /dev/accel* or /dev/vfio and keeps its
    own settings. Call before jax is imported."""
    if glob.glob("/dev/accel*") or os.path.exists("/dev/vfio"):
        return
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")  # any known type: it finds no chip
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")  # one host: no cluster


def fail(message: str, code: int = 2, at_once: bool = False) -> None:
    """Print `error: message` and exit. `at_once` is for a process whose background threads
    (orbax's, after a failed save) may still be printing: their stderr is silenced first,
    so the last line is this one, and the interpreter's shutdown is skipped."""
    if not at_once:
        print(f"error: {message}", file=sys.stderr, flush=True)
        raise Refused(message, code)
    runtime_log.exit_at_once(message, code)


def load_or_exit(
    argv: list[str], prog: str, add_flags: Callable | None = None, auto_remat: bool = False
):
    """Parse `--config FILE [--workdir DIR] [--config.a.b=v ...]`; returns (config, args).
    `pipeline.remat=auto` only where `auto_remat` (train.py): the tools measure the policy
    they are named."""
    parser = _Parser(prog=prog)
    parser.add_argument(
        "--config", required=True, help="config file, a name in configs/, or hf:DIR"
    )
    parser.add_argument("--workdir", default=None, help="output directory (default runs/NAME)")
    if add_flags:
        add_flags(parser)
    args, rest = parser.parse_known_args(argv)
    try:
        config = config_lib.load(args.config, config_lib.parse_overrides(rest))
        args.workdir = args.workdir or f"runs/{config_lib.run_name(args.config)}"
    except config_lib.ConfigError as e:
        fail(str(e))
    if config.pipeline.remat == "auto" and not auto_remat:
        fail(
            f"pipeline.remat=auto is chosen by train.py (a run or --compile_only); {prog} "
            "measures the policy it is given: name one of full, full_layer, layer, dots, none"
        )
    # On CPU the devices are made to fit the mesh: an axis at -1 gets 1.
    devices = math.prod(n for n in (config.mesh.data, config.mesh.stage) if n != -1)
    devices *= config.mesh.get("tensor", 1) * config.mesh.get("context", 1)
    processes = getattr(args, "num_processes", None) or 1
    if devices % processes:
        fail(f"--num_processes {processes} does not divide the mesh's {devices} devices")
    fake_cpu_devices(devices // processes)
    return config, args


def resolve_or_exit(config, num_devices: int | None = None, target=None):
    """The config with its mesh fitted to num_devices; a split that cannot fit is one line,
    exit 2, naming `target` (the --topology compiled for) when there is one. Without
    num_devices (the tools, which take the first devices their mesh needs) a mesh with no
    -1 is left as it is, and -1 takes all the devices jax sees (importing jax)."""
    if num_devices is None:
        if -1 not in (config.mesh.data, config.mesh.stage):
            return config
        import jax  # here, not above: cli is imported before the XLA flags are set

        num_devices = jax.device_count()
    try:
        return config_lib.resolve(config, num_devices)
    except config_lib.ConfigError as e:
        if target is None:
            fail(str(e))
        # The devices are the slice's (or GPU system's) chips, not this machine's.
        n, where = num_devices, f"--topology {target.headline()}"
        fail(
            str(e)
            .replace(f"{n} devices are visible", f"{where} has {n} {target.unit}s")
            .replace(f"the {n} visible devices", f"the {n} {target.unit}s of {where}")
        )


def target_or_exit(args: argparse.Namespace):
    """The TPU slice or GPU system of --topology (None without it), with the environment
    set for compiling for it: before jax is imported. A name that is not supported is one
    line."""
    if args.topology is None:
        return None
    if not args.compile_only:
        fail(f"--topology {args.topology} needs --compile_only: it compiles for it, here")
    if args.coordinator or args.num_processes or args.process_id is not None:
        fail("--topology compiles in one process; drop --coordinator/--num_processes/--process_id")
    try:
        target = topology.parse(args.topology)
    except ValueError as e:
        fail(str(e))
    target.prepare_env()
    return target


def train_flags(parser: argparse.ArgumentParser) -> None:
    """train.py's own flags: ahead-of-time compile, and multi-host start-up."""
    parser.add_argument(
        "--compile_only",
        action="store_true",
        help="compile the step without allocating parameters; print memory and FLOPs as JSON",
    )
    parser.add_argument(
        "--topology",
        default=None,
        help="with --compile_only: compile for this Cloud TPU slice (v5p-16, v4-8, "
        "v5litepod-16, v6e-8), from any machine with libtpu, or for these NVIDIA GPUs "
        "(h200, h100-8, h200-16: N GPUs, 8 a host), from any machine with JAX's CUDA plugin",
    )
    parser.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
    parser.add_argument("--num_processes", type=int, default=None, help="number of processes")
    parser.add_argument("--process_id", type=int, default=None, help="this process, 0..N-1")


# Set by cluster launchers that start one process per host (SLURM, Open MPI, multi-host
# TPU slices); jax.distributed.initialize() reads the rest from them.
_CLUSTER_HINTS = (
    "JAX_COORDINATOR_ADDRESS",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    "TPU_WORKER_HOSTNAMES",
)


def _cluster_env() -> bool:
    for name in _CLUSTER_HINTS:
        value = os.environ.get(name, "")
        if name == "TPU_WORKER_HOSTNAMES" and "," not in value:
            continue  # a single-host TPU VM
        if name in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE") and not (
            value.isdigit() and int(value) > 1
        ):
            continue
        if value:
            return True
    return False


def init_distributed(args: argparse.Namespace) -> None:
    """Join a multi-process run: from --coordinator/--num_processes/--process_id, else from
    a cluster launcher's environment; a single process otherwise. Imports jax."""
    given = [
        args.coordinator is not None,
        args.num_processes is not None,
        args.process_id is not None,
    ]
    if any(given) and not all(given):
        fail("--coordinator, --num_processes and --process_id go together; give all three")
    if all(given):
        host, _, port = args.coordinator.rpartition(":")
        if not host or not port.isdigit():
            fail(f"--coordinator {args.coordinator!r} is not HOST:PORT")
        if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
            fail(
                f"--process_id {args.process_id} must be in [0, --num_processes "
                f"{args.num_processes})"
            )
    elif not _cluster_env():
        return
    import jax  # here, not above: cli is imported before the XLA flags are set

    # CPU collectives across processes need gloo; other backends ignore this.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    process, processes = (args.process_id, args.num_processes) if all(given) else _launcher_rank()
    # Before the runtime starts: its C++ fatal error on a lost peer goes to the log file, and
    # the watcher writes the survivor's one last line.
    runtime_log.capture(args.workdir, logs.log_path(args.workdir, process), process, processes)
    if all(given):
        peers.initialize(args.coordinator, args.num_processes, args.process_id)
        return
    try:
        peers.initialize()
    except (RuntimeError, ValueError) as e:
        # JAX's detection found no coordinator in the launcher's variables (Open MPI 5's
        # mpirun without mpi4py; jax 0.10 reads Open MPI 4's only), or could not join it.
        fail(
            f"could not join the run this launcher's environment describes ({_line(e)}); "
            "give --coordinator, --num_processes and --process_id instead"
        )


def _line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0].rstrip(".") if lines else type(error).__name__


def _launcher_rank() -> tuple[int, int]:
    """(this process, the process count) as a cluster launcher sets them; (0, 0) where
    none says (the log line then names no process)."""
    for rank, size in (
        ("SLURM_PROCID", "SLURM_NTASKS"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("JAX_PROCESS_ID", "JAX_NUM_PROCESSES"),
    ):
        if os.environ.get(rank, "").isdigit() and os.environ.get(size, "").isdigit():
            return int(os.environ[rank]), int(os.environ[size])
    return 0, 0


def one_device_stages_or_exit(config, tool: str) -> None:
    """The benchmarks time units and steps on devices of their own, one stage each: a
    stage split over tensor or context devices is not one of those (its units' collectives
    need the others), so it is refused in one line."""
    for axis in ("tensor", "context"):
        size = config.mesh.get(axis, 1)
        if size > 1:
            fail(
                f"{tool} measures stages of one device each; mesh.{axis}={size} is not "
                f"supported there: set mesh.{axis}=1 (train.py --compile_only and "
                "python -m seqpipe.tools.memory measure such a step's memory)"
            )


def run_or_exit(fn: Callable[[], T]) -> T:
    """Run fn; a config, data, workdir, restore or HF checkpoint error becomes one line on
    stderr and exit code 2 (each is raised before any training step)."""
    try:
        return fn()
    except (config_lib.ConfigError, DataError, WorkdirError, RestoreError, HFError) as e:
        fail(str(e))
