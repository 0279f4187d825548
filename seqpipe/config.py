"""Config schema, loading (`--config FILE --config.a.b=value`) and validation with one-line errors.

Config files live in `configs/` and define `get_config()`, starting from `base_config()`
so that every key has a default and a typo in an override is an error, not a new key.
"""

import ast
import importlib.util
import math
from pathlib import Path

import ml_collections

from seqpipe import remat, schedule  # pure Python and NumPy: cheap

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
MESH_AXES = ("data", "stage")
SCHEDULES = ("none", *schedule.SCHEDULES)  # "none": no pipeline (mesh.stage = 1)
PARTITIONS = ("uniform", "flops")
DTYPES = ("float32", "bfloat16", "float16")
SOURCES = ("stdlib", "text", "tokens")
TOKENIZERS = ("bpe", "byte")
REMAT_POLICIES = tuple(remat.POLICIES)
# seqpipe.attention.IMPLEMENTATIONS, named here so that loading a config imports no jax.
ATTENTION = ("auto", "xla", "blockwise", "splash")
# Keys whose value is a name or an integer: an override is read from its own text (an
# integer if it is one, else a name), never coerced to the type of the value it replaces,
# so a file's `inflight=6` can be overridden back to `full`. Their sections are not type-safe.
NAME_OR_INT = ("pipeline.inflight",)


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the key and what would be valid."""


def base_config() -> ml_collections.ConfigDict:
    """Every key seqpipe reads, with defaults."""
    c = ml_collections.ConfigDict()
    c.model = dict(
        vocab_size=4096,
        num_layers=4,
        d_model=128,
        num_heads=4,
        d_ff=512,
        dtype="float32",
        param_dtype="float32",
        rope_base=10000.0,
        init_std=0.02,
        # Segment attention: xla (whole score matrices; the tests' oracle), blockwise
        # (O(block) memory, any backend), splash (Pallas, TPU), auto (the best per backend).
        attention="auto",
    )
    c.mesh = dict(data=1, stage=1)
    # Not type-safe: `inflight` is a name or an integer (validate checks every key's type).
    c.pipeline = ml_collections.ConfigDict(type_safe=False)
    c.pipeline.update(
        schedule="none",
        microbatches=1,
        segments=1,
        partition="uniform",
        partition_multiple=1,
        virtual_stages=1,
        inflight="full",
        remat="full",  # what a forward keeps for its backward: one of REMAT_POLICIES
    )
    c.train = dict(
        steps=100,
        global_batch_size=8,
        seq_len=128,
        learning_rate=3e-3,
        min_lr_ratio=0.1,
        warmup_steps=10,
        weight_decay=0.1,
        grad_clip=1.0,
        b1=0.9,
        b2=0.95,
        seed=0,
        log_every=10,
        eval_every=0,
        eval_batches=4,
        stop_at=0,  # end this invocation at this step, with a checkpoint; 0: at train.steps
        # A step whose loss or gradient norm is not finite is skipped (no update); this many
        # in a row stop the run, without saving.
        max_bad_steps=10,
        inject_nan_at=(),  # for tests only: make the loss and gradients of these steps NaN
    )
    # Checkpoints under WORKDIR/checkpoints: every `every` steps (0: only at the end), the
    # newest `keep` kept (0: all), written by a background thread when async_save.
    c.checkpoint = dict(every=1000, keep=3, async_save=True)
    c.data = dict(
        source="stdlib",
        path="",
        tokenizer="bpe",
        token_dtype="uint16",
        eval_fraction=0.02,
        cache_dir="",
        tokenizer_path="",
    )
    return c


def resolve_path(name: str) -> Path:
    """A config path as given, else a bare name looked up in `configs/`."""
    for candidate in (Path(name), CONFIG_DIR / name, CONFIG_DIR / f"{name}.py"):
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"--config {name}: no such file here or in {CONFIG_DIR}; "
        f"choose one of {sorted(p.name for p in CONFIG_DIR.glob('*.py'))}"
    )


def load_file(name: str) -> ml_collections.ConfigDict:
    path = resolve_path(name)
    spec = importlib.util.spec_from_file_location(f"seqpipe_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        config = module.get_config()
    except Exception as e:  # a user's file: report it in one line
        raise ConfigError(f"--config {path}: failed to load: {type(e).__name__}: {e}") from e
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(f"--config {path}: get_config() must return an ml_collections.ConfigDict")
    return config


def _parse_value(key: str, text: str, default):
    """Coerce an override string to the type of the key's default (or see NAME_OR_INT)."""
    if key in NAME_OR_INT:
        try:
            return int(text)
        except ValueError:
            return text  # a name; validate() says which names are valid
    if isinstance(default, bool):
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise ConfigError(f"--config.{key}={text}: expected true or false")
    if isinstance(default, str):
        return text
    try:
        # float() also reads nan and inf, so validation can say what is wrong with them.
        value = float(text) if isinstance(default, float) else ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(f"--config.{key}={text}: expected a {type(default).__name__}") from None
    if isinstance(default, float) and isinstance(value, int):
        value = float(value)
    if not isinstance(value, type(default)):
        raise ConfigError(f"--config.{key}={text}: expected a {type(default).__name__}")
    return value


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict[str, str]) -> None:
    for key, text in overrides.items():
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
                raise ConfigError(f"--config.{key}: unknown key; sections are {sorted(config)}")
            node = node[part]
        if leaf not in node:
            raise ConfigError(f"--config.{key}: unknown key; valid keys are {sorted(node)}")
        with node.unlocked():
            node[leaf] = _parse_value(key, text, node[leaf])


