"""Config schema, loading (`--config FILE --config.a.b=value`) and validation with one-line errors.

Config files live in `configs/` and define `get_config()`, starting from `base_config()`
so that every key has a default and a typo in an override is an error, not a new key.
"""

import ast
import dataclasses
import importlib.util
import math
from pathlib import Path

import ml_collections

from seqpipe import schedule  # pure Python and NumPy: cheap
from seqpipe.errors import ConfigError
from seqpipe.pipeline import remat

# A wheel ships configs/ as the folder seqpipe/configs; in a checkout that is a link to
# configs/, resolved so that messages name configs/.
CONFIG_DIR = (Path(__file__).resolve().parents[1] / "configs").resolve()
MESH_AXES = ("data", "stage")  # the axes that may be -1; mesh.tensor is always a size
SCHEDULES = ("none", *schedule.SCHEDULES)  # "none": no pipeline (mesh.stage = 1)
PARTITIONS = ("uniform", "flops")
DTYPES = ("float32", "bfloat16", "float16")
SOURCES = ("stdlib", "text", "jsonl", "parquet", "tokens")
TEXT_KEY_SOURCES = ("jsonl", "parquet")  # the sources whose documents sit in a field
PACKINGS = ("none", "concat", "best_fit")  # seqpipe.data.packing.PACKINGS
TOKENIZERS = ("bpe", "byte")
HF = "hf:"  # a HuggingFace model directory (`seqpipe.hf`), as a config, weights or tokenizer
# `auto`: the least recompute that fits the device (`seqpipe.run.remat_auto`, train.py).
REMAT_POLICIES = (*remat.POLICIES, "auto")
# seqpipe.kernels.attention.IMPLEMENTATIONS, named here so that loading a config imports no jax.
ATTENTION = ("auto", "xla", "blockwise", "splash", "pallas_gpu")
MLPS = ("gelu", "swiglu")
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")  # seqpipe.kernels.rope.SCALINGS
# Keys whose value is a name or an integer: an override is read from its own text (an
# integer if it is one, else a name), never coerced to the type of the value it replaces,
# so a file's `inflight=6` can be overridden back to `full`. Their sections are not type-safe.
NAME_OR_INT = ("pipeline.inflight",)


@dataclasses.dataclass(frozen=True)
class Key:
    """A key's type and range: `kind` int, float, str or bool (a bool is never an int, an
    int is a float); numbers in [low, high] (`low_open`/`high_open` exclude an end; floats
    must be finite); strings one of `choices` when given."""

    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple = ()

    def error(self, key: str, value) -> str | None:
        """None if `value` is valid for `key`, else the one-line message."""
        kinds = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
        if isinstance(value, bool) != (self.kind is bool) or not isinstance(
            value, int | float if self.kind is float else self.kind
        ):
            return (
                f"{key}={value!r} is of type {type(value).__name__}, not {kinds[self.kind]}; "
                f"it must be {self.describe()}"
            )
        if self.choices:
            if value in self.choices:
                return None
            return f"{key}={value!r} is not valid; choose one of {list(self.choices)}"
        if self.kind is float and not math.isfinite(value):
            return f"{key}={value!r} must be {self.describe()}"
        low, high = self.low, self.high
        if low is not None and (value <= low if self.low_open else value < low):
            return f"{key}={value!r} must be {self.describe()}"
        if high is not None and (value >= high if self.high_open else value > high):
            return f"{key}={value!r} must be {self.describe()}"
        return None

    def describe(self) -> str:
        if self.choices:
            return f"one of {list(self.choices)}"
        kind = {int: "an integer", float: "a finite number", str: "a string", bool: "a bool"}
        low, high = _num(self.low), _num(self.high)
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"in {left}{low}, {high}{right} ({kind[self.kind]})"
        if self.low is not None:
            at_least = "at least 1" if self.low == 1 and not self.low_open else f">= {low}"
            return f"{'> ' + low if self.low_open else at_least} ({kind[self.kind]})"
        return kind[self.kind]


