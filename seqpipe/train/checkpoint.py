"""Checkpoints with orbax: train state, data-iterator position and run metadata, together.

Layout: `WORKDIR/checkpoints/<step>/{state,data,meta}`, written by an
`orbax.checkpoint.CheckpointManager` with asynchronous saves (the host copies the arrays
off the device, then training goes on while a background thread writes them). A step
directory appears only once complete, so `latest_step()` is always a restorable one.

- `state`: step, parameters and optimizer state, as sharded arrays (every process writes
  its own shards), layers in canonical order (the train state keeps them in stage order,
  `seqpipe.parallel.layout`: reordered on save and on restore). Restored straight into the
  shardings of the *current* mesh, so a checkpoint written data-parallel on 8 x 1
  restores on 2 x 4 (layers split over stages), and one written with interleaved stages
  (pipeline.virtual_stages=2) restores with any other V or stage count.
- `data`: the grain iterator's state. Every process reads the same global batch index
  (only its rows differ), so one JSON state serves any process count.
- `meta`: the model config, and the batch size, sequence length and seed that fix the
  batch order; checked on restore so a checkpoint never loads into a different model.
  The mesh and the pipeline are not in it: canonical order makes them free to change.
  Training has no random state beyond the seed (no dropout), so there is no RNG to save.
  It also holds a checksum of every array of `state` (`checksums`), checked on restore.

Damage. A checkpoint that does not restore (a file cut short or deleted, metadata that
does not parse, an array whose checksum differs) is moved aside to `<step>.damaged`
(which orbax never reads as a step), saying so in one line, and the next newest is tried:
the damaged one can never be used, and the previous one is what a user would go back to
by hand, losing only the steps between them, which are recomputed identically. When none
restores the run stops with one line instead of starting from scratch over them.
"""

import errno
import gc
import json
import logging
import os
import re
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from ml_collections import ConfigDict

from seqpipe.errors import RestoreError
from seqpipe.host.checkpoint_dir import complete_steps, directory
from seqpipe.parallel import layout
from seqpipe.run.config import ConfigError, base_config

ITEMS = ("state", "data", "meta")
# What orbax names a step directory until it is complete (tests/test_faults.py checks it).
TMP_SUFFIX = ".orbax-checkpoint-tmp"


class SaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, say); the message is one line."""


class Damaged(Exception):
    """This checkpoint's arrays are not what was saved."""


def _word_checksum(x: jax.Array) -> jax.Array:
    """sum(word_i * (2i + 1)) mod 2**32 over the array's bits as 32-bit (or narrower) words,
    i the word's index in row-major order: a change within any one word always changes it
    (the multiplier is odd, so invertible mod 2**32), several words collide about once in
    2**32. Integer sums do not depend on their order, so neither the mesh nor the sharding
    the array is in changes the result: a checkpoint restored on another mesh is checked."""
    narrow = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32)
    words = jax.lax.bitcast_convert_type(x, narrow)
    words = words.astype(jnp.uint32)  # a 64-bit array became [..., 2] words of 32 bits
    index = jnp.zeros(words.shape, jnp.uint32)
    for axis, size in enumerate(words.shape):
        index = index * jnp.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
    return jnp.sum(words * (2 * index + 1), dtype=jnp.uint32)


_checksums_jit = jax.jit(lambda tree: jax.tree.map(_word_checksum, tree))


def checksums(state: Any) -> dict[str, int]:
    """{tree path: checksum} of every array, computed where the arrays are (one pass over
    them on their devices; only the integers come to the host)."""
    values = jax.device_get(_checksums_jit(state))
    return {
        jax.tree_util.keystr(path): int(v)
        for path, v in jax.tree_util.tree_leaves_with_path(values)
    }


def make_manager(workdir: str | Path, config: ConfigDict) -> ocp.CheckpointManager:
    """A manager keeping `checkpoint.keep` checkpoints (0: all), saving asynchronously."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=config.checkpoint.keep or None,
        enable_async_checkpointing=config.checkpoint.async_save,
        create=True,
    )
    return ocp.CheckpointManager(directory(workdir), options=options, item_names=ITEMS)


# Model keys no parameter depends on: how the step computes, and the router losses' weights
# in its objective. A checkpoint goes on under other values (blockwise on GPUs, splash on a
# TPU), said in a line.
NO_PARAMETER = (
    "attention",
    "loss_chunk",
    "dtype",
    "moe_aux_loss",
    "moe_z_loss",
    "moe_capacity_factor",
    "moe_dispatch",
)
# The optimizer's settings: a resumed run may change them, and is told in a line.
OPTIMIZER = (
    "learning_rate",
    "min_lr_ratio",
    "warmup_steps",
    "weight_decay",
    "grad_clip",
    "b1",
    "b2",
)


def metadata(config: ConfigDict) -> dict:
    """What must match between a checkpoint and the run that restores it: the model (but
    `NO_PARAMETER`), and what fixes the order of the batches (the saved iterator position
    counts batches); and what may change, but is said: `NO_PARAMETER`, `OPTIMIZER`."""
    t = config.train
    data = {"global_batch_size": t.global_batch_size, "seq_len": t.seq_len, "seed": t.seed}
    optimizer = {k: t[k] for k in OPTIMIZER if k in t}
    return {
        "model": config.model.to_dict(),
        "data": data,
        "packing": packing(config),
        "source": config.data.source,
        "optimizer": optimizer,
    }


def packing(config: ConfigDict) -> dict:
    """How rows are made (checkpoints from before it was saved: unpacked rows): another
    packing makes other rows, so the saved position counts other batches."""
    d = config.data
    mode = d.get("packing", "none")
    if mode == "none":
        return {"packing": "none"}
    return {
        "packing": mode,
        "reset_positions": d.get("reset_positions", True),
        "eod_id": d.get("eod_id", -1),
    }


def _changes(meta: dict, expected: dict) -> str:
    """The keys a checkpoint may be resumed with changed, as `key=saved -> now` (checkpoints
    from before the optimizer was saved: its keys unchecked)."""
    model = {k: v for k, v in meta.get("model", {}).items() if k in NO_PARAMETER}
    now = {k: expected["model"].get(k) for k in model}
    diffs = [_differences(model, now, "model")]
    if "optimizer" in meta:
        diffs.append(_differences(meta["optimizer"], expected["optimizer"], "train"))
    return ", ".join(d for d in diffs if d)


def save(
    manager: ocp.CheckpointManager,
    step: int,
    state: Any,
    data_state: dict,
    config: ConfigDict,
    data_id: dict | None = None,
) -> bool:
    """Start saving step `step` (returns once the arrays are off the device); False if present.
    `data_id` (`seqpipe.data.loader.identity` of the training stream) is kept in `meta`."""
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
    meta = {**metadata(config), "tokens": data_id, "checksums": checksums(state)}
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        meta=ocp.args.JsonSave(meta),
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


def _reason(e: Exception) -> str:
    if isinstance(e, Damaged):
        return str(e)
    # orbax and tensorstore wrap the file system's error in their own; say the cause.
    if "No space left on device" in str(e) or getattr(e, "errno", None) == errno.ENOSPC:
        return "no space left on device"
    # A TensorStore read error spells out its whole spec; the array's path says enough.
    if str(e).startswith("Encountered error while reading array") and (
        paths := re.findall(r"'path': '([^']*?)/?',", str(e))
    ):
        return f"array {paths[-1]} cannot be read"
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
    manager: ocp.CheckpointManager,
    abstract_state: Any,
    config: ConfigDict,
    data_id: dict | None = None,
) -> tuple[int, Any, dict | None] | None:
    """(step, state, data_state) of the newest checkpoint that restores, or None if there is
    none; a damaged one is moved aside, with a line on stderr, and the one before tried.
    data_state is None when the checkpoint was trained on other data than `data_id`
    (`seqpipe.data.loader.identity`) and data.allow_source_change lets it go on: the new data is
    read from its start.

    `abstract_state` is a tree of `jax.ShapeDtypeStruct` carrying the target shardings;
    arrays are read directly into them, whatever mesh wrote the checkpoint, then their
    layers put in this config's stage order.

    With several processes each reads its own shards, so a damaged file may fail one
    process's read alone; they agree on the read before the checksums (a computation over
    every process's arrays, which a process left behind would never join), so all go on
    from the same step.
    """
    directory = Path(manager.directory)
    damaged = []
    _drop_failed_reads()
    for step in sorted(manager.all_steps(), reverse=True):
        read, reason = None, None
        try:
            read = _read_step(manager, step, abstract_state, config, data_id)
        except ConfigError:
            raise  # a checkpoint of another model is not damaged: the config is wrong
        except Exception as e:  # orbax's and tensorstore's errors, and Damaged
            reason = _reason(e)
        if reason is not None:
            gc.collect()  # the step's pending reads, while their errors are dropped
        reason = _agree(reason, "another process could not read its part")
        if reason is None:
            try:
                _check(read[0], read[1])
            except Damaged as e:
                reason = str(e)
            reason = _agree(reason, "another process found a checksum that differs")
        if reason is None:
            if damaged:
                _set_aside(manager, [s for s, _ in damaged])
                print(
                    f"warning: checkpoint {directory}/{damaged[0][0]} is damaged "
                    f"({damaged[0][1]}); moved aside to {directory}/{damaged[0][0]}.damaged"
                    + (f" with {len(damaged) - 1} more" if len(damaged) > 1 else "")
                    + f"; resuming from step {step}",
                    file=sys.stderr,
                    flush=True,
                )
            restored, _, data_state, note = read
            if note:
                print(note, file=sys.stderr, flush=True)
            placement = layout.of_config(config)
            state = layout.on_arrays(layout.to_stage_order, restored, placement, donate=True)
            return step, state, data_state
        damaged.append((step, reason))
    if damaged:
        steps = ", ".join(f"{s} ({r})" for s, r in damaged)
        raise RestoreError(
            f"no checkpoint in {directory} restores: step {steps}; move them aside to start "
            "from scratch, or use another --workdir"
        )
    return None


def read_params(step_dir: Path, params_of: Any) -> tuple[dict, Any]:
    """(meta, parameters) of one step, read as resume reads them: its meta parsed, the
    parameters alone read into the shape structs (with shardings) `params_of(meta)` gives,
    and checked against the checksums saved with them. Damaged, its message one line, if a
    file does not read or a checksum differs (`seqpipe.hf export` then tries another)."""
    _drop_failed_reads()
    try:
        meta = _json_item(step_dir, "meta")
        item = {"params": params_of(meta)}
        shardings = jax.tree.map(lambda x: x.sharding, item)
        restore_args = ocp.checkpoint_utils.construct_restore_args(item, shardings)
        args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
        handler = ocp.PyTreeCheckpointHandler()
        try:
            state = handler.restore(step_dir / "state", args=args)
        finally:
            handler.close()
        _check(state, meta.get("checksums"))
    except Exception as e:  # orbax's and tensorstore's errors, and Damaged
        gc.collect()  # the step's pending reads, while their errors are dropped
        raise Damaged(_reason(e)) from None
    return meta, state["params"]


def _drop_failed_reads() -> None:
    """A failed restore leaves orbax's other reads of that step pending; collected, each
    raises its own read error as an "Exception ignored in <coroutine>" traceback on stderr
    (during the restore, later, or at exit), over the one line that already says why.
    From the first restore on, such errors of read coroutines are dropped, and asyncio's
    report of a read task's error that nobody retrieved (orbax's `async_deserialize`) is
    logged as info: in the run's log file, not on the console."""
    if getattr(sys.unraisablehook, "drops_failed_reads", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        name = getattr(unraisable.object, "__qualname__", "")
        if not (isinstance(unraisable.object, types.CoroutineType) and "read" in name):
            previous(unraisable)

    hook.drops_failed_reads = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_failed_read_task_as_info)


