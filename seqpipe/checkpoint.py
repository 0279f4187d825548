"""Checkpoints with orbax: train state, data-iterator position and run metadata, together.

Layout: `WORKDIR/checkpoints/<step>/{state,data,meta}`, written by an
`orbax.checkpoint.CheckpointManager` with asynchronous saves (the host copies the arrays
off the device, then training goes on while a background thread writes them). A step
directory appears only once complete, so `latest_step()` is always a restorable one.

- `state`: step, parameters and optimizer state, as sharded arrays (every process writes
  its own shards), layers in canonical order (the train state keeps them in stage order,
  `seqpipe.layout`: reordered on save and on restore). Restored straight into the
  shardings of the *current* mesh, so a checkpoint written data-parallel on 8 x 1
  restores on 2 x 4 (layers split over stages), and one written with interleaved stages
  (pipeline.virtual_stages=2) restores with any other V or stage count.
- `data`: the grain iterator's state. Every process reads the same global batch index
  (only its rows differ), so one JSON state serves any process count.
- `meta`: the model config, and the batch size, sequence length and seed that fix the
  batch order; checked on restore so a checkpoint never loads into a different model.
  The mesh and the pipeline are not in it: canonical order makes them free to change.
  Training has no random state beyond the seed (no dropout), so there is no RNG to save.
"""

import errno
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from ml_collections import ConfigDict

from seqpipe import layout
from seqpipe.config import ConfigError

ITEMS = ("state", "data", "meta")
# What orbax names a step directory until it is complete (tests/test_faults.py checks it).
TMP_SUFFIX = ".orbax-checkpoint-tmp"


class SaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, say); the message is one line."""


def directory(workdir: str | Path) -> Path:
    return Path(workdir).resolve() / "checkpoints"


def make_manager(workdir: str | Path, config: ConfigDict) -> ocp.CheckpointManager:
    """A manager keeping `checkpoint.keep` checkpoints (0: all), saving asynchronously."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=config.checkpoint.keep or None,
        enable_async_checkpointing=config.checkpoint.async_save,
        create=True,
    )
    return ocp.CheckpointManager(directory(workdir), options=options, item_names=ITEMS)


def metadata(config: ConfigDict) -> dict:
    """What must match between a checkpoint and the run that restores it: the model, and
    what fixes the order of the batches (the saved iterator position counts batches)."""
    t = config.train
    data = {"global_batch_size": t.global_batch_size, "seq_len": t.seq_len, "seed": t.seed}
    return {"model": config.model.to_dict(), "data": data}


def save(
    manager: ocp.CheckpointManager, step: int, state: Any, data_state: dict, config: ConfigDict
) -> bool:
    """Start saving step `step` (returns once the arrays are off the device); False if present."""
    if step in manager.all_steps():
        return False
    # Refuse up front what cannot fit: a save that runs out of space half-way leaves a
    # temporary directory (never restored) and a background thread's error, not a message.
    need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    free = shutil.disk_usage(manager.directory).free
    if free < need:
        raise SaveError(_failed(manager, step, f"{need:,} bytes needed, {free:,} free"))
    # A copy of the layers in canonical order (none with V = 1), freed once on the host.
    state = layout.on_arrays(layout.to_canonical, state, layout.of_config(config))
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        meta=ocp.args.JsonSave(metadata(config)),
    )
    try:
        return manager.save(step, args=args, force=True)
    except Exception as e:  # orbax's errors, from the file system down
        raise SaveError(_failed(manager, step, _reason(e))) from e


def wait(manager: ocp.CheckpointManager, step: int | None) -> None:
    """Wait for the save of `step` in flight, if any; its write's failure is a SaveError."""
    try:
        manager.wait_until_finished()
    except Exception as e:
        raise SaveError(_failed(manager, step, _reason(e))) from e


def complete_steps(directory: Path) -> list[int]:
    """Steps whose checkpoint is complete: orbax writes `<step>.orbax-checkpoint-tmp` and
    renames it to `<step>` (atomically) only once every item is written and committed."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _reason(e: Exception) -> str:
    # orbax and tensorstore wrap the file system's error in their own; say the cause.
    if "No space left on device" in str(e) or getattr(e, "errno", None) == errno.ENOSPC:
        return "no space left on device"
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1][:200] if lines else ''}"


def _failed(manager: ocp.CheckpointManager, step: int | None, reason: str) -> str:
    """The one-line message; the failed save's partial directory is removed first, since a
    full disk is the usual cause and the space is needed to close the logs."""
    directory = Path(manager.directory)
    shutil.rmtree(directory / f"{step}{TMP_SUFFIX}", ignore_errors=True)
    steps = complete_steps(directory)
    kept = f"step {steps[-1]} is the newest complete one, intact" if steps else "none is complete"
    return (
        f"saving the checkpoint of step {step} in {directory} failed ({reason}); {kept}; "
        "free space there (or lower checkpoint.keep) and run again to resume"
    )


def restore_latest(
    manager: ocp.CheckpointManager, abstract_state: Any, config: ConfigDict
) -> tuple[int, Any, dict] | None:
    """(step, state, data_state) of the newest complete checkpoint, or None if there is none.

    `abstract_state` is a tree of `jax.ShapeDtypeStruct` carrying the target shardings;
    arrays are read directly into them, whatever mesh wrote the checkpoint, then their
    layers put in this config's stage order.
    """
    step = manager.latest_step()
    if step is None:
        return None
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    expected = metadata(config)
    where = f"the checkpoint at {manager.directory}/{step}"
    if diff := _differences(meta.get("model", {}), expected["model"], "model"):
        raise ConfigError(
            f"{where} is of a different model ({diff}); use a fresh --workdir or the same model"
        )
    if diff := _differences(meta.get("data", {}), expected["data"], "train"):
        raise ConfigError(
            f"{where} was trained with another batch order ({diff}), so its data "
            "position does not carry over; use the same values or a fresh --workdir"
        )
    placement = layout.of_config(config)
    target = layout.canonical_abstract(abstract_state, placement)
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()
        ),
    )
    state = layout.on_arrays(layout.to_stage_order, restored["state"], placement, donate=True)
    return step, state, restored["data"]


def _differences(saved: dict, expected: dict, section: str) -> str:
    keys = sorted(k for k in set(saved) | set(expected) if saved.get(k) != expected.get(k))
    return ", ".join(f"{section}.{k}={saved.get(k)!r} saved, {expected.get(k)!r} now" for k in keys)


def abstract(tree: Any, shardings: Any) -> Any:
    """Shape/dtype structs with shardings: the restore target, without allocating anything."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )
