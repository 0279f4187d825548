"""HuggingFace checkpoints in and out: safetensors tensors <-> seqpipe's parameters.

    python -m seqpipe.hf export --workdir W [--step N] --out DIR

HF's `nn.Linear` weights are [out, in]; seqpipe's are [in, out] with the heads as their
own axes (`seqpipe.models.model`): wq [D, H, E] is q_proj.weight [H*E, D] transposed and split.
Both rotate the first half of each head with the second (`rotate_half`), so no row is
permuted. A mixture of experts stores each expert's matrices apart (Mixtral's
`block_sparse_moe.experts.{j}.w1`, Qwen3-MoE's and Qwen 2 MoE's `mlp.experts.{j}.gate_proj`),
which seqpipe stacks on an axis after the layers'; Qwen 2 MoE's shared expert is one per
layer (`mlp.shared_expert.gate_proj`, its gate `mlp.shared_expert_gate` [1, D]). Tensors
are read lazily, block by block (`safe_open(...).get_slice`): a process reads only the
slices its devices hold, layers and experts included (`initial_params`).
"""

import dataclasses
import itertools
import json
import math
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (numpy's bfloat16, which safetensors' numpy reader needs)
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from seqpipe.hf.config import PREFIX, HFError, architecture, hf_config, model_keys, read, writes
from seqpipe.models import model
from seqpipe.models.model import GPTConfig

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size
# safetensors dtype: numpy dtype name
DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
# Tensors in HF files that seqpipe's model has no use for and that change nothing.
IGNORED = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class Tensor:
    """How one seqpipe parameter lies in HF's files: `name` (each {} a leading axis of the
    parameter that HF keeps as tensors apart: the layer, then the expert), whether each
    tensor is stored transposed, and `groups`: how many of seqpipe's other axes make up
    each of HF's (read in seqpipe's order), so [D, H, E] is (1, 2) of [H*E, D] transposed;
    a group of 0 is an axis of one that HF has and seqpipe not ([D] is (0, 1) of [1, D])."""

    name: str
    transposed: bool
    groups: tuple[int, ...]

    @property
    def stacked(self) -> int:
        """The parameter's leading axes that run over HF tensors (layers, experts)."""
        return self.name.count("{}")


_L = "model.layers.{}."
TENSORS = {
    "embed": Tensor("model.embed_tokens.weight", False, (1, 1)),
    "head": Tensor("lm_head.weight", True, (1, 1)),
    "final_norm": Tensor("model.norm.weight", False, (1,)),
    "attn_norm": Tensor(_L + "input_layernorm.weight", False, (1,)),
    "mlp_norm": Tensor(_L + "post_attention_layernorm.weight", False, (1,)),
    "wq": Tensor(_L + "self_attn.q_proj.weight", True, (1, 2)),
    "wk": Tensor(_L + "self_attn.k_proj.weight", True, (1, 2)),
    "wv": Tensor(_L + "self_attn.v_proj.weight", True, (1, 2)),
    "wo": Tensor(_L + "self_attn.o_proj.weight", True, (2, 1)),
    "bq": Tensor(_L + "self_attn.q_proj.bias", False, (2,)),
    "bk": Tensor(_L + "self_attn.k_proj.bias", False, (2,)),
    "bv": Tensor(_L + "self_attn.v_proj.bias", False, (2,)),
    "q_norm": Tensor(_L + "self_attn.q_norm.weight", False, (1,)),
    "k_norm": Tensor(_L + "self_attn.k_norm.weight", False, (1,)),
    "w_gate": Tensor(_L + "mlp.gate_proj.weight", True, (1, 1)),
    "w_in": Tensor(_L + "mlp.up_proj.weight", True, (1, 1)),
    "w_out": Tensor(_L + "mlp.down_proj.weight", True, (1, 1)),
}


def _experts(block: str, gate: str, up: str, down: str) -> dict:
    """A mixture of experts' tensors: `block`.gate is the router, `block`.experts.{j} the
    experts' matrices."""
    e = _L + block + ".experts.{}."
    return {
        "router": Tensor(_L + block + ".gate.weight", True, (1, 1)),
        "e_gate": Tensor(e + gate + ".weight", True, (1, 1)),
        "e_in": Tensor(e + up + ".weight", True, (1, 1)),
        "e_out": Tensor(e + down + ".weight", True, (1, 1)),
    }


# Qwen 2 MoE's shared expert, one per layer, and its sigmoid gate
SHARED = {
    "s_gate": Tensor(_L + "mlp.shared_expert.gate_proj.weight", True, (1, 1)),
    "s_in": Tensor(_L + "mlp.shared_expert.up_proj.weight", True, (1, 1)),
    "s_out": Tensor(_L + "mlp.shared_expert.down_proj.weight", True, (1, 1)),
    "s_router": Tensor(_L + "mlp.shared_expert_gate.weight", False, (0, 1)),
}

# architecture: its tensors besides TENSORS
EXPERTS = {
    "MixtralForCausalLM": _experts("block_sparse_moe", "w1", "w3", "w2"),
    "Qwen3MoeForCausalLM": _experts("mlp", "gate_proj", "up_proj", "down_proj"),
    "Qwen2MoeForCausalLM": {**_experts("mlp", "gate_proj", "up_proj", "down_proj"), **SHARED},
}


def file_shape(t: Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """HF's shape of a tensor that is `shape` (one layer's, one expert's) in seqpipe."""
    view, at = [], 0
    for g in t.groups:
        view.append(math.prod(shape[at : at + g]))
        at += g
    return tuple(view[::-1] if t.transposed else view)


def to_file(t: Tensor, x: np.ndarray) -> np.ndarray:
    """One HF tensor's seqpipe array (one layer's, one expert's) as HF stores it."""
    view = x.reshape(file_shape(t, x.shape)[::-1] if t.transposed else file_shape(t, x.shape))
    return np.ascontiguousarray(view.T if t.transposed else view)


def read_block(t: Tensor, tensor_slice, shape: tuple[int, ...], index: tuple) -> np.ndarray:
    """seqpipe's array[index] of one HF tensor (`shape`), read from it lazily: each
    HF axis over the rows its group's first axis covers, the group's other axes cut after."""
    index = [slice(*s.indices(n)) for s, n in zip(index, shape, strict=True)]
    view, blocks, at = [], [], 0
    for g in t.groups:
        if g == 0:  # HF's axis of one, which seqpipe's array lacks
            view.append(slice(0, 1))
            continue
        first, inner = index[at], shape[at + 1 : at + g]
        size = math.prod(inner)
        view.append(slice(first.start * size, first.stop * size))
        blocks.append((first.stop - first.start, *inner))
        at += g
    block = tensor_slice[tuple(view[::-1] if t.transposed else view)]
    block = block.T if t.transposed else block
    block = block.reshape(tuple(n for b in blocks for n in b))
    cut, at = [], 0
    for g in t.groups:
        cut += [slice(None)] + index[at + 1 : at + g] if g else []
        at += g
    return block[tuple(cut)]


def _outside(name: str) -> bool:
    """Whether a shard's name leaves the model's directory (judged by the name, not by
    links: HF's cache links each snapshot's files to blobs elsewhere)."""
    parts = Path(name).parts
    return Path(name).is_absolute() or ".." in parts or not parts


class Reader:
    """The safetensors files of a HF directory, opened lazily and checked against the
    tensors `cfg` needs (names, shapes, dtypes) before anything is read."""

    def __init__(self, directory: Path, shapes: dict):
        self.directory = directory
        self.handles, self.slices, found = {}, {}, {}
        for filename in self._filenames():
            path = directory / filename
            if not path.is_file():
                raise HFError(f"{path} is missing ({INDEX} names it); download it again")
            try:
                handle = safe_open(str(path), framework="numpy")
            except SafetensorError as e:
                raise HFError(f"{path} is damaged or truncated ({e}); download it again") from None
            self.handles[filename] = handle
            found.update(dict.fromkeys(handle.keys(), filename))
        self._check(found, shapes)

    def _filenames(self) -> list[str]:
        """The safetensors files: the index's shards, else the single file."""
        index = self.directory / INDEX
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
                outside = [n for n in names if _outside(n)]
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise HFError(f"{index} is not a safetensors index ({e})") from None
            if outside:
                raise HFError(
                    f"{index} names a file outside {self.directory}: {outside[0]!r}; "
                    "a model's shards lie in its directory"
                )
            return names
        if (self.directory / SINGLE).is_file():
            return [SINGLE]
        raise HFError(f"{self.directory} has neither {SINGLE} nor {INDEX}")

    def _check(self, found: dict, shapes: dict) -> None:
        for name, shape in shapes.items():
            if name not in found:
                raise HFError(f"{self.directory} has no tensor {name}, which the config needs")
            s = self.handles[found[name]].get_slice(name)
            if tuple(s.get_shape()) != shape:
                raise HFError(
                    f"{self.directory}: tensor {name} is {list(s.get_shape())} but "
                    f"config.json makes it {list(shape)}"
                )
            if s.get_dtype() not in DTYPES:
                raise HFError(
                    f"{self.directory}: tensor {name} is {s.get_dtype()}, which seqpipe cannot "
                    f"read (quantized?); it reads {', '.join(DTYPES)}"
                )
            self.slices[name] = s
        extra = sorted(
            n
            for n in found
            if n not in shapes and not n.endswith(IGNORED) and n != TENSORS["head"].name
        )
        if extra:
            raise HFError(
                f"{self.directory} has tensors seqpipe's model has no place for: "
                f"{', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}"
            )


def _layout(cfg: GPTConfig, arch: str) -> dict:
    """{seqpipe path: (Tensor, one HF tensor's shape in seqpipe, the sizes of the leading
    axes that run over HF tensors, the layers HF holds it in: None, every one)} of every
    parameter, as `arch` names them."""
    table = {**TENSORS, **EXPERTS.get(arch, {})}
    holders = {}
    if cfg.mixed:  # each layer holds its own MLP's tensors alone (seqpipe's others are zeros)
        holders = dict.fromkeys(model.DENSE_MLP, frozenset(cfg.dense_layers))
        holders.update(dict.fromkeys(EXPERTS[arch], frozenset(cfg.sparse_layers)))
    shapes = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(shapes):
        keys = tuple(k.key for k in path)
        if keys[-1] not in table:
            raise HFError(f"{arch} has no tensor for seqpipe's parameter {'.'.join(keys)}")
        t = table[keys[-1]]
        shape, lead = tuple(x.shape[t.stacked :]), tuple(x.shape[: t.stacked])
        out[keys] = (t, shape, lead, holders.get(keys[-1]))
    return out


def _names(layout: dict) -> dict[str, tuple[int, ...]]:
    """{HF name: HF shape} of every tensor `layout` needs."""
    names = {}
    for t, shape, lead, holders in layout.values():
        for at in itertools.product(*map(range, lead)):
            if holders is None or at[0] in holders:
                names[t.name.format(*at)] = file_shape(t, shape)
    return names


def config_of(spec: str, dtype: str = "float32") -> GPTConfig:
    """The model `spec` (hf:DIR or DIR) describes, computing and keeping parameters in dtype."""
    where = str(Path(spec.removeprefix(PREFIX)) / "config.json")
    keys = model_keys(read(spec), where)
    return GPTConfig.from_config({**keys, "dtype": dtype, "param_dtype": dtype})


def check(spec: str, cfg: GPTConfig) -> None:
    """HFError unless every tensor `cfg` needs is in spec's files, readable, of its shape."""
    open_reader(spec, cfg)


def open_reader(spec: str, cfg: GPTConfig) -> tuple[Reader, dict]:
    directory = Path(spec.removeprefix(PREFIX))
    arch = architecture(read(spec), str(directory / "config.json"))
    layout = _layout(dataclasses.replace(cfg, tensor=1), arch)
    return Reader(directory, _names(layout)), layout


def _read_leaf(
    reader, t: Tensor, shape, dtype, index, lead, holders=None, layer_at: Callable | None = None
):
    """seqpipe's leaf[index], reading only the HF tensors it covers: index's first slices
    run over `lead` (the layers, then the experts), the others within each tensor (of
    `shape`); zeros in the layers not among `holders` (None: all). With `layer_at`, layer
    position i is HF layer layer_at(i), or -1: zeros (a pipeline stage's padding)."""
    outer, inner = index[: len(lead)], index[len(lead) :]
    ranges = [range(*s.indices(n)) for s, n in zip(outer, lead, strict=True)]
    blocks = []
    for at in itertools.product(*ranges):
        if at and layer_at is not None:
            at = (layer_at(at[0]), *at[1:])
        if at and (at[0] < 0 or (holders is not None and at[0] not in holders)):
            sizes = [len(range(*s.indices(n))) for s, n in zip(inner, shape, strict=True)]
            blocks.append(np.zeros(sizes, dtype))
            continue
        name = t.name.format(*at)
        block = read_block(t, reader.slices[name], shape, inner)
        blocks.append(_finite(block, name, reader).astype(dtype))
    return np.stack(blocks).reshape(*map(len, ranges), *blocks[0].shape)


def _finite(block: np.ndarray, name: str, reader: Reader) -> np.ndarray:
    """The block, or HFError naming the tensor: a NaN or inf in a weight would make every
    training step non-finite (and be skipped), with nothing saying where it came from."""
    finite = np.isfinite(block)
    if not finite.all():
        bad = int(finite.size - np.count_nonzero(finite))
        raise HFError(
            f"{reader.directory}: tensor {name} holds {bad} NaN or infinite values; the "
            "checkpoint is damaged: download it again"
        )
    return block


def load(path: str, dtype: str = "float32") -> tuple[GPTConfig, model.Params]:
    """(cfg, params) of a HF directory, every parameter in `dtype` on the default device;
    `seqpipe.models.model.forward(params, tokens, cfg)` runs it."""
    cfg = config_of(str(path), dtype)
    reader, layout = open_reader(str(path), cfg)
    params: dict = {}
    for keys, (t, shape, lead, holders) in layout.items():
        full = tuple(slice(0, n) for n in lead + shape)
        node = params
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = jnp.asarray(_read_leaf(reader, t, shape, dtype, full, lead, holders))
    return cfg, params


def initial_params(spec: str, cfg: GPTConfig, abstract: model.Params, positions) -> model.Params:
    """The parameters of hf:DIR as `abstract` (shape structs with shardings, the train
    state's) lays them out: each device's block read straight from the files, so this
    process reads only what its devices hold (their layers, experts, columns).
    `positions[i]`: the HF layer at layer position i of the state (-1: padding)."""
    reader, layout = open_reader(spec, cfg)

    def layer_at(i):
        return int(positions[i])

    def leaf(path, x):
        keys = tuple(k.key for k in path)
        t, shape, _, holders = layout[keys]
        lead = x.shape[: t.stacked]  # the state's layer positions, padding included
        blocks = {}  # a block several devices hold (replicated) is read once

        def block(index):
            key = tuple((s.start, s.stop) for s in index)
            if key not in blocks:
                blocks[key] = _read_leaf(reader, t, shape, x.dtype, index, lead, holders, layer_at)
            return blocks[key]

        return jax.make_array_from_callback(x.shape, x.sharding, block)

    return jax.tree_util.tree_map_with_path(leaf, abstract)


def _model_keys(cfg: GPTConfig) -> dict:
    keys = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    keys["rope_scaling"] = dataclasses.asdict(cfg.rope_scaling)
    return keys


def tensors(cfg: GPTConfig, params: model.Params, dtype: str, arch: str | None = None):
    """(HF name, array) of every tensor, layer by layer and expert by expert, in `dtype`,
    named as `arch` (default: the one `cfg` exports as) names them: of the parameters, or
    of anything shaped as them (their gradients)."""
    arch = arch or writes(_model_keys(cfg))
    layout = _layout(dataclasses.replace(cfg, tensor=1), arch)
    for keys, (t, _, lead, holders) in layout.items():
        x = params
        for k in keys:
            x = x[k]
        for at in itertools.product(*map(range, lead)):
            if holders is not None and at[0] not in holders:
                continue  # the layer's other MLP, zeros HF has no tensor for
            yield t.name.format(*at), to_file(t, np.asarray(x[at]).astype(dtype))


def save(
    path: str,
    cfg: GPTConfig,
    params: model.Params,
    dtype: str | None = None,
    base: dict | None = None,
    context: int = 0,
) -> None:
    """A HF directory at `path`: config.json and model.safetensors, or shards of at most
    5 GB with their index. `dtype` (default the parameters'); `base`, a config.json whose
    other keys (token ids) are kept; `context`, the longest sequence trained on."""
    dtype = dtype or str(jax.tree.leaves(params)[0].dtype)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(_model_keys(cfg), dtype, base, context)
    shards, current, size = [], {}, 0
    for name, array in tensors(cfg, params, dtype, config["architectures"][0]):
        if current and size + array.nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = array
        size += array.nbytes
    shards.append(current)
    _write(out, shards)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write(out: Path, shards: list[dict]) -> None:
    meta = {"format": "pt"}  # transformers refuses safetensors without it
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE), metadata=meta)
        return
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / filename), metadata=meta)
        weight_map.update(dict.fromkeys(tensors, filename))
        total += sum(a.nbytes for a in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