def _num(x: float | None) -> str:
    return "2**32" if x == 2**32 else f"{x:g}" if x is not None else ""


_POSITIVE_INT, _COUNT = Key(int, low=1), Key(int, low=0)
_RATE = Key(float, low=0.0)
_POSITIVE = Key(float, low=0.0, low_open=True)
# Every key's type and range, checked before anything else (`validate`); keys with rules
# of their own (mesh axes: -1 allowed; pipeline.inflight: a name or an integer;
# train.inject_nan_at: a tuple) are checked there. tests/test_validation.py checks the
# table covers base_config().
SCHEMA = {
    "model.vocab_size": _POSITIVE_INT,
    "model.num_layers": _POSITIVE_INT,
    "model.d_model": _POSITIVE_INT,
    "model.num_heads": _POSITIVE_INT,
    "model.d_ff": _POSITIVE_INT,
    "model.dtype": Key(str, choices=DTYPES),
    "model.attention": Key(str, choices=ATTENTION),
    "model.param_dtype": Key(str, choices=DTYPES),
    "model.rope_base": Key(float, low=0.0, low_open=True),
    "model.init_std": Key(float, low=0.0, low_open=True),
    "model.loss_chunk": _COUNT,
    "model.num_kv_heads": _COUNT,
    "model.mlp": Key(str, choices=MLPS),
    "model.tie_embeddings": Key(bool),
    "model.norm_eps": _POSITIVE,
    "model.qkv_bias": Key(bool),
    "model.head_dim": _COUNT,
    "model.qk_norm": Key(bool),
    "model.num_experts": _COUNT,
    "model.experts_per_token": _POSITIVE_INT,
    "model.expert_d_ff": _COUNT,
    "model.shared_expert_d_ff": _COUNT,
    "model.router_renormalize": Key(bool),
    "model.moe_aux_loss": _RATE,
    "model.moe_z_loss": _RATE,
    "model.moe_capacity_factor": _RATE,
    "model.moe_dispatch": Key(str, choices=("all_gather", "all_to_all")),
    "model.document_mask": Key(bool),
    "model.rope_scaling.type": Key(str, choices=ROPE_SCALINGS),
    "model.rope_scaling.factor": _POSITIVE,
    "model.rope_scaling.low_freq_factor": _POSITIVE,
    "model.rope_scaling.high_freq_factor": _POSITIVE,
    "model.rope_scaling.original_max_position_embeddings": _POSITIVE_INT,
    "model.rope_scaling.beta_fast": _POSITIVE,
    "model.rope_scaling.beta_slow": _POSITIVE,
    "pipeline.schedule": Key(str, choices=SCHEDULES),
    "pipeline.microbatches": _POSITIVE_INT,
    "pipeline.segments": _POSITIVE_INT,
    "pipeline.partition": Key(str, choices=PARTITIONS),
    "pipeline.partition_multiple": _POSITIVE_INT,
    "pipeline.virtual_stages": _POSITIVE_INT,
    "pipeline.remat": Key(str, choices=REMAT_POLICIES),
    "pipeline.layers_per_stage": Key(str),  # "even", "flops" or counts: `_validate_pipeline`
    "train.steps": _POSITIVE_INT,
    "train.global_batch_size": _POSITIVE_INT,
    "train.seq_len": _POSITIVE_INT,
    "train.learning_rate": _RATE,
    "train.min_lr_ratio": Key(float, low=0.0, high=1.0),
    "train.warmup_steps": _COUNT,
    "train.weight_decay": _RATE,
    "train.grad_clip": _RATE,
    "train.b1": Key(float, low=0.0, high=1.0, high_open=True),  # an Adam decay rate
    "train.b2": Key(float, low=0.0, high=1.0, high_open=True),
    "train.seed": Key(int, low=0, high=2**32, high_open=True),  # grain's shuffle takes 32 bits
    "train.log_every": _POSITIVE_INT,
    "train.eval_every": _COUNT,
    "train.eval_batches": _COUNT,
    "train.stop_at": _COUNT,
    "train.max_bad_steps": _POSITIVE_INT,
    "train.shard_optimizer": Key(str, choices=("auto", "on", "off")),
    "train.init_from": Key(str),  # "" or hf:DIR: `_validate_hf`
    "checkpoint.every": _COUNT,
    "checkpoint.keep": _COUNT,
    "checkpoint.async_save": Key(bool),
    "data.source": Key(str, choices=SOURCES),
    "data.path": Key(str),
    "data.tokenizer": Key(str),  # one of TOKENIZERS, hf:DIR or a tokenizer.json: `_validate_hf`
    "data.token_dtype": Key(str, choices=("uint16", "uint32")),
    "data.eval_fraction": Key(float, low=0.0, high=1.0, low_open=True, high_open=True),
    "data.cache_dir": Key(str),
    "data.tokenizer_path": Key(str),
    "data.allow_source_change": Key(bool),
    "data.max_invalid_utf8": Key(float, low=0.0, high=1.0),
    "data.text_key": Key(str),
    "data.skip_bad_lines": Key(bool),
    "data.eod_id": Key(int, low=-1),  # below model.vocab_size: `_validate_documents`
    "data.packing": Key(str, choices=PACKINGS),
    "data.reset_positions": Key(bool),
    "mesh.tensor": _POSITIVE_INT,
    "mesh.context": _POSITIVE_INT,
}
OWN_RULES = (
    "mesh.data",
    "mesh.stage",
    "pipeline.inflight",
    "train.inject_nan_at",
    "model.dense_layers",
)