def load(name: str, overrides: dict[str, str] | None = None) -> ml_collections.ConfigDict:
    """Load a config file, apply `a.b=value` overrides, and check the result."""
    config = load_file(name)
    base = base_config()
    for section in config:
        if section not in base:
            raise ConfigError(f"config section '{section}' is unknown; valid: {sorted(base)}")
        for key in config[section]:
            if key not in base[section]:
                raise ConfigError(
                    f"config key {section}.{key} is unknown; valid: {sorted(base[section])}"
                )
    apply_overrides(config, overrides or {})
    validate(config)
    config.lock()
    return config


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _choice(config, key: str, choices) -> None:
    section, leaf = key.split(".")
    value = config[section][leaf]
    _require(value in choices, f"{key}={value!r} is not valid; choose one of {list(choices)}")


def validate(config: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
    """Check everything that can be checked before any device work; raise ConfigError.

    Without num_devices a mesh axis may still be -1; `resolve` fixes it and checks again."""
    m, mesh, p, t, d = config.model, config.mesh, config.pipeline, config.train, config.data
    for key in ("vocab_size", "num_layers", "d_model", "num_heads", "d_ff"):
        _require(m[key] >= 1, f"model.{key}={m[key]} must be at least 1")
    _require(
        m.d_model % m.num_heads == 0,
        f"model.num_heads={m.num_heads} must divide model.d_model={m.d_model}",
    )
    _require(
        (m.d_model // m.num_heads) % 2 == 0,
        f"model.d_model / model.num_heads = {m.d_model // m.num_heads} must be even for rotary "
        "embeddings; change model.num_heads",
    )
    _choice(config, "model.dtype", DTYPES)
    _choice(config, "model.param_dtype", DTYPES)
    _choice(config, "model.attention", ATTENTION)
    # An axis still at -1 skips the checks that need its size.
    sizes = mesh_sizes(mesh, num_devices)
    data, stage = sizes["data"], sizes["stage"]
    _choice(config, "pipeline.schedule", SCHEDULES)
    _choice(config, "pipeline.partition", PARTITIONS)
    _choice(config, "pipeline.remat", REMAT_POLICIES)
    _require(
        p.schedule != "none" or stage in (1, -1),
        f"mesh.stage={stage} needs a pipeline schedule; set pipeline.schedule "
        f"(one of {list(SCHEDULES[1:])}) or mesh.stage=1",
    )
    for key in ("microbatches", "segments", "virtual_stages", "partition_multiple"):
        _require(
            isinstance(p[key], int) and p[key] >= 1,
            f"pipeline.{key}={p[key]!r} must be an integer of at least 1",
        )
    inflight = p.inflight
    _require(
        inflight in ("minimal", "full")
        or (isinstance(inflight, int) and not isinstance(inflight, bool) and inflight >= 1),
        f"pipeline.inflight={inflight!r} is not valid; use 'minimal', 'full' or a positive integer",
    )
    _require(t.steps >= 1, f"train.steps={t.steps} must be at least 1")
    _require(t.seq_len >= 1, f"train.seq_len={t.seq_len} must be at least 1")
    _require(
        p.segments <= t.seq_len,
        f"pipeline.segments={p.segments} exceeds train.seq_len={t.seq_len}; use fewer segments",
    )
    if p.schedule != "none" and stage != -1:
        _validate_pipeline(config, stage)
    # With mesh.data still -1 the batch must at least split into micro-batches.
    replicas, factors = (1, "") if data == -1 else (data, "mesh.data * ")
    per_replica = replicas * p.microbatches
    _require(
        t.global_batch_size >= 1 and t.global_batch_size % per_replica == 0,
        f"train.global_batch_size={t.global_batch_size} must be a positive multiple of "
        f"{factors}pipeline.microbatches = {per_replica}",
    )
    for key in ("learning_rate", "weight_decay", "grad_clip", "min_lr_ratio"):
        value = t[key]
        _require(
            math.isfinite(value) and value >= 0, f"train.{key}={value} must be finite and >= 0"
        )
    for key in ("b1", "b2"):
        _require(0 <= t[key] < 1, f"train.{key}={t[key]} must be in [0, 1) (an Adam decay rate)")
    for key in ("warmup_steps", "log_every", "eval_every", "eval_batches"):
        _require(t[key] >= 0, f"train.{key}={t[key]} must be >= 0")
    _require(t.log_every >= 1, f"train.log_every={t.log_every} must be at least 1")
    _require(t.stop_at >= 0, f"train.stop_at={t.stop_at} must be >= 0 (0: run to train.steps)")
    _require(
        t.max_bad_steps >= 1,
        f"train.max_bad_steps={t.max_bad_steps} must be at least 1 (non-finite steps in a row "
        "that stop the run)",
    )
    _require(
        all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in t.inject_nan_at),
        f"train.inject_nan_at={t.inject_nan_at!r} must be a tuple of steps >= 1, e.g. (3, 4)",
    )
    ck = config.checkpoint
    for key in ("every", "keep"):
        _require(ck[key] >= 0, f"checkpoint.{key}={ck[key]} must be >= 0")
    _choice(config, "data.source", SOURCES)
    _choice(config, "data.tokenizer", TOKENIZERS)
    _choice(config, "data.token_dtype", ("uint16", "uint32"))
    _require(
        d.source == "stdlib" or d.path,
        f"data.source={d.source!r} needs data.path (a file, directory or glob)",
    )
    _require(
        d.tokenizer != "byte" or m.vocab_size >= 256,
        f"model.vocab_size={m.vocab_size} is below 256, the byte tokenizer's size",
    )
    _require(0 < d.eval_fraction < 1, f"data.eval_fraction={d.eval_fraction} must be in (0, 1)")


def mesh_sizes(mesh: ml_collections.ConfigDict, num_devices: int | None = None) -> dict:
    """{'data': d, 'stage': s} with an axis at -1 given the devices the other leaves, when
    num_devices is known (else it stays -1); ConfigError if no split of the devices fits."""
    sizes = {axis: mesh[axis] for axis in MESH_AXES}
    for axis, size in sizes.items():
        _require(
            isinstance(size, int) and (size >= 1 or size == -1),
            f"mesh.{axis}={size} must be at least 1, or -1 for all the devices the other "
            "axis leaves",
        )
    open_axes = [axis for axis, size in sizes.items() if size == -1]
    _require(
        len(open_axes) <= 1,
        " and ".join(f"mesh.{a}=-1" for a in open_axes)
        + ": at most one mesh axis can be -1 (all the devices the others leave)",
    )
    if num_devices is None:
        return sizes
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if not open_axes:
        _require(
            fixed == num_devices,
            f"mesh.data * mesh.stage = {fixed} but {num_devices} devices are visible; set "
            "mesh.data and mesh.stage so their product matches, or one of them to -1",
        )
        return sizes
    (open_axis,) = open_axes
    (other,) = (axis for axis in MESH_AXES if axis != open_axis)
    _require(
        num_devices % fixed == 0,
        f"mesh.{other}={fixed} does not divide the {num_devices} visible devices "
        f"(mesh.{open_axis}=-1 takes what mesh.{other} leaves); set mesh.{other} to a divisor "
        f"of {num_devices}",
    )
    sizes[open_axis] = num_devices // fixed
    return sizes


def resolve(config: ml_collections.ConfigDict, num_devices: int) -> ml_collections.ConfigDict:
    """A copy of config with its mesh fitted to num_devices (a -1 axis takes what the other
    leaves), fully validated; the one place -1 becomes a size."""
    sizes = mesh_sizes(config.mesh, num_devices)
    resolved = config.copy_and_resolve_references()
    with resolved.unlocked():
        resolved.mesh.update(sizes)
    validate(resolved, num_devices)
    resolved.lock()
    return resolved


def _validate_pipeline(config: ml_collections.ConfigDict, stages: int) -> None:
    """The layer split, the segment partition and the schedule table must all be buildable."""
    from seqpipe import partition  # pure Python, cheap

    m, p = config.model, config.pipeline
    chunks = stages * p.virtual_stages
    _require(
        m.num_layers % chunks == 0,
        f"model.num_layers={m.num_layers} must be divisible by mesh.stage * "
        f"pipeline.virtual_stages = {chunks}",
    )
    try:
        partition.segment_lengths(
            config.train.seq_len,
            p.segments,
            p.partition,
            multiple=p.partition_multiple,
            **partition.model_dims(m),
        )
    except ValueError as e:
        setting = (
            f"train.seq_len={config.train.seq_len}, pipeline.segments={p.segments}, "
            f"pipeline.partition={p.partition}, pipeline.partition_multiple="
            f"{p.partition_multiple}"
        )
        raise ConfigError(f"{setting}: {e}; change one of these keys") from None
    try:
        schedule.build(p.schedule, stages, p.microbatches, p.segments, p.virtual_stages, p.inflight)
    except ValueError as e:
        setting = (
            f"pipeline.schedule={p.schedule}, mesh.stage={stages}, pipeline.microbatches="
            f"{p.microbatches}, pipeline.segments={p.segments}, pipeline.virtual_stages="
            f"{p.virtual_stages}"
        )
        raise ConfigError(f"{setting}: {e}") from None


def parse_overrides(args: list[str]) -> dict[str, str]:
    """`--config.a.b=value` (or `--config.a.b value`) arguments to {'a.b': 'value'}."""
    overrides, i = {}, 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--config."):
            raise ConfigError(
                f"unknown argument {arg!r}; overrides look like --config.train.steps=10"
            )
        key, sep, value = arg[len("--config.") :].partition("=")
        if not sep:
            if i + 1 >= len(args):
                raise ConfigError(f"{arg} needs a value, e.g. {arg}=VALUE")
            value, i = args[i + 1], i + 1
        overrides[key] = value
        i += 1
    return overrides
