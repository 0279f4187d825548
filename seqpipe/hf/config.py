"""A HuggingFace `config.json` as seqpipe's `model.` keys and back, for the Llama family
(Llama, Mistral, Qwen 2 and 3, Arcee) and its mixtures of experts (Mixtral, Qwen3-MoE,
Qwen 2 MoE with its shared expert).

seqpipe's GPT (`model.mlp=gelu`: RMSNorm, RoPE, a non-gated tanh-GELU MLP) is transformers'
Arcee with `hidden_act: gelu_pytorch_tanh`: a Llama whose MLP is `up_proj`, `down_proj`.

No jax here: `seqpipe.run.config` reads `--config hf:DIR` and checks `train.init_from` with it
before any device work. The weights are `seqpipe.hf`'s.

Rope settings are read from transformers 5's `rope_parameters` or 4.x's `rope_theta` and
`rope_scaling`, and written in both forms: transformers 4.x reads only the older keys and,
without them, silently falls back to theta 10000 without scaling.
"""

import json
import math
from collections.abc import Mapping
from pathlib import Path

PREFIX = "hf:"
# architecture: (model_type, whether Q, K and V carry biases, model.mlp, model.qk_norm,
# whether every layer's MLP is a mixture of experts, whether it has a shared expert)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False, "swiglu", False, False, False),
    "MistralForCausalLM": ("mistral", False, "swiglu", False, False, False),
    "Qwen2ForCausalLM": ("qwen2", True, "swiglu", False, False, False),
    "Qwen3ForCausalLM": ("qwen3", False, "swiglu", True, False, False),
    "ArceeForCausalLM": ("arcee", False, "gelu", False, False, False),
    "MixtralForCausalLM": ("mixtral", False, "swiglu", False, True, False),
    "Qwen3MoeForCausalLM": ("qwen3_moe", False, "swiglu", True, True, False),
    "Qwen2MoeForCausalLM": ("qwen2_moe", True, "swiglu", False, True, True),
}
SUPPORTED = tuple(ARCHITECTURES)
# The experts' settings: (each expert's width key, model.router_renormalize: True, or
# the key that says). The expert count is num_local_experts (transformers 5 writes it for
# Mixtral and Qwen3-MoE) or num_experts (Qwen's own checkpoints, Qwen 2 MoE's).
EXPERTS = {
    "MixtralForCausalLM": ("intermediate_size", True),
    "Qwen3MoeForCausalLM": ("moe_intermediate_size", "norm_topk_prob"),
    "Qwen2MoeForCausalLM": ("moe_intermediate_size", "norm_topk_prob"),
}
# The shared expert's width key (model.shared_expert_d_ff), where there is one.
SHARED = {"Qwen2MoeForCausalLM": "shared_expert_intermediate_size"}
# model_type: what seqpipe's model lacks to run it, for models near those it reads.
MISSING = {
    "deepseek_v2": "multi-head latent attention",
    "deepseek_v3": "multi-head latent attention",
}
# model.mlp: the hidden_act values that run it (the first is written), and the
# architectures' default where config.json has none
ACTIVATIONS = {"swiglu": ("silu",), "gelu": ("gelu_pytorch_tanh", "gelu_new")}
DEFAULT_ACTIVATION = {"arcee": "relu2"}  # the others: silu
# Keys read as integers and as numbers: a string ("128") is refused by its type.
INTEGERS = (
    "vocab_size",
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "head_dim",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "decoder_sparse_step",
)
NUMBERS = ("rms_norm_eps", "rope_theta", "router_aux_loss_coef", "router_jitter_noise")
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}
# The rope_scaling fields each type reads (seqpipe.kernels.rope.RopeScaling's names, as HF's).
ROPE_FIELDS = {
    "none": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"),
}
ROPE_DEFAULTS = {
    "factor": 1.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}


class HFError(ValueError):
    """A HuggingFace directory seqpipe cannot use; the message is one line saying why."""


def directory(spec: str) -> Path:
    """The directory of `hf:DIR` (or of a bare DIR)."""
    return Path(spec[len(PREFIX) :] if spec.startswith(PREFIX) else spec)