def base_config() -> ml_collections.ConfigDict:
    """Every key seqpipe reads, with defaults."""
    c = ml_collections.ConfigDict()
    c.model = _model_defaults()
    # tensor: devices each stage's layers, embedding and head are split over (Megatron-style
    # tensor parallelism with sequence parallelism, `seqpipe.parallel.tensor`).
    # context: devices each segment's positions are split over (context parallelism,
    # `seqpipe.parallel.context`), each keeping 1/context of the K/V prefix.
    c.mesh = dict(data=1, stage=1, context=1, tensor=1)
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
        # Layers per stage: "even", "flops" (fewer on the last stage, which runs the head)
        # or a comma-separated count per stage, e.g. "7,7,6,4".
        layers_per_stage="even",
    )
    c.train = _train_defaults()
    # Checkpoints under WORKDIR/checkpoints: every `every` steps (0: only at the end), the
    # newest `keep` kept (0: all), written by a background thread when async_save.
    c.checkpoint = dict(every=1000, keep=3, async_save=True)
    c.data = _data_defaults()
    return c


def _model_defaults() -> dict:
    """The model section's defaults."""
    return dict(
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
        # (O(block) memory, any backend), splash (Pallas, TPU), pallas_gpu (Pallas Triton,
        # NVIDIA GPUs), auto (the best per backend).
        attention="auto",
        # Tokens per cross-entropy chunk: the head's float32 logits are never whole
        # (`model.head_loss_sum`); 0: one chunk.
        loss_chunk=8192,
        # The Llama family (`seqpipe.models.model`'s docstring has the parameters): K/V heads
        # (grouped-query attention; 0: num_heads), the MLP ("gelu" or "swiglu"), the head
        # tied to the embedding, the RMS norms' epsilon, Q/K/V biases (Qwen 2).
        num_kv_heads=0,
        mlp="gelu",
        tie_embeddings=False,
        norm_eps=1e-6,
        qkv_bias=False,
        # Each head's width (0: d_model / num_heads) and RMSNorm of each query and key head
        # before RoPE (Qwen 3).
        head_dim=0,
        qk_norm=False,
        # A mixture of experts in every layer's MLP (`seqpipe.models.moe`; 0: dense):
        # experts, how many each token goes to, each one's width (0: d_ff), a gated shared
        # expert's width (Qwen 2 MoE; 0: none), whether the chosen experts' weights are
        # renormalized to one (Mixtral; Qwen3-MoE's norm_topk_prob), the load-balancing
        # and router z-loss coefficients; a capacity factor (0: dropless) bounds each
        # expert's assignments in a row's segment to ceil(factor x tokens x k / experts).
        num_experts=0,
        # Layers whose MLP stays dense (d_ff wide) in a mixture (HF's mlp_only_layers;
        # decoder_sparse_step n makes all but every n-th dense), e.g. (0, 1, 2).
        dense_layers=(),
        experts_per_token=2,
        expert_d_ff=0,
        shared_expert_d_ff=0,
        router_renormalize=True,
        moe_aux_loss=0.0,
        moe_z_loss=0.0,
        moe_capacity_factor=0.0,
        # How tokens reach experts split over mesh.data: all_gather (every replica's tokens
        # to every device) or all_to_all (each one to its experts' device; needs a capacity).
        moe_dispatch="all_gather",
        # On packed rows (data.packing concat or best_fit), each token attends only within
        # its document (`seqpipe.data.packing`); unpacked rows have no documents to mask by.
        document_mask=True,
        # How rotary embeddings extend a context (`seqpipe.kernels.rope`, as transformers'
        # rope_type): none, linear (factor), llama3 (factor, low_freq_factor,
        # high_freq_factor, original_max_position_embeddings), yarn (factor,
        # original_max_position_embeddings, beta_fast, beta_slow).
        rope_scaling=dict(
            type="none",
            factor=1.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
            beta_fast=32.0,
            beta_slow=1.0,
        ),
    )