def _failed_read_task_as_info(record: logging.LogRecord) -> bool:
    """asyncio's "Task exception was never retrieved" for a read task, at info level."""
    message = record.getMessage()
    coroutine = re.search(r"coro=<(\w+)\(", message)
    if message.startswith("Task exception was never retrieved") and coroutine:
        if "read" in coroutine.group(1) or "deserialize" in coroutine.group(1):
            record.levelno, record.levelname = logging.INFO, "INFO"
    return True


def _agree(reason: str | None, other: str) -> str | None:
    """This process's failure, or `other` if another process failed: None only if none did."""
    if jax.process_count() == 1:
        return reason
    from jax.experimental import multihost_utils

    ok = multihost_utils.process_allgather(np.int32(reason is None))
    return other if reason is None and not np.all(ok) else reason


def _read_step(manager, step: int, abstract_state: Any, config: ConfigDict, data_id):
    """(canonical state, saved checksums, data state or None, a note or None); this
    process's part only.

    Read through the items' handlers, not `manager.restore`: orbax's Checkpointer waits at
    a barrier of all processes after reading, and a process whose read raised skips it,
    so the others would pair that barrier with its next collective and hang or fail."""
    step_dir = Path(manager.directory) / str(step)
    meta = _json_item(step_dir, "meta")
    expected = metadata(config)
    where = f"the checkpoint at {manager.directory}/{step}"
    # A checkpoint saved before a model key existed holds that key's default.
    saved_model = {**base_config().model.to_dict(), **meta.get("model", {})}
    holds = lambda model: {k: v for k, v in model.items() if k not in NO_PARAMETER}
    if diff := _differences(holds(saved_model), holds(expected["model"]), "model"):
        raise ConfigError(
            f"{where} is of a different model ({diff}); use a fresh --workdir or the same model"
        )
    diff = _differences(meta.get("data", {}), expected["data"], "train")
    packed = _differences(meta.get("packing", {"packing": "none"}), expected["packing"], "data")
    if diff := ", ".join(x for x in (diff, packed) if x):
        raise ConfigError(
            f"{where} was trained with another batch order ({diff}), so its data "
            "position does not carry over; use the same values or a fresh --workdir"
        )
    note = _data_change(meta, config, data_id, where)
    if changed := _changes(meta, expected):
        print(
            f"note: {where} was trained with other settings, which hold no parameter; going "
            f"on with the new ones: {changed}",
            file=sys.stderr,
            flush=True,
        )
    target = layout.canonical_abstract(abstract_state, layout.of_config(config))
    handler = ocp.StandardCheckpointHandler()
    try:
        state = handler.restore(step_dir / "state", args=ocp.args.StandardRestore(target))
    finally:
        handler.close()
    data = _json_item(step_dir, "data")
    return state, meta.get("checksums"), None if note else data, note