def read(spec: str) -> dict:
    """DIR/config.json as a dict; HFError if it is missing or not JSON."""
    path = directory(spec) / "config.json"
    if not path.is_file():
        raise HFError(
            f"{path.parent} has no config.json: not a HuggingFace model directory "
            "(save_pretrained writes config.json and model.safetensors)"
        )
    try:
        hf = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(hf, dict):
        raise HFError(f"{path} is not a JSON object")
    return hf


def architecture(hf: Mapping, where: str) -> str:
    """The architecture, which model_type (where given) must agree with: a Mixtral or
    GPT-2 config under a Llama name would otherwise run as a Llama."""
    names = hf.get("architectures") or []
    name = names[0] if len(names) == 1 else None
    if name not in ARCHITECTURES:
        shown = ", ".join(map(str, names)) if names else "none"
        missing = MISSING.get(hf.get("model_type"))
        lacks = f" (seqpipe's model has no {missing})" if missing else ""
        raise HFError(
            f"{where}: architecture {shown} is not supported{lacks}; seqpipe reads "
            f"{', '.join(SUPPORTED)}"
        )
    model_type = ARCHITECTURES[name][0]
    if hf.get("model_type", model_type) != model_type:
        raise HFError(
            f"{where}: model_type {hf['model_type']!r} is not {name}'s ({model_type!r}); "
            "the file describes another model: fix whichever of the two is wrong"
        )
    return name


def _types(hf: Mapping, where: str) -> None:
    """Integers and numbers of their JSON type (bool is not a number here)."""
    for keys, kind, types in (
        (INTEGERS, "an integer", (int,)),
        (NUMBERS, "a number", (int, float)),
    ):
        for key in keys:
            value = hf.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
                raise HFError(f"{where}: {key}={value!r} is a {type(value).__name__}, not {kind}")


def _need(hf: Mapping, key: str, where: str):
    if key not in hf or hf[key] is None:
        raise HFError(f"{where} has no {key}")
    return hf[key]


# Where a sliding_window is used whenever set (elsewhere use_sliding_window says).
SLIDING = ("MistralForCausalLM", "MixtralForCausalLM")
WHY = {
    # Training-time noise (Mixtral's): refused rather than ignored, so that a run on
    # these weights trains as they were trained or not at all.
    "router_jitter_noise": "its router adds no noise",
    "decoder_sparse_step": "every n-th layer is sparse, n at least 1",
    "qkv_bias": "seqpipe reads Qwen 2 MoE with Q, K and V biases",
    "shared_expert_intermediate_size": "its shared expert is at least 1 wide",
}


def _refuse(hf: Mapping, where: str, arch: str) -> None:
    """The settings of these architectures that seqpipe's model does not run."""
    mlp = ARCHITECTURES[arch][2]
    activation = hf.get("hidden_act") or DEFAULT_ACTIVATION.get(ARCHITECTURES[arch][0], "silu")
    if activation not in ACTIVATIONS[mlp]:
        raise HFError(
            f"{where}: hidden_act={activation!r} is not supported by seqpipe's model; "
            f"{arch} runs {', '.join(ACTIVATIONS[mlp])}"
        )
    unsupported = {
        "attention_bias": lambda v: bool(v) and not ARCHITECTURES[arch][1],  # o_proj too
        "mlp_bias": bool,
        "use_sliding_window": bool,
        "sliding_window": lambda v: v is not None and arch in SLIDING,
        "layer_types": lambda v: any(t != "full_attention" for t in v or ()),
        "router_jitter_noise": bool,
        "decoder_sparse_step": lambda v: v < 1,
        "qkv_bias": lambda v: not v and ARCHITECTURES[arch][1],  # Qwen 2 MoE's key
        "shared_expert_intermediate_size": lambda v: v is not None and v < 1,
    }
    for key, bad in unsupported.items():
        if key in hf and bad(hf[key]):
            why = f"; {WHY[key]}" if key in WHY else ""
            raise HFError(f"{where}: {key}={hf[key]!r} is not supported by seqpipe's model{why}")