def _train_defaults() -> dict:
    """The train section's defaults."""
    return dict(
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
        # The optimizer state split over mesh.data (ZeRO-1, Megatron's distributed
        # optimizer): "on", "off", or "auto" (on when mesh.data > 1). See `shards_optimizer`.
        shard_optimizer="auto",
        # hf:DIR: start from a HuggingFace checkpoint's weights (`seqpipe.hf`), whose
        # config.json must describe this model; a workdir's own checkpoint wins.
        init_from="",
    )


def _data_defaults() -> dict:
    """The data section's defaults."""
    return dict(
        source="stdlib",
        path="",
        tokenizer="bpe",  # bpe, byte, hf:DIR (its tokenizer.json) or a tokenizer.json
        token_dtype="uint16",
        eval_fraction=0.02,
        cache_dir="",
        tokenizer_path="",
        # Resume a checkpoint trained on other data (another source, path or content):
        # its weights and optimizer state go on, the new data is read from its start.
        allow_source_change=False,
        # Invalid UTF-8 in a text corpus is replaced by U+FFFD and counted; past this
        # fraction of the corpus's bytes the corpus is refused (it is not text).
        max_invalid_utf8=0.001,
        # data.source=jsonl or parquet: the field (column) that holds each document's text.
        text_key="text",
        # A JSON line that does not parse or lacks text_key (a null Parquet row) is refused,
        # naming file and line; True skips such lines, counted and reported in one line.
        skip_bad_lines=False,
        # data.source=tokens: the id that ends each document (-1: none, one stream).
        eod_id=-1,
        # Rows of seq_len + 1 tokens (`seqpipe.data.packing`): none (windows of the stream, no
        # document ids), concat (the same windows, with each token's document and
        # position) or best_fit (whole documents placed best-fit, padded at the end).
        packing="none",
        # Packed rows: positions restart at 0 at each document's start (RoPE reads them).
        reset_positions=True,
    )


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
    if path.suffix != ".py":  # importlib has no loader for it: no spec, then a traceback
        raise ConfigError(
            f"--config {path}: not a Python file; a config is a .py file defining get_config()"
        )
    spec = importlib.util.spec_from_file_location(f"seqpipe_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        config = module.get_config()
    except SystemExit as e:  # sys.exit() in a config would end the run without a word
        raise ConfigError(
            f"--config {path}: failed to load: it called sys.exit({e.code!r})"
        ) from None
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


def from_hf(spec: str) -> ml_collections.ConfigDict:
    """`--config hf:DIR`: the defaults, with the model keys of DIR/config.json, its weights
    (train.init_from) and its tokenizer when it has one."""
    from seqpipe.hf import config as hf_config  # pure Python

    try:
        where = str(hf_config.directory(spec) / "config.json")
        keys = hf_config.model_keys(hf_config.read(spec), where)
    except hf_config.HFError as e:
        raise ConfigError(str(e)) from None
    config = base_config()
    config.model.update(keys)
    config.train.init_from = spec
    if (hf_config.directory(spec) / "tokenizer.json").is_file():
        config.data.tokenizer = spec
    return config


def run_name(name: str) -> str:
    """A config's name for its default workdir (runs/NAME)."""
    if name.startswith(HF):
        return Path(name[len(HF) :]).resolve().name
    return resolve_path(name).stem


def load(name: str, overrides: dict[str, str] | None = None) -> ml_collections.ConfigDict:
    """Load a config file (or hf:DIR, `from_hf`), apply `a.b=value` overrides, and check
    the result."""
    config = from_hf(name) if name.startswith(HF) else load_file(name)
    _check_known(config, base_config())
    apply_overrides(config, overrides or {})
    validate(config)
    config.lock()
    return config


def _check_known(config, base, prefix: str = "") -> None:
    """Every section and key of `config` is one of `base`'s (nested sections too)."""
    for key in config:
        if key not in base:
            what = "config section" if not prefix else "config key"
            raise ConfigError(f"{what} {prefix}{key} is unknown; valid: {sorted(base)}")
        if isinstance(base[key], ml_collections.ConfigDict):
            if not isinstance(config[key], ml_collections.ConfigDict):
                raise ConfigError(
                    f"config key {prefix}{key} must be a section with keys {sorted(base[key])}"
                )
            _check_known(config[key], base[key], f"{prefix}{key}.")


def _lookup(config, key: str):
    """The value at dotted `key`; ConfigError naming it if a file left it out."""
    node = config
    for part in key.split("."):
        if part not in node:
            raise ConfigError(f"config key {key} is missing; a config starts from base_config()")
        node = node[part]
    return node


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _validate_experts(m, tensor: int) -> None:
    layers = m.dense_layers
    _require(
        isinstance(layers, tuple | list)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
        and len(set(layers)) == len(layers)
        and all(0 <= i < m.num_layers for i in layers),
        f"model.dense_layers={layers!r} must be a tuple of distinct layers in [0, "
        f"{m.num_layers}), e.g. (0, 1)",
    )
    if not m.num_experts:
        _require(
            not m.moe_capacity_factor,
            f"model.moe_capacity_factor={m.moe_capacity_factor} caps a mixture's experts, "
            "and model.num_experts=0; set model.num_experts or leave the factor at 0",
        )
        _require(
            not layers,
            f"model.dense_layers={tuple(layers)} names a mixture's dense layers, and "
            "model.num_experts=0; set model.num_experts or leave model.dense_layers empty",
        )
        return
    _require(
        m.moe_dispatch != "all_to_all" or m.moe_capacity_factor > 0,
        "model.moe_dispatch=all_to_all sends each expert a buffer its capacity bounds; set "
        "model.moe_capacity_factor > 0 (e.g. 1.25), or dispatch by all_gather, dropless",
    )
    _require(
        len(layers) < m.num_layers,
        f"model.dense_layers makes all {m.num_layers} layers dense; set model.num_experts=0 "
        "for a dense model",
    )
    _require(
        m.experts_per_token <= m.num_experts,
        f"model.experts_per_token={m.experts_per_token} is more than model.num_experts="
        f"{m.num_experts}; choose at most {m.num_experts} experts per token",
    )
    _require(
        m.mlp == "swiglu",
        f"model.num_experts={m.num_experts} runs swiglu experts; set model.mlp=swiglu",
    )
    width = m.expert_d_ff or m.d_ff
    _require(
        width % tensor == 0,
        f"each expert's width {width} (model.expert_d_ff, or model.d_ff) is not divisible by "
        f"mesh.tensor={tensor}, which splits it; change one of them",
    )
    _require(
        m.shared_expert_d_ff % tensor == 0,
        f"model.shared_expert_d_ff={m.shared_expert_d_ff} is not divisible by mesh.tensor="
        f"{tensor}, which splits it; change one of them",
    )


def validate(config: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
    """Check everything that can be checked before any device work; raise ConfigError.

    Without num_devices a mesh axis may still be -1; `resolve` fixes it and checks again."""
    m, mesh, p, t, d = config.model, config.mesh, config.pipeline, config.train, config.data
    for key, rule in SCHEMA.items():  # types and ranges first: later checks rely on them
        message = rule.error(key, _lookup(config, key))
        _require(message is None, message)
    _validate_llama(m, mesh.tensor)
    _require(
        m.head_dim or m.d_model % m.num_heads == 0,
        f"model.num_heads={m.num_heads} must divide model.d_model={m.d_model} (or set "
        "model.head_dim)",
    )
    width = m.head_dim or m.d_model // m.num_heads
    _require(
        width % 2 == 0,
        f"each head's width {width} (model.head_dim, or model.d_model / model.num_heads) "
        "must be even for rotary embeddings; change model.num_heads or model.head_dim",
    )
    _validate_experts(m, mesh.tensor)
    tensor = mesh.tensor
    for key, size in (("num_heads", m.num_heads), ("d_ff", m.d_ff), ("vocab_size", m.vocab_size)):
        _require(
            size % tensor == 0,
            f"model.{key}={size} is not divisible by mesh.tensor={tensor}, which splits it; "
            "change one of them",
        )
    # An axis still at -1 skips the checks that need its size.
    sizes = mesh_sizes(mesh, num_devices)
    data, stage = sizes["data"], sizes["stage"]
    if m.num_experts and data > 1:
        fits = max(n for n in range(1, data + 1) if m.num_experts % n == 0)
        _require(
            m.num_experts % data == 0,
            f"model.num_experts={m.num_experts} is not divisible by mesh.data={data}, over "
            f"which the experts are split; set mesh.data to a divisor of it (e.g. {fits})",
        )
    context = mesh.get("context", 1)
    _require(
        p.schedule != "none" or context == 1,
        f"mesh.context={context} splits each segment over devices inside the pipeline; set "
        f"pipeline.schedule (one of {list(SCHEDULES[1:])}, seq1f1b with mesh.stage=1 for no "
        "stages) or mesh.context=1",
    )
    _require(
        p.schedule != "none" or stage in (1, -1),
        f"mesh.stage={stage} needs a pipeline schedule; set pipeline.schedule "
        f"(one of {list(SCHEDULES[1:])}) or mesh.stage=1",
    )
    inflight = p.inflight
    _require(
        inflight in ("minimal", "full")
        or (isinstance(inflight, int) and not isinstance(inflight, bool) and inflight >= 1),
        f"pipeline.inflight={inflight!r} is not valid; use 'minimal', 'full' or a positive integer",
    )
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
    _require(
        isinstance(t.inject_nan_at, tuple | list)
        and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in t.inject_nan_at),
        f"train.inject_nan_at={t.inject_nan_at!r} must be a tuple of steps >= 1, e.g. (3, 4)",
    )
    _require(
        not (t.eval_every and not t.eval_batches),
        f"train.eval_every={t.eval_every} with train.eval_batches=0 would never evaluate; set "
        "train.eval_batches >= 1, or train.eval_every=0 for no evaluation",
    )
    _require(
        d.source == "stdlib" or d.path,
        f"data.source={d.source!r} needs data.path (a file, directory or glob)",
    )
    _require(
        not (d.source == "tokens" and d.tokenizer == "byte"),
        "data.tokenizer=byte does nothing with data.source=tokens (its ids are read as they "
        "are); leave data.tokenizer=bpe, with data.tokenizer_path to check the ids against a "
        "BPE",
    )
    _validate_hf(config)
    _validate_documents(d, m.vocab_size)
    _require(
        d.tokenizer != "byte" or m.vocab_size >= 256,
        f"model.vocab_size={m.vocab_size} is below 256, the byte tokenizer's size",
    )


def _validate_documents(d: ml_collections.ConfigDict, vocab_size: int) -> None:
    """Where documents come from and end: text_key, eod_id and packing's needs."""
    keyed = d.source in TEXT_KEY_SOURCES
    _require(
        not keyed or d.text_key,
        f"data.source={d.source} needs data.text_key, the field that holds each document's "
        "text (e.g. text)",
    )
    # Only a value other than the default can be told apart from one left as it is.
    default = _data_defaults()["text_key"]
    _require(
        keyed or d.text_key == default,
        f"data.text_key={d.text_key!r} is for data.source=jsonl or parquet (the field or "
        f"column that holds each document's text); data.source={d.source} has no fields: "
        f"leave data.text_key={default}, or set data.source",
    )
    _require(
        d.eod_id == -1 or d.source == "tokens",
        f"data.eod_id={d.eod_id} is for data.source=tokens; data.source={d.source} ends each "
        "document with the tokenizer's own end token: leave data.eod_id=-1",
    )
    _require(
        d.eod_id < vocab_size,
        f"data.eod_id={d.eod_id} is not below model.vocab_size={vocab_size}; give the id "
        "that ends each document in data.path",
    )
    _require(
        d.packing == "none" or d.source != "tokens" or d.eod_id >= 0,
        f"data.packing={d.packing} with data.source=tokens needs data.eod_id, the id that "
        "ends each document; or data.packing=none",
    )


def _validate_hf(config: ml_collections.ConfigDict) -> None:
    """data.tokenizer names a tokenizer; train.init_from=hf:DIR a readable HF model whose
    every model key is ours."""
    kind = config.data.tokenizer
    _require(
        kind in TOKENIZERS or kind.startswith(HF) or kind.endswith(".json"),
        f"data.tokenizer={kind!r} is not valid; choose one of {list(TOKENIZERS)}, "
        "hf:DIR (its tokenizer.json) or a path to a tokenizer.json",
    )
    spec = config.train.init_from
    if not spec:
        return
    _require(
        spec.startswith(HF), f"train.init_from={spec!r} is not valid; give hf:DIR (a HF model)"
    )
    from seqpipe.hf import config as hf_config  # pure Python

    try:
        message = hf_config.mismatch(config.model, spec)
    except hf_config.HFError as e:
        raise ConfigError(f"train.init_from={spec}: {e}") from None
    _require(message is None, f"train.init_from={spec}: {message}")


def _validate_llama(m, tensor: int) -> None:
    """Grouped-query heads, their split over mesh.tensor, and llama3's frequency band."""
    kv = m.num_kv_heads or m.num_heads
    _require(
        m.num_heads % kv == 0,
        f"model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads} "
        "(each K/V head serves a group of query heads)",
    )
    _require(
        kv % tensor == 0 or tensor % kv == 0,
        f"mesh.tensor={tensor} neither divides the {kv} K/V heads (model.num_kv_heads) nor "
        "is a multiple of them (each device then holds the one its query heads read); "
        "change one of them",
    )
    r = m.rope_scaling
    _require(
        r.type != "llama3" or r.high_freq_factor > r.low_freq_factor,
        f"model.rope_scaling.high_freq_factor={r.high_freq_factor} must exceed "
        f"model.rope_scaling.low_freq_factor={r.low_freq_factor} for llama3 scaling",
    )


def mesh_sizes(mesh: ml_collections.ConfigDict, num_devices: int | None = None) -> dict:
    """{'data': d, 'stage': s} with an axis at -1 given the devices the other leaves (and
    mesh.context and mesh.tensor) when num_devices is known (else it stays -1);
    ConfigError if no split of the devices fits."""
    sizes = {axis: mesh[axis] for axis in MESH_AXES}
    inner = {axis: mesh.get(axis, 1) for axis in ("context", "tensor")}
    inner = {axis: size for axis, size in inner.items() if size > 1}
    per_group = math.prod(inner.values())
    times = "".join(f" * mesh.{axis}" for axis in inner)
    for axis, size in sizes.items():
        _require(
            isinstance(size, int) and not isinstance(size, bool) and (size >= 1 or size == -1),
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
    fixed = math.prod(size for size in sizes.values() if size != -1) * per_group
    if not open_axes:
        _require(
            fixed == num_devices,
            f"mesh.data * mesh.stage{times} = {fixed} but {num_devices} devices are visible; "
            "set the mesh axes so their product matches, or mesh.data or mesh.stage to -1",
        )
        return sizes
    (open_axis,) = open_axes
    (other,) = (axis for axis in MESH_AXES if axis != open_axis)
    named = f"mesh.{other}{times}"
    _require(
        num_devices % fixed == 0,
        f"{named}{'=' if not inner else ' = '}{fixed} does not divide the {num_devices} "
        f"visible devices (mesh.{open_axis}=-1 takes what {named} leaves); set {named} to a "
        f"divisor of {num_devices}",
    )
    sizes[open_axis] = num_devices // fixed
    return sizes


def shards_optimizer(config: ml_collections.ConfigDict) -> bool:
    """Whether each data replica keeps and updates only its 1/mesh.data of the optimizer
    state (`seqpipe.parallel.sharding.state_shardings`). "auto" turns it on wherever there is more
    than one replica: gradients are reduce-scattered instead of all-reduced and the new
    parameters all-gathered, the same bytes on the wire as one all-reduce, and the
    update's arithmetic and the moments' memory fall by 1/mesh.data."""
    mode, data = config.train.shard_optimizer, config.mesh.data
    return mode == "on" or (mode == "auto" and data > 1)


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
    from seqpipe.schedule import partition  # pure Python, cheap

    m, p = config.model, config.pipeline
    chunks = stages * p.virtual_stages
    split = p.layers_per_stage
    _require(
        split != "even" or m.num_layers % chunks == 0,
        f"model.num_layers={m.num_layers} must be divisible by mesh.stage * "
        f"pipeline.virtual_stages = {chunks}; or split layers unevenly with "
        "pipeline.layers_per_stage=flops",
    )
    try:
        partition.stage_layers(
            split,
            m.num_layers,
            stages,
            p.virtual_stages,
            seq_len=config.train.seq_len,
            **partition.model_dims(m, with_layers=False),
        )
    except ValueError as e:
        raise ConfigError(f"pipeline.layers_per_stage={split}: {e}") from None
    try:
        partition.segment_lengths(
            config.train.seq_len,
            p.segments,
            p.partition,
            multiple=partition.segment_multiple(config),
            **partition.model_dims(m),
        )
    except ValueError as e:
        setting = (
            f"train.seq_len={config.train.seq_len}, pipeline.segments={p.segments}, "
            f"pipeline.partition={p.partition}, pipeline.partition_multiple="
            f"{p.partition_multiple}"
        )
        context = config.mesh.get("context", 1)
        if context > 1:  # each segment is 2C pieces (`seqpipe.parallel.context`)
            setting += f", mesh.context={context}"
        if config.mesh.tensor > 1:  # each segment splits evenly over the tensor devices
            setting += f", mesh.tensor={config.mesh.tensor}"
        why = ""
        if context > 1:
            why = f" (with mesh.context={context} each segment is {2 * context} equal pieces"
            why += ", each a multiple of pipeline.partition_multiple" * (p.partition_multiple > 1)
            why += ", a device's two split over mesh.tensor" * (config.mesh.tensor > 1) + ")"
        raise ConfigError(f"{setting}: {e}{why}; change one of these keys") from None
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
