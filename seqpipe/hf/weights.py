"""HuggingFace checkpoints in and out: safetensors tensors <-> seqpipe's parameters.

    python -m seqpipe.hf export --workdir W [--step N] --out DIR

HF's `nn.Linear` weights are [out, in]; seqpipe's are [in, out] with the heads as their
own axes (`seqpipe.models.model`): wq [D, H, E] is q_proj.weight [H*E, D] transposed and split.
Both rotate the first half of each head with the second (`rotate_half`), so no row is
permuted. Tensors are read lazily, block by block (`safe_open(...).get_slice`): a
process reads only the slices its devices hold (`initial_params`).
"""

import dataclasses
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

from seqpipe.hf.config import PREFIX, HFError, hf_config, model_keys, read
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
    """How one seqpipe parameter (per layer) lies in a HF file: `name` ({} the layer),
    whether it is stored transposed, and `groups`: how many of seqpipe's axes make up each
    of HF's (read in seqpipe's order), so [D, H, E] is (1, 2) of [H*E, D] transposed."""

    name: str
    transposed: bool
    groups: tuple[int, ...]


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


def file_shape(t: Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """HF's shape of a tensor that is `shape` (one layer's) in seqpipe."""
    view, at = [], 0
    for g in t.groups:
        view.append(math.prod(shape[at : at + g]))
        at += g
    return tuple(view[::-1] if t.transposed else view)


def to_file(t: Tensor, x: np.ndarray) -> np.ndarray:
    """One layer's seqpipe array as HF stores it."""
    view = x.reshape(file_shape(t, x.shape)[::-1] if t.transposed else file_shape(t, x.shape))
    return np.ascontiguousarray(view.T if t.transposed else view)


def read_block(t: Tensor, tensor_slice, shape: tuple[int, ...], index: tuple) -> np.ndarray:
    """seqpipe's array[index] of one layer (`shape`), read from HF's tensor lazily: each
    HF axis over the rows its group's first axis covers, the group's other axes cut after."""
    index = [slice(*s.indices(n)) for s, n in zip(index, shape, strict=True)]
    view, blocks, at = [], [], 0
    for g in t.groups:
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
        cut += [slice(None)] + index[at + 1 : at + g]
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


def _layout(cfg: GPTConfig) -> dict:
    """{seqpipe path: (Tensor, one layer's shape, layers or None)} of every parameter."""
    shapes = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(shapes):
        keys = tuple(k.key for k in path)
        layered = keys[0] == "layers"
        shape = tuple(x.shape[1:] if layered else x.shape)
        out[keys] = (TENSORS[keys[-1]], shape, x.shape[0] if layered else None)
    return out


def _names(layout: dict) -> dict[str, tuple[int, ...]]:
    """{HF name: HF shape} of every tensor `layout` needs."""
    names = {}
    for t, shape, layers in layout.values():
        for i in range(layers or 1):
            names[t.name.format(i)] = file_shape(t, shape)
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
    layout = _layout(dataclasses.replace(cfg, tensor=1))
    return Reader(Path(spec.removeprefix(PREFIX)), _names(layout)), layout


def _read_leaf(reader, t: Tensor, shape, dtype, index, layers_at: Callable | None, layers=0):
    """seqpipe's leaf[index]; with `layers_at`, index[0] runs over `layers` positions, each
    the HF layer layers_at(position) or -1 (zeros: a pipeline stage's padding)."""
    if layers_at is None:
        block = read_block(t, reader.slices[t.name], shape, index)
        return _finite(block, t.name, reader).astype(dtype)
    rest = index[1:]
    rows = []
    for at in range(*index[0].indices(layers)):
        layer = layers_at(at)
        if layer < 0:
            sizes = [len(range(*s.indices(n))) for s, n in zip(rest, shape, strict=True)]
            rows.append(np.zeros(sizes, dtype))
        else:
            name = t.name.format(layer)
            block = read_block(t, reader.slices[name], shape, rest)
            rows.append(_finite(block, name, reader).astype(dtype))
    return np.stack(rows)


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
    for keys, (t, shape, layers) in layout.items():
        full = (slice(0, layers),) if layers else ()
        full += tuple(slice(0, n) for n in shape)
        node = params
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        at = None if layers is None else (lambda i: i)
        node[keys[-1]] = jnp.asarray(_read_leaf(reader, t, shape, dtype, full, at, layers or 0))
    return cfg, params


def initial_params(spec: str, cfg: GPTConfig, abstract: model.Params, positions) -> model.Params:
    """The parameters of hf:DIR as `abstract` (shape structs with shardings, the train
    state's) lays them out: each device's block read straight from the files, so this
    process reads only what its devices hold. `positions[i]`: the HF layer at layer
    position i of the state (-1: padding)."""
    reader, layout = open_reader(spec, cfg)

    def leaf(path, x):
        keys = tuple(k.key for k in path)
        t, shape, layers = layout[keys]
        at = None if layers is None else (lambda i: int(positions[i]))
        blocks = {}  # a block several devices hold (replicated) is read once

        def block(index):
            key = tuple((s.start, s.stop) for s in index)
            if key not in blocks:
                blocks[key] = _read_leaf(reader, t, shape, x.dtype, index, at, x.shape[0])
            return blocks[key]

        return jax.make_array_from_callback(x.shape, x.sharding, block)

    return jax.tree_util.tree_map_with_path(leaf, abstract)


def _model_keys(cfg: GPTConfig) -> dict:
    keys = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    keys["rope_scaling"] = dataclasses.asdict(cfg.rope_scaling)
    return keys


def tensors(cfg: GPTConfig, params: model.Params, dtype: str):
    """(HF name, array) of every tensor, layer by layer, in `dtype`: of the parameters, or
    of anything shaped as them (their gradients)."""
    layout = _layout(dataclasses.replace(cfg, tensor=1))
    for keys, (t, _, layers) in layout.items():
        x = params
        for k in keys:
            x = x[k]
        for i in range(layers or 1):
            one = np.asarray(x[i] if layers else x).astype(dtype)
            yield t.name.format(i), to_file(t, one)


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
    for name, array in tensors(cfg, params, dtype):
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