def rope(hf: Mapping, where: str) -> tuple[float, dict]:
    """(theta, the rope_scaling section) from either generation's keys."""
    params = hf.get("rope_parameters") or {}
    legacy = hf.get("rope_scaling") or {}
    source = params if params.get("rope_type") else legacy
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = source.get("rope_type") or source.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise HFError(
            f"{where}: rope type {kind!r} is not supported; seqpipe runs {', '.join(ROPE_TYPES)}"
        )
    scaling = {"type": ROPE_TYPES[kind], **ROPE_DEFAULTS}
    for field in ROPE_FIELDS[scaling["type"]]:
        value = source.get(field)
        if value is None and field == "original_max_position_embeddings":
            value = hf.get("max_position_embeddings")
        if value is not None:
            scaling[field] = type(ROPE_DEFAULTS[field])(value)
    if kind == "yarn":
        extra = {k: source.get(k) for k in ("attention_factor", "mscale", "mscale_all_dim")}
        extra = {k: v for k, v in extra.items() if v is not None}
        if extra or source.get("truncate", True) is not True:
            raise HFError(f"{where}: yarn with {extra or 'truncate=false'} is not supported")
    if float(source.get("partial_rotary_factor", 1.0)) != 1.0:
        raise HFError(f"{where}: partial_rotary_factor is not supported")
    return float(theta), scaling


