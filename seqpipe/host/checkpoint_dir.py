"""Where a run's checkpoints live and which of them are complete: paths only, without
orbax or jax, for the modules that must not load them (the runtime log's watcher process,
the lost-peer line, the data's resume check). `seqpipe.train.checkpoint` writes and reads them.
"""

from pathlib import Path


def directory(workdir: str | Path) -> Path:
    return Path(workdir).resolve() / "checkpoints"


def complete_steps(directory: Path) -> list[int]:
    """Steps whose checkpoint is complete: orbax writes `<step>.orbax-checkpoint-tmp` and
    renames it to `<step>` (atomically) only once every item is written and committed."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
