"""A lost process of a multi-process run: the survivors end within a minute.

JAX's distributed runtime has each process send heartbeats to the coordination service
(in process 0); a process silent for `HEARTBEAT_S` is declared dead, and the service
tells every other process, which then ends (JAX's reaction: a C++ fatal error, exit 134;
jaxlib 0.10's Python binding cannot replace it: a `missed_heartbeat_callback` given to
its client throws std::bad_cast when called; `seqpipe.host.runtime_log` writes that process's
last line for it). A process whose collective fails first
(gloo: "Connection closed by peer") ends from the training loop with one line naming the
lost process and the newest complete checkpoint (`lost_message`), exit 1.
"""

import re

from seqpipe.host import checkpoint_dir

# Seconds without a heartbeat before a process is declared dead: a survivor ends within
# a minute. Not less: at 15 s two healthy processes of a test on 2 busy CPU cores were
# declared dead during their first compile (JAX's default is 100 s).
HEARTBEAT_S = 45
# Words of a runtime error that says a peer went away, not that this process failed.
PEER_WORDS = ("closed by peer", "Connection reset", "Gloo", "heartbeat", "UNAVAILABLE")
_context: dict = {"checkpoints": None, "process": 0, "processes": 1}


def initialize(coordinator=None, num_processes=None, process_id=None) -> None:
    """jax.distributed.initialize (arguments as given, else the cluster's environment)
    with the heartbeat timeout above (JAX's default, 100 s, kept a survivor for minutes)."""
    import jax

    jax.distributed.initialize(
        coordinator, num_processes, process_id, heartbeat_timeout_seconds=HEARTBEAT_S
    )
    _context.update(process=jax.process_index(), processes=jax.process_count())


def watch(checkpoints, process: int | None = None, processes: int | None = None) -> None:
    """Name the checkpoint directory the line reports on (and, for `seqpipe.host.runtime_log`'s
    watcher, which has no runtime of its own, the process and the process count)."""
    _context["checkpoints"] = checkpoints
    if process is not None:
        _context.update(process=process, processes=processes)


def is_lost_peer(error: Exception) -> bool:
    """Whether a runtime error of a multi-process run says a peer went away."""
    return _context["processes"] > 1 and any(w in str(error) for w in PEER_WORDS)


def lost_message(reason: str, process: int | None = None) -> str:
    """`lost process N (reason); the newest complete checkpoint is ...`."""
    text = " ".join(reason.split())
    named = re.search(r"[Tt]ask (\d+)|unhealthy[^:]*:\s*(\d+)", reason)
    if process is not None:
        who = f"process {process}"
    elif named:
        who = f"process {named.group(1) or named.group(2)}"
    elif _context["processes"] == 2:
        who = f"process {1 - _context['process']}"
    else:
        who = "another process"
    return f"lost {who} of the run ({text[:160]}); {_newest()}; restart every process to resume"


def _newest() -> str:
    directory = _context["checkpoints"]
    if directory is None:
        return "no checkpoint was restored or saved yet"
    steps = checkpoint_dir.complete_steps(directory)
    if not steps:
        return f"no complete checkpoint in {directory}"
    return f"the newest intact checkpoint is step {steps[-1]} in {directory}"