def model_keys(hf: Mapping, where: str = "config.json") -> dict:
    """seqpipe's `model.` keys from a HF config (HFError for what seqpipe cannot run)."""
    arch = architecture(hf, where)
    for key in ("vocab_size", "num_hidden_layers", "hidden_size", "num_attention_heads"):
        _need(hf, key, where)
    _need(hf, "intermediate_size", where)
    _types(hf, where)
    _refuse(hf, where, arch)
    theta, scaling = rope(hf, where)
    heads, width = hf["num_attention_heads"], hf["hidden_size"]
    keys = {
        "vocab_size": int(hf["vocab_size"]),
        "num_layers": int(hf["num_hidden_layers"]),
        "d_model": int(hf["hidden_size"]),
        "num_heads": int(heads),
        "num_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "d_ff": int(hf["intermediate_size"]),
        "mlp": ARCHITECTURES[arch][2],
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "qkv_bias": ARCHITECTURES[arch][1],
        "head_dim": int(hf.get("head_dim") or width // heads),
        "qk_norm": ARCHITECTURES[arch][3],
        "rope_base": theta,
        "rope_scaling": scaling,
        "num_experts": 0,
        "shared_expert_d_ff": 0,
        "dense_layers": (),
    }
    if arch in EXPERTS:
        keys.update(_experts(hf, where, arch))
    return keys


def _experts(hf: Mapping, where: str, arch: str) -> dict:
    """The `model.` keys of a mixture of experts in every layer."""
    count = hf.get("num_local_experts", hf.get("num_experts"))
    if count is None:
        raise HFError(f"{where} has no num_local_experts (or num_experts)")
    width, renormalize = EXPERTS[arch]
    keys = {
        "num_experts": int(count),
        "experts_per_token": int(_need(hf, "num_experts_per_tok", where)),
        "expert_d_ff": int(_need(hf, width, where)),
        "router_renormalize": renormalize is True or bool(hf.get(renormalize, False)),
        "moe_aux_loss": float(hf.get("router_aux_loss_coef", 0.001)),  # transformers' default
    }
    if arch in SHARED:
        keys["shared_expert_d_ff"] = int(_need(hf, SHARED[arch], where))
    keys["dense_layers"] = _dense_layers(hf, where)
    return keys


def _dense_layers(hf: Mapping, where: str) -> tuple[int, ...]:
    """The layers whose MLP is dense, as Qwen's MoE models place them: layer i is sparse
    unless it is in mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step."""
    only, step = hf.get("mlp_only_layers") or [], hf.get("decoder_sparse_step") or 1
    if not isinstance(only, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in only
    ):
        raise HFError(f"{where}: mlp_only_layers={only!r} is not a list of layer numbers")
    layers = hf["num_hidden_layers"]
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    if len(dense) == layers:
        raise HFError(
            f"{where}: mlp_only_layers={only} and decoder_sparse_step={step} make every layer "
            "dense: a model without experts, which seqpipe reads only as a dense architecture"
        )
    return dense


def _effective(key: str, value, keys: Mapping):
    """A key's value as the model reads it: num_kv_heads 0 is num_heads; rope_scaling
    only the fields its type reads."""
    if key == "num_kv_heads":
        return value or keys["num_heads"]
    if key == "head_dim":
        return value or keys["d_model"] // keys["num_heads"]
    if key == "expert_d_ff":
        return value or keys["d_ff"]
    if key == "dense_layers":
        return tuple(value)
    if key == "rope_scaling":
        s = dict(value)
        return (s.get("type", "none"), *(s.get(f) for f in ROPE_FIELDS[s.get("type", "none")]))
    if isinstance(value, float):
        return float(f"{value:.9g}")  # 1e-5 written as 1e-05, or a float32 round trip
    return value


# What a run may set otherwise than the checkpoint: a context extension's rope, and the
# load-balancing loss's coefficient (a training choice, not the weights').
EXTENSIBLE = ("rope_base", "rope_scaling", "moe_aux_loss")


def mismatch(model: Mapping, spec: str) -> str | None:
    """None if the config's `model.` keys are those of `spec`'s config.json (`EXTENSIBLE`
    aside), else one line naming the first key that differs and both values."""
    path = directory(spec) / "config.json"
    theirs = model_keys(read(spec), str(path))
    for key, value in theirs.items():
        if key in EXTENSIBLE:
            continue
        ours = model.get(key)
        if ours is None:
            return f"model.{key} is not a key of this seqpipe, and {path} needs {value!r}"
        if key == "rope_scaling":
            ours = dict(ours)
        if _effective(key, ours, model) != _effective(key, value, theirs):
            return (
                f"model.{key}={ours!r} but {path} has {value!r}; its weights need "
                f"model.{key}={value!r}"
            )
    return None


def _rope_keys(model: Mapping) -> dict:
    """{key: value} of the rope settings the model reads, rope_scaling's by field."""
    scaling = dict(model["rope_scaling"])
    kind = scaling.get("type", "none")
    keys = {"rope_base": float(model["rope_base"]), "rope_scaling.type": kind}
    keys.update({f"rope_scaling.{f}": scaling.get(f, ROPE_DEFAULTS[f]) for f in ROPE_FIELDS[kind]})
    return keys


def rope_change(model: Mapping, spec: str) -> str | None:
    """A line saying how the config's rope differs from `spec`'s (a context extension:
    continued pretraining at a longer context), or None."""
    before, after = _rope_keys(model_keys(read(spec))), _rope_keys(model)
    changed = [
        f"model.{k} {before.get(k, '-')} -> {v}" for k, v in after.items() if before.get(k) != v
    ]
    return f"{', '.join(changed)} (the checkpoint's rope extended)" if changed else None


def writes(model: Mapping) -> str:
    """The architecture seqpipe's `model.` keys export as; HFError where none fits."""
    experts = bool(model.get("num_experts"))
    shared = experts and bool(model.get("shared_expert_d_ff"))  # dense: no experts to share
    ours = (model["qkv_bias"], model["mlp"], model.get("qk_norm", False), experts, shared)
    fits = [
        a
        for a, (_, *kind) in ARCHITECTURES.items()
        if tuple(kind) == ours
        # Mixtral always renormalizes the chosen experts' weights, and has no dense layers
        and not (
            experts
            and EXPERTS[a][1] is True
            and (not model["router_renormalize"] or model.get("dense_layers"))
        )
    ]
    if not fits:
        settings = [f"model.qkv_bias={model['qkv_bias']}"] + ["model.qk_norm=True"] * ours[2]
        if experts:
            settings += [
                f"model.num_experts={model['num_experts']}",
                f"model.router_renormalize={model['router_renormalize']}",
            ]
        if shared:
            settings.append(f"model.shared_expert_d_ff={model['shared_expert_d_ff']}")
        if experts and model.get("dense_layers"):
            settings.append(f"model.dense_layers={tuple(model['dense_layers'])}")
        raise HFError(
            f"model.mlp={model['mlp']} with {' and '.join(settings)} has no HuggingFace "
            f"architecture seqpipe writes ({', '.join(SUPPORTED)})"
        )
    return fits[0]


def hf_config(model: Mapping, dtype: str, base: Mapping | None = None, context: int = 0) -> dict:
    """A config.json for seqpipe's `model.` keys, its tensors in `dtype`: Llama, Qwen 2
    where Q, K and V carry biases, Qwen 3 with q_norm and k_norm, Arcee for GPT's MLP,
    Mixtral, Qwen3-MoE (q_norm, k_norm) or Qwen 2 MoE (biases, a shared expert) with
    experts (or `base`'s architecture, where it fits, whose other keys it keeps).
    max_position_embeddings: at least `context` (the longest sequence trained on)."""
    arch = writes(model)
    if base and base.get("architectures") and ARCHITECTURES.get(base["architectures"][0]):
        if ARCHITECTURES[base["architectures"][0]][1:] == ARCHITECTURES[arch][1:]:
            arch = base["architectures"][0]
    scaling = dict(model["rope_scaling"])
    kind = scaling.get("type", "none")
    fields = {f: scaling.get(f, ROPE_DEFAULTS[f]) for f in ROPE_FIELDS[kind]}
    hf_kind = {v: k for k, v in ROPE_TYPES.items()}[kind]
    out = {k: v for k, v in (base or {}).items() if k not in ("rope_scaling", "rope_parameters")}
    out.update(
        architectures=[arch],
        model_type=ARCHITECTURES[arch][0],
        vocab_size=model["vocab_size"],
        num_hidden_layers=model["num_layers"],
        hidden_size=model["d_model"],
        num_attention_heads=model["num_heads"],
        num_key_value_heads=model["num_kv_heads"] or model["num_heads"],
        head_dim=model.get("head_dim") or model["d_model"] // model["num_heads"],
        intermediate_size=model["d_ff"],
        hidden_act=ACTIVATIONS[model["mlp"]][0],
        rms_norm_eps=model["norm_eps"],
        tie_word_embeddings=model["tie_embeddings"],
        rope_theta=model["rope_base"],
        # transformers 4.x reads these two; 5 reads rope_parameters
        rope_scaling=None if kind == "none" else {"rope_type": hf_kind, "type": hf_kind, **fields},
        rope_parameters={"rope_theta": model["rope_base"], "rope_type": hf_kind, **fields},
        dtype=dtype,
        torch_dtype=dtype,
    )
    for key in ("bos_token_id", "eos_token_id"):
        # Unknown unless `base` says: transformers would fill in its architecture's defaults
        # (Arcee's 128000 and 128001), ids of some other tokenizer.
        out.setdefault(key, None)
    out["max_position_embeddings"] = max(
        out.get("max_position_embeddings") or _max_positions(scaling), context
    )
    if arch in ("LlamaForCausalLM", "ArceeForCausalLM"):
        out.update(attention_bias=False, mlp_bias=False)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        out.update(use_sliding_window=False)
    if arch == "Qwen3ForCausalLM":
        out.update(attention_bias=False)
    if arch in EXPERTS:
        width, renormalize = EXPERTS[arch]
        out.update(
            num_local_experts=model["num_experts"],
            num_experts_per_tok=model["experts_per_token"],
            router_aux_loss_coef=model["moe_aux_loss"],
        )
        out[width] = model["expert_d_ff"] or model["d_ff"]  # Mixtral's intermediate_size
        if renormalize is not True:
            out[renormalize] = model["router_renormalize"]
        out.setdefault("output_router_logits", False)
    if arch == "MixtralForCausalLM":
        out.update(sliding_window=None, router_jitter_noise=0.0)
    if arch == "Qwen3MoeForCausalLM":
        # num_experts too: transformers 4.x and Qwen's own checkpoints name the count so
        out.update(
            num_experts=model["num_experts"],
            decoder_sparse_step=1,
            mlp_only_layers=list(model.get("dense_layers", ())),
            use_sliding_window=False,
            attention_bias=False,
        )
    if arch == "Qwen2MoeForCausalLM":
        # its config names the count num_experts alone (no num_local_experts attribute)
        del out["num_local_experts"]
        out.update(
            num_experts=model["num_experts"],
            shared_expert_intermediate_size=model["shared_expert_d_ff"],
            qkv_bias=True,
            decoder_sparse_step=1,
            mlp_only_layers=list(model.get("dense_layers", ())),
            use_sliding_window=False,
        )
    return out


def _max_positions(scaling: Mapping) -> int:
    """A context to declare when nothing else says: the scaled one, or 8192."""
    if scaling.get("type", "none") in ("llama3", "yarn"):
        return int(math.ceil(scaling["original_max_position_embeddings"] * scaling["factor"]))
    return 8192