def _json_item(step_dir: Path, name: str) -> dict:
    """A step's JSON item (`meta`, `data`); Damaged if it does not hold a dict."""
    item = ocp.JsonCheckpointHandler().restore(step_dir / name, args=ocp.args.JsonRestore())
    if not isinstance(item, dict):
        raise Damaged(f"{name} holds {type(item).__name__}, not a dict")
    return item


def _data_change(meta: dict, config: ConfigDict, data_id: dict | None, where: str) -> str | None:
    """None if the checkpoint was trained on this data; else a ConfigError, or with
    data.allow_source_change the line that says the new data starts from its beginning.
    Checkpoints from before the source (or the data's identity) was saved are not checked."""
    source = config.data.source
    if meta.get("source", source) != source:
        was, now = f"data.source={meta['source']}", f"data.source={source}"
    elif data_id and meta.get("tokens") and meta["tokens"] != data_id:
        old = meta["tokens"]
        was = f"other data ({old.get('tokens')} tokens, digest {old.get('digest')})"
        now = f"this data.source={source} ({data_id['tokens']} tokens, digest {data_id['digest']})"
    else:
        return None
    if not config.data.allow_source_change:
        raise ConfigError(
            f"{where} was trained on {was}, not {now}: its data position counts batches of "
            "the other data; resume with that data, set data.allow_source_change=True to go "
            "on from its weights with the new data read from its start, or use a fresh --workdir"
        )
    return (
        f"note: {where} was trained on {was}; going on from its weights and optimizer state "
        f"on {now}, read from its start (data.allow_source_change=True)"
    )


def _check(state: Any, saved: dict | None) -> None:
    """Damaged if an array's checksum differs from the saved one (checkpoints written
    before checksums have none: unchecked). Every process computes every array's."""
    if saved is None:
        return
    now = checksums(state)
    if bad := sorted(k for k in now if now[k] != saved.get(k)):
        raise Damaged(f"the checksum of {bad[0]} differs from the one saved")


def _set_aside(manager: ocp.CheckpointManager, steps: list[int]) -> None:
    """Rename damaged step directories to `<step>.damaged` (process 0; the others wait):
    kept for a look, out of orbax's way, so the step can be saved again."""
    directory = Path(manager.directory)
    if jax.process_index() == 0:
        for step in steps:
            target = directory / f"{step}.damaged"
            n = 1
            while target.exists():
                target, n = directory / f"{step}.damaged.{n}", n + 1
            os.rename(directory / str(step), target)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("seqpipe: damaged checkpoints set aside")
    manager.reload()


def clean_partial(workdir: str | Path) -> list[str]:
    """Remove what saves cut short left (`<step>.orbax-checkpoint-tmp*`, never restored);
    call while holding the workdir, before any save. Returns the names removed."""
    ckpt = directory(workdir)
    if not ckpt.is_dir():
        return []
    removed = []
    for p in ckpt.iterdir():
        if TMP_SUFFIX in p.name:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return sorted(removed)


def _differences(saved: dict, expected: dict, section: str) -> str:
    """The keys whose values differ as JSON holds them (a tuple is the list it was saved as)."""

    def plain(d, k):
        return json.loads(json.dumps(d.get(k)))

    keys = sorted(k for k in set(saved) | set(expected) if plain(saved, k) != plain(expected, k))
    return ", ".join(f"{section}.{k}={saved.get(k)!r} saved, {expected.get(k)!r} now" for k in keys)


def abstract(tree: Any, shardings: Any) -> Any:
    """Shape/dtype structs with shardings: the restore target, without allocating anything."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )
