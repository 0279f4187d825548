"""A decoder (GPT, or the Llama family) as pure functions of a params pytree.

Layer parameters are stacked with a leading layer axis N so a pipeline can reshape
them to [S, N/S, ...]. Every layer function works on one sequence *segment* and the
keys/values of the positions before it, which is the identity Seq1F1B rests on:
running a sequence segment by segment, carrying the KV prefix, equals running it whole.

The parameters (`init_params`; HF Llama/Qwen 2 names in brackets, HF's [out, in]
`nn.Linear` weights transposed), with N layers, D = d_model, V vocabulary, H query heads
and K = num_kv_heads K/V heads of width E (`head_dim`, D / H unless set), F = d_ff:
  embed      [V, D]        (embed_tokens.weight)
  head       [D, V]        (lm_head.weight.T); absent with tie_embeddings: logits use embed.T
  final_norm [D]           (norm.weight)
  layers:    attn_norm, mlp_norm [N, D] (input_layernorm, post_attention_layernorm)
             wq [N, D, H, E], wk, wv [N, D, K, E], wo [N, H, E, D] (q/k/v/o_proj)
             with qkv_bias: bq [N, H, E], bk, bv [N, K, E] (q/k/v_proj.bias)
             with qk_norm: q_norm, k_norm [N, E] (self_attn.q_norm/k_norm.weight)
             mlp gelu: w_in [N, D, F], w_out [N, F, D]
             mlp swiglu: w_gate [N, D, F] (gate_proj), w_in (up_proj), w_out (down_proj);
                         the activation is silu(gate) * up
             with experts (`seqpipe.models.moe`) theirs in the MLP's place; where some
             layers stay dense (`dense_layers`) every layer holds both, its other one zeros
RMSNorm as HF Llama's: float32 x * rsqrt(mean(x^2) + norm_eps) * weight. Rotary
embeddings pair each head's first half with its second (`rotate_half`), positions as
`rope_scaling` extends them (`seqpipe.kernels.rope`). Attention scores are scaled by 1/sqrt(E);
query head h reads K/V head h // (H/K).
"""

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from seqpipe.kernels import attention_residuals
from seqpipe.kernels.attention import accumulation, attend, attend_cached, rope
from seqpipe.kernels.rope import NO_SCALING, RopeScaling
from seqpipe.models import document_mask, moe
from seqpipe.models.document_mask import Packing
from seqpipe.parallel import tensor
from seqpipe.parallel.sharding import CONTEXT

Params = dict[str, Any]
DENSE_MLP = ("w_gate", "w_in", "w_out")
# [N] float32, among a stack's layers where they mix dense and sparse MLPs: 1.0 where the
# layer's MLP is the mixture. Not a parameter: added where layers run (`with_kinds`).
KIND = "sparse"


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Static model shape (hashable, so it can be a jit static argument)."""

    vocab_size: int
    num_layers: int
    d_model: int
    num_heads: int
    d_ff: int
    dtype: str = "float32"
    param_dtype: str = "float32"
    rope_base: float = 10000.0
    init_std: float = 0.02
    # A name in attention.IMPLEMENTATIONS; the model alone runs the `xla` oracle. A config's
    # `auto` is chosen for its devices by `run_config.resolve`, never at trace time.
    attention: str = "xla"
    loss_chunk: int = 0  # tokens per cross-entropy chunk (`head_loss_sum`); 0: one chunk
    # Devices each layer, the embedding and the head are split over (`seqpipe.parallel.tensor`);
    # the pipeline's functions run per device with 1/tensor of the split dimensions.
    tensor: int = 1
    num_kv_heads: int = 0  # K/V heads (grouped-query attention); 0: num_heads
    mlp: str = "gelu"  # "gelu" (w_in, w_out) or "swiglu" (w_gate, w_in, w_out)
    tie_embeddings: bool = False  # the head is embed.T (no "head" parameter)
    norm_eps: float = 1e-6
    qkv_bias: bool = False  # biases on the Q, K and V projections (Qwen 2)
    rope_scaling: RopeScaling = NO_SCALING
    # On packed rows (`seqpipe.models.document_mask`), each token attends only within its document;
    # rows without document ids are plain causal rows either way.
    document_mask: bool = True
    head_dim: int = 0  # E, each head's width; 0: d_model / num_heads (Qwen 3 sets its own)
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Qwen 3)
    # A mixture of experts in every layer's MLP (`seqpipe.models.moe`; swiglu experts)
    # but `dense_layers`' (HF's mlp_only_layers), whose MLP is dense, d_ff wide.
    num_experts: int = 0  # 0: a dense MLP
    dense_layers: tuple[int, ...] = ()
    experts_per_token: int = 2
    expert_d_ff: int = 0  # each expert's hidden width; 0: d_ff
    shared_expert_d_ff: int = 0  # a gated expert every token goes through (Qwen 2 MoE); 0: none
    router_renormalize: bool = True  # the chosen experts' weights sum to one (Mixtral)
    moe_aux_loss: float = 0.0  # the load-balancing loss's coefficient
    moe_z_loss: float = 0.0  # the router z-loss's coefficient
    # Each expert takes at most ceil(factor x tokens x k / X) of a row's segment's
    # assignments, those of the highest routing weights; 0: dropless.
    moe_capacity_factor: float = 0.0
    # How tokens reach experts split over data replicas (`moe.mlp`): "all_gather" (every
    # replica's tokens to every device), or "all_to_all" (each assignment to its expert's
    # device, in buffers the capacity bounds: it needs moe_capacity_factor > 0).
    moe_dispatch: str = "all_gather"
    # The tokens of one data replica's batch, which the router losses average over, and
    # the segments of a row they are taken over (() the whole row): set from the batch
    # (`loss`, the executor) and by the pipeline's spec, not by a config.
    router_tokens: int = 0
    router_segments: tuple[int, ...] = ()
    # Whether the layers carry the router meter (`metered`): set by the executor from the
    # parameters it is given.
    router_meter: bool = False
    # Devices the experts are split over (expert parallelism: the mesh's data replicas,
    # set by the pipeline's spec as `tensor` is); the pipeline's functions run per device
    # with num_experts / expert_parallel of them.
    expert_parallel: int = 1

    def __post_init__(self):
        # A config section (a dict or ConfigDict) becomes the hashable dataclass.
        object.__setattr__(self, "rope_scaling", RopeScaling.from_config(self.rope_scaling))
        object.__setattr__(self, "dense_layers", tuple(sorted(map(int, self.dense_layers))))
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)

    @property
    def q_width(self) -> int:
        """H * E: the queries' (and the attention output's) width, d_model unless a head's
        width is set apart from it."""
        return self.num_heads * self.head_dim

    @property
    def mixed(self) -> bool:
        """Whether the layers mix dense and mixture-of-experts MLPs: then every layer holds
        both, the one it does not run zeros (`init_params`), and picks its own by `KIND`."""
        return bool(self.num_experts and self.dense_layers)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is the mixture of experts (none in a dense model)."""
        if not self.num_experts:
            return ()
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers)

    @property
    def expert_width(self) -> int:
        return self.expert_d_ff or self.d_ff

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def local_heads(self) -> int:
        """Attention heads on one tensor device."""
        return self.num_heads // self.tensor

    @property
    def kv_replicated(self) -> bool:
        """Whether each tensor device holds K/V heads whole (tensor > K/V heads, as
        Megatron-LM does: each uses the one its query heads read), rather than split."""
        return self.kv_heads % self.tensor != 0

    @property
    def local_kv_heads(self) -> int:
        """K/V heads one tensor device computes (and caches)."""
        return 1 if self.kv_replicated else self.kv_heads // self.tensor

    @classmethod
    def from_config(cls, model_cfg) -> "GPTConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in model_cfg.items() if k in names})


def init_params(cfg: GPTConfig, key: jax.Array) -> Params:
    """Normal(0, init_std) matrices, output projections scaled by 1/sqrt(2N), unit norms,
    zero biases. The first eight draws are GPT's, so its parameters are as they were."""
    n, d, h, kv, e, f, v = (
        cfg.num_layers,
        cfg.d_model,
        cfg.num_heads,
        cfg.kv_heads,
        cfg.head_dim,
        cfg.d_ff,
        cfg.vocab_size,
    )
    dt = jnp.dtype(cfg.param_dtype)
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * n)
    keys = iter(jax.random.split(key, 8))

    def normal(shape, s, k=None):
        k = next(keys) if k is None else k
        return (s * jax.random.normal(k, shape, jnp.float32)).astype(dt)

    params = {
        "embed": normal((v, d), std),
        "layers": {
            "attn_norm": jnp.ones((n, d), dt),
            "wq": normal((n, d, h, e), std),
            "wk": normal((n, d, kv, e), std),
            "wv": normal((n, d, kv, e), std),
            "wo": normal((n, h, e, d), out_std),
            "mlp_norm": jnp.ones((n, d), dt),
            "w_in": normal((n, d, f), std),
            "w_out": normal((n, f, d), out_std),
        },
        "final_norm": jnp.ones((d,), dt),
        "head": normal((d, v), std),
    }
    if cfg.mlp == "swiglu":
        params["layers"]["w_gate"] = normal((n, d, f), std, jax.random.fold_in(key, 8))
    if cfg.qkv_bias:
        params["layers"].update(
            bq=jnp.zeros((n, h, e), dt), bk=jnp.zeros((n, kv, e), dt), bv=jnp.zeros((n, kv, e), dt)
        )
    if cfg.qk_norm:
        params["layers"].update(q_norm=jnp.ones((n, e), dt), k_norm=jnp.ones((n, e), dt))
    if cfg.num_experts:  # the experts take the dense MLP's place, drawn from keys of their own
        draws = iter(jax.random.split(jax.random.fold_in(key, 9), len(moe.PARAMS + moe.SHARED)))
        experts = moe.init(cfg, lambda shape, s: normal(shape, s, next(draws)), n, std, out_std)
        dense = {k: params["layers"].pop(k) for k in DENSE_MLP if k in params["layers"]}
        if cfg.mixed:  # each layer's other MLP is zeros, and stays so (it has no gradient)
            sparse = np.isin(np.arange(n), cfg.sparse_layers)
            experts = {k: _layers_where(sparse, w) for k, w in experts.items()}
            experts.update({k: _layers_where(~sparse, w) for k, w in dense.items()})
        params["layers"].update(experts)
    if cfg.tie_embeddings:
        del params["head"]
    return params


def _layers_where(keep: np.ndarray, w: jax.Array) -> jax.Array:
    """w [N, ...] with the layers where `keep` [N] is false zeroed."""
    return jnp.where(keep.reshape(-1, *(1,) * (w.ndim - 1)), w, jnp.zeros((), w.dtype))


def param_shapes(cfg: GPTConfig) -> Params:
    """ShapeDtypeStructs of the parameters as one device of a stage holds them: its tensor
    share, its experts (all of them with cfg.tensor = cfg.expert_parallel = 1)."""
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))

    def local(path, x):
        name = getattr(path[-1], "key", "")
        shape = list(x.shape)
        dim = tensor.param_dim(name, x.shape, cfg.tensor)
        if dim is not None and cfg.tensor > 1:
            shape[dim] //= cfg.tensor
        if name in moe.EXPERTS:  # [N, X, ...]: this device's experts
            shape[1] //= cfg.expert_parallel
        return jax.ShapeDtypeStruct(tuple(shape), x.dtype)

    shapes = jax.tree_util.tree_map_with_path(local, shapes)
    if cfg.router_meter:
        meter = jax.ShapeDtypeStruct((cfg.num_layers, len(moe.METERED)), jnp.float32)
        shapes["layers"] = {**shapes["layers"], moe.METER: meter}
    if cfg.mixed:
        kinds = jax.ShapeDtypeStruct((cfg.num_layers,), jnp.float32)
        shapes["layers"] = {**shapes["layers"], KIND: kinds}
    return shapes


def kinds(cfg: GPTConfig, positions: np.ndarray | None = None) -> np.ndarray:
    """`KIND` of the layers at `positions` (canonical layer numbers; -1, a pipeline stage's
    padding, is dense; default: every layer in order): 1.0 where the MLP is the mixture."""
    positions = np.arange(cfg.num_layers) if positions is None else np.asarray(positions)
    return np.isin(positions, cfg.sparse_layers).astype(np.float32)


def with_kinds(p_layers: Params, cfg: GPTConfig) -> Params:
    """A stack of every layer in order with its `KIND` where the layers mix MLPs (a
    pipeline gives its chunks theirs, `seqpipe.pipeline.executor`)."""
    if not cfg.mixed or KIND in p_layers:
        return p_layers
    return {**p_layers, KIND: jnp.asarray(kinds(cfg))}


def metered(params: Params, cfg: GPTConfig) -> Params:
    """`params` with a mixture's router meter among the layers, zeros [N, len(moe.METERED)]
    whose gradient is what its routers metered (`seqpipe.models.moe`); dense models' as
    they are."""
    if not cfg.num_experts:
        return params
    meter = jnp.zeros((params["layers"]["router"].shape[0], len(moe.METERED)), jnp.float32)
    return {**params, "layers": {**params["layers"], moe.METER: meter}}


def router_metrics(grads: Params) -> tuple[Params, dict[str, jax.Array]]:
    """The gradients of `metered` parameters without the meter, and what it metered,
    summed over the layers (each layer's is already 1/N of its own): the router losses,
    unscaled ("aux_loss", "z_loss"), and the share of assignments a capacity dropped
    ("dropped"); ({} for a dense model's)."""
    if moe.METER not in grads["layers"]:
        return grads, {}
    layers = dict(grads["layers"])
    values = jnp.sum(layers.pop(moe.METER), axis=0)
    return {**grads, "layers": layers}, dict(zip(moe.METERED, values, strict=True))


def in_compute_dtype(weights: Params, dtype) -> Params:
    """The weights (arrays or their ShapeDtypeStructs) in the compute dtype, a router meter
    kept in float32 (its gradient is a value, reported to the last digit)."""

    def cast(path, w):
        if getattr(path[-1], "key", "") == moe.METER:
            return w
        return (
            jax.ShapeDtypeStruct(w.shape, dtype)
            if isinstance(w, jax.ShapeDtypeStruct)
            else w.astype(dtype)
        )

    return jax.tree_util.tree_map_with_path(cast, weights)


def num_params(params: Params) -> int:
    return sum(x.size for x in jax.tree.leaves(params))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, weight: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / rms(x) * weight, computed in float32 (rms with `eps` added to the mean square).
    Its backward keeps x (in its own dtype) and the [..., 1] reciprocal rms, not float32
    copies of x and of its normalised values (with every residual kept, those were a third
    of a long-context layer's stash)."""
    return _rms_norm_fwd(x, weight, eps)[0]


def _rms_norm_fwd(x, weight, eps):
    f = accumulation(x.dtype)
    x32 = x.astype(f)
    r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * r * weight.astype(f)).astype(x.dtype), (x, r, weight)


def _rms_norm_bwd(eps, saved, dy):
    x, r, weight = saved
    f = accumulation(x.dtype)
    n = x.astype(f) * r  # the normalised x
    dn = dy.astype(f) * weight.astype(f)
    dx = r * (dn - n * jnp.mean(dn * n, axis=-1, keepdims=True))
    dw = jnp.sum(dy.astype(f) * n, axis=tuple(range(x.ndim - 1)))
    return dx.astype(x.dtype), dw.astype(weight.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


GELU_SCOPE = "gelu"  # marks its equations for `flops.breakdown` (see attention.NAME_SCOPE)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up (HF Llama's MLP activation), in the inputs' dtype."""
    return jax.nn.silu(gate) * up


@jax.custom_jvp
def gelu(x: jax.Array) -> jax.Array:
    """GELU (tanh form), with a hand-written derivative so that a backward keeping
    residuals stores one array (the slope at x) instead of each intermediate of the tanh."""
    return jax.nn.gelu(x, approximate=True)


@gelu.defjvp
@jax.named_scope(GELU_SCOPE)
def _gelu_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    c = math.sqrt(2 / math.pi)
    inner = c * (x + 0.044715 * x**3)
    th = jnp.tanh(inner)
    slope = 0.5 * (1 + th) + 0.5 * x * (1 - th * th) * c * (1 + 3 * 0.044715 * x * x)
    return 0.5 * x * (1 + th), slope * t


def embed(params: Params, tokens_BxQ: jax.Array, cfg: GPTConfig) -> jax.Array:
    """[b, Q, D] embeddings ([b, Q/t, D], this device's positions, under tensor parallelism)."""
    return tensor.embed(params["embed"].astype(cfg.dtype), tokens_BxQ, cfg.tensor)


# A layer's weight matmuls: (einsum, the input it reads). A split backward (zero bubble)
# leaves their weight gradients to its W, which needs only these inputs and the matmuls'
# output cotangents (`weight_grads`).
MATMULS = {
    "wq": ("bqd,dhe->bqhe", "attn_in"),
    "wk": ("bqd,dhe->bqhe", "attn_in"),
    "wv": ("bqd,dhe->bqhe", "attn_in"),
    "wo": ("bqhe,hed->bqd", "attn_out"),
    "w_gate": ("bqd,df->bqf", "mlp_in"),
    "w_in": ("bqd,df->bqf", "mlp_in"),
    "w_out": ("bqf,fd->bqd", "mlp_act"),
}


def _own_kv_head(p: Params, cfg: GPTConfig) -> Params:
    """A layer's parameters with the K/V projections cut to the head this tensor device's
    query heads read, where each device holds them whole (`GPTConfig.kv_replicated`).
    The slice's transpose puts this device's K/V gradient at that head, zeros elsewhere;
    summed over the devices (`pipeline.reduce`) they make the whole gradient."""
    if cfg.tensor == 1 or not cfg.kv_replicated:
        return p
    head = tensor.index(cfg.tensor) // (cfg.tensor // cfg.kv_heads)
    cut = {"wk": 1, "wv": 1, "bk": 0, "bv": 0}  # the heads' axis, per layer
    return {
        k: jax.lax.dynamic_slice_in_dim(w, head, 1, cut[k]) if k in cut else w for k, w in p.items()
    }


def layer(
    p: Params,
    x_BxQxD: jax.Array,
    k_prefix_BxPxHxE: jax.Array,
    v_prefix_BxPxHxE: jax.Array,
    offset: int,
    cfg: GPTConfig,
    taps: Params | None = None,
    cache=None,
    packing: Packing | None = None,
):
    """One pre-norm decoder layer on a segment: (x_seg, kv_prefix, offset) -> (y_seg, kv_seg).

    Under tensor parallelism (cfg.tensor = t) x and y hold this device's L/t positions,
    the K/V (prefix and segment) this device's heads, and the matmuls read the whole
    segment (`seqpipe.parallel.tensor`).

    With `cache` (a `kv_cache.Prefix` at this layer) the prefix's first `offset` positions
    are read from the KV cache where they lie, and `k_prefix`, `v_prefix` are zero sinks
    that take its cotangents (`attention.attend_cached`).

    `taps` (a split backward): {matmul: zeros of its output}, added to the outputs so that
    their cotangents are the matmuls' output cotangents; the layer then also returns the
    matmuls' inputs ({MATMULS input name: array}).

    `packing` (a `document_mask.Packing`, the whole segment's): the document ids the attention
    masks by and the positions RoPE reads; None: a plain causal row."""
    p = _own_kv_head(in_compute_dtype(p, cfg.dtype), cfg)
    mm = _Matmuls(p, taps, cfg.tensor)
    attn_out, k_seg, v_seg = _self_attention(
        mm, x_BxQxD, k_prefix_BxPxHxE, v_prefix_BxPxHxE, offset, cfg, cache, packing
    )
    x_BxQxD = x_BxQxD + tensor.scatter(attn_out, mm.t)
    x_BxQxD = x_BxQxD + tensor.scatter(_mlp(mm, x_BxQxD, cfg, packing), mm.t)
    if taps is None:
        return x_BxQxD, k_seg, v_seg
    return x_BxQxD, k_seg, v_seg, mm.inputs


class _Matmuls:
    """A layer's matmuls on its weights `p`: each output plus its tap (a split backward's
    `taps`, else as it is), each input kept in `inputs` ({MATMULS input name: array})."""

    def __init__(self, p: Params, taps: Params | None, t: int):
        self.p, self.taps, self.t, self.inputs = p, taps, t, {}

    def tap(self, name, y):
        return y if self.taps is None else y + self.taps[name]

    def __call__(self, name, a):
        spec, input_name = MATMULS[name]
        self.inputs[input_name] = a
        return self.tap(name, jnp.einsum(spec, a, self.p[name]))

    def column_parallel(self, names, h_local):
        """The matmuls `names` of the whole segment, gathered from this device's positions."""
        if self.t == 1:
            return [self(name, h_local) for name in names]
        h, ys = _gathered_matmuls(h_local, tuple(self.p[n] for n in names), names, self.t)
        self.inputs[MATMULS[names[0]][1]] = h
        return [self.tap(name, y) for name, y in zip(names, ys, strict=True)]


def _self_attention(mm: _Matmuls, x_BxQxD, k_prefix, v_prefix, offset, cfg, cache, packing):
    """The attention half of `layer` before its residual add: (the output projection's
    partial sums, this segment's K, V); arguments as `layer`'s."""
    p = mm.p
    h_BxQxD = rms_norm(x_BxQxD, p["attn_norm"], cfg.norm_eps)
    q, k_seg, v_seg = mm.column_parallel(("wq", "wk", "wv"), h_BxQxD)
    if cfg.qkv_bias:
        q, k_seg, v_seg = q + p["bq"], k_seg + p["bk"], v_seg + p["bv"]
    if cfg.qk_norm:  # over each head's width, one gain for every head
        q, k_seg = (
            rms_norm(q, p["q_norm"], cfg.norm_eps),
            rms_norm(k_seg, p["k_norm"], cfg.norm_eps),
        )
    positions = None if packing is None else packing.positions
    split = None if packing is None else packing.context
    if split is not None:  # this device's positions of the sequence (`seqpipe.parallel.context`)
        q, k_seg = (split.rope(x, cfg.rope_base, cfg.rope_scaling, positions) for x in (q, k_seg))
        k, v = k_prefix.astype(k_seg.dtype), v_prefix.astype(v_seg.dtype)
        attn_BxQxHxE = split.attend(cfg.attention, q, k, v, k_seg, v_seg, packing.kv_ids, cache)
        return mm("wo", attn_BxQxHxE), k_seg, v_seg
    q = rope(q, offset, cfg.rope_base, cfg.rope_scaling, positions)
    k_seg = rope(k_seg, offset, cfg.rope_base, cfg.rope_scaling, positions)
    documents = None if packing is None else packing.documents(q.shape[1])
    if cache is None:
        k, v = k_prefix.astype(k_seg.dtype), v_prefix.astype(v_seg.dtype)
        attn_BxQxHxE = attend(cfg.attention, q, k, v, k_seg, v_seg, documents)
    else:
        attn_BxQxHxE = attend_cached(
            cfg.attention, q, cache, k_prefix, v_prefix, offset, k_seg, v_seg, documents
        )
    return mm("wo", attn_BxQxHxE), k_seg, v_seg


def _mlp(mm: _Matmuls, x_BxQxD, cfg, packing=None):
    """The MLP half of `layer` before its residual add: the down projection's partial sums.
    A layer of a model that mixes MLPs runs the one its `KIND` names; its dense one is
    then not split from its backward (`matmul_shapes`)."""
    h_BxQxD = rms_norm(x_BxQxD, mm.p["mlp_norm"], cfg.norm_eps)
    if not cfg.num_experts:
        return _dense_mlp(mm, h_BxQxD, cfg)
    split = packing is not None and packing.context is not None

    def sparse(h):
        return moe.mlp(mm.p, h, cfg, CONTEXT if split else None)

    if not cfg.mixed:
        return sparse(h_BxQxD)
    dense = lambda h: _dense_mlp(_Matmuls(mm.p, None, mm.t), h, cfg)  # noqa: E731
    return jax.lax.cond(mm.p[KIND] > 0, sparse, dense, h_BxQxD)


def _dense_mlp(mm: _Matmuls, h_BxQxD, cfg):
    if cfg.mlp == "swiglu":
        gate_BxQxF, up_BxQxF = mm.column_parallel(("w_gate", "w_in"), h_BxQxD)
        ff_BxQxF = swiglu(gate_BxQxF, up_BxQxF)
    else:
        (ff_BxQxF,) = mm.column_parallel(("w_in",), h_BxQxD)
        ff_BxQxF = gelu(ff_BxQxF)
    return mm("w_out", ff_BxQxF)


def _gathered_matmuls(h_local, weights, names, t: int):
    """(the gathered segment, its matmuls by `names`) from this device's positions. Under
    a checkpoint that saves nothing, so that a backward keeps h_local, 1/t of the gathered
    input the matmuls' transposes read, and gathers it again (Megatron-LM's sequence
    parallelism); the matmuls themselves are not recomputed: their transposes need only
    the gathered input."""

    def run(h_local, weights):
        h = tensor.gather(h_local, t)
        return h, tuple(
            jnp.einsum(MATMULS[n][0], h, w) for n, w in zip(names, weights, strict=True)
        )

    return jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable)(h_local, weights)


def matmul_shapes(cfg: GPTConfig, lead: tuple[int, ...]) -> tuple[dict, dict]:
    """(inputs, outputs) shapes of a layer's weight matmuls, each with `lead` dimensions
    (layers, rows, positions) in front; one tensor device's (its heads and MLP columns,
    the whole segment's positions)."""
    d, h, e, f = cfg.d_model, cfg.local_heads, cfg.head_dim, cfg.d_ff // cfg.tensor
    kv = cfg.local_kv_heads
    inputs = {"attn_in": (d,), "attn_out": (h, e), "mlp_in": (d,), "mlp_act": (f,)}
    outputs = {"wq": (h, e), "wk": (kv, e), "wv": (kv, e), "wo": (d,), "w_in": (f,), "w_out": (d,)}
    if cfg.mlp == "swiglu":
        outputs["w_gate"] = (f,)
    if cfg.num_experts:  # the experts' grouped matmuls get their gradients in B
        for name in ("mlp_in", "mlp_act"):
            del inputs[name]
        for name in ("w_gate", "w_in", "w_out"):
            outputs.pop(name, None)
    return (
        {k: lead + v for k, v in inputs.items()},
        {k: lead + v for k, v in outputs.items()},
    )


def weight_grads(inputs: Params, d_outputs: Params, cfg: GPTConfig) -> Params:
    """The weight matmuls' gradients of a stack of layers (leading axis N), from their
    inputs and output cotangents: for y = a @ w, dw = a^T dy summed over rows and positions.
    K/V projections every tensor device holds whole get this device's head's gradient at
    its place, zeros elsewhere (as `_own_kv_head`'s transpose gives them)."""
    out = {}
    for name in d_outputs:
        spec, input_name = MATMULS[name]
        a_sub, rest = spec.split(",")
        w_sub, y_sub = rest.split("->")
        out[name] = jnp.einsum(f"n{a_sub},n{y_sub}->n{w_sub}", inputs[input_name], d_outputs[name])
    if cfg.tensor > 1 and cfg.kv_replicated:
        head = tensor.index(cfg.tensor) // (cfg.tensor // cfg.kv_heads)
        for name in ("wk", "wv"):  # [n, D, 1, E] -> [n, D, K, E]
            g = out[name]
            whole = jnp.zeros((*g.shape[:2], cfg.kv_heads, *g.shape[3:]), g.dtype)
            out[name] = jax.lax.dynamic_update_slice_in_dim(whole, g, head, 2)
    return out


# What a checkpointed layer keeps for its backward: `layer` only its input (the layer is
# recomputed), `dots` its projections' and MLP's matmul outputs (the element-wise work is
# recomputed). Not attention's score and value matmuls, which batch over heads: they grow
# with the segment times the K/V length, and a policy sees them inside `blockwise`'s
# forward too, whose own backward never reads them (the 8B at 65536 on an H200: 2.7 TiB).
CHECKPOINT_POLICIES = {
    "layer": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*attention_residuals.NAMES),
    ),
}


def layers(
    p_layers: Params,
    x_BxQxD: jax.Array,
    k_prefix_NxBxPxHxE: jax.Array,
    v_prefix_NxBxPxHxE: jax.Array,
    offset: int,
    cfg: GPTConfig,
    checkpoint: str | None = None,
    taps: Params | None = None,
    depth: jax.Array | None = None,
    cache=None,
    packing: Packing | None = None,
):
    """A stack of layers (leading axis N) on one segment; returns y and the segment's K/V
    (and with `taps`, stacked per layer, each layer's matmul inputs: see `layer`).

    `checkpoint` (a key of CHECKPOINT_POLICIES, or None) wraps each layer in jax.checkpoint.
    `depth` (a run-time count, or None for all N) runs only the first `depth` layers: the
    rest pass x through and give zeros (a pipeline stage's padding, `seqpipe.parallel.layout`).
    `cache` (a `kv_cache.Prefix`): the prefix is read from the KV cache, layer by layer, and
    the K/V prefix arguments are zero sinks for its cotangents (`layer`).
    `packing`: the segment's document ids and positions (`layer`).
    """

    def run(x, p, k_prefix, v_prefix, tap, i=None):
        at = None if cache is None else cache.at_layer(i)
        return tuple(layer(p, x, k_prefix, v_prefix, offset, cfg, tap, at, packing))

    def skip(x, *args):
        _, *rest = jax.eval_shape(run, x, *args)
        return (x, *jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), rest))

    def body(x, per_layer):
        i, *per_layer = per_layer
        if depth is None:
            y, *rest = run(x, *per_layer, i)
        else:  # a conditional, so a skipped layer costs nothing
            y, *rest = jax.lax.cond(i < depth, run, skip, x, *per_layer, i)
        return y, tuple(rest)

    if checkpoint is not None:
        body = jax.checkpoint(body, policy=CHECKPOINT_POLICIES[checkpoint])
    elif depth is not None:
        # Saving everything, as no checkpoint does. Without it the cond's own partial
        # evaluation stashed a copy of every weight and the rope tables per unit, and the
        # executor's rebuilt vjp gave wrong q and k gradients (caught by the uneven-split
        # oracle test; the cause inside JAX was not pinned down).
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.everything_saveable)
    p_layers = with_kinds(p_layers, cfg)
    layer_index = jnp.arange(jax.tree.leaves(p_layers)[0].shape[0])
    xs = (layer_index, p_layers, k_prefix_NxBxPxHxE, v_prefix_NxBxPxHxE, taps)
    y, rest = jax.lax.scan(body, x_BxQxD, xs)
    return (y, *rest)


def empty_kv(cfg: GPTConfig, num_layers: int, batch: int) -> tuple[jax.Array, jax.Array]:
    shape = (num_layers, batch, 0, cfg.kv_heads, cfg.head_dim)
    return jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype)


def head_weight(params: Params, cfg: GPTConfig) -> jax.Array:
    """The head's [D, V] weight: `head`, or with tied embeddings the embedding's transpose
    (its gradient then adds to the embedding's; the pipeline sums the two stages' over
    `stage` with the other shared weights)."""
    return params["embed"].T if cfg.tie_embeddings else params["head"]


def logits(params: Params, x_BxQxD: jax.Array, cfg: GPTConfig) -> jax.Array:
    h = rms_norm(x_BxQxD, params["final_norm"].astype(cfg.dtype), cfg.norm_eps)
    w = head_weight(params, cfg).astype(cfg.dtype)
    return jnp.einsum("bqd,dv->bqv", h, w, preferred_element_type=accumulation(cfg.dtype))


def token_loss_sum(logits_BxQxV: jax.Array, targets_BxQ: jax.Array) -> jax.Array:
    """Summed (not averaged) cross-entropy, so segments and micro-batches add up exactly."""
    logz = jax.nn.logsumexp(logits_BxQxV, axis=-1)
    target_logit = jnp.take_along_axis(logits_BxQxV, targets_BxQ[..., None], axis=-1)[..., 0]
    return jnp.sum(logz - target_logit)


def head_loss_sum(
    params: Params,
    x_BxQxD: jax.Array,
    targets_BxQ: jax.Array,
    cfg: GPTConfig,
    counted_BxQ: jax.Array | None = None,
):
    """`token_loss_sum(logits(params, x))`, with the [B, Q, V] float32 logits never whole:
    the tokens go through the head `cfg.loss_chunk` at a time (`chunked_xent`). Under
    tensor parallelism x holds this device's positions, targets the whole segment's.
    `counted_BxQ` (bool, packed rows: `document_mask.counted_targets`): only those targets add."""
    h_BxQxD = rms_norm(x_BxQxD, params["final_norm"].astype(cfg.dtype), cfg.norm_eps)
    h_BxQxD = tensor.gather(h_BxQxD, cfg.tensor)
    w_DxV = head_weight(params, cfg)
    weights = None if counted_BxQ is None else counted_BxQ.astype(accumulation(cfg.dtype))
    args = (h_BxQxD, w_DxV, targets_BxQ, cfg.dtype, cfg.loss_chunk, cfg.tensor)
    return chunked_xent(*args) if weights is None else chunked_xent(*args, weights)


def _chunks(h_BxQxD, targets_BxQ, chunk: int, weights_BxQ=None):
    """Tokens as C chunks of T ([C, T, D] and [C, T]; the last padded) and the [C, T]
    weights of the tokens: 0 for the padding, else `weights_BxQ` (or 1; None where that
    leaves nothing to weigh)."""
    d = h_BxQxD.shape[-1]
    n = targets_BxQ.size
    t = n if chunk <= 0 or chunk >= n else chunk
    c = -(-n // t)
    pad = c * t - n
    h_CxTxD = jnp.pad(h_BxQxD.reshape(n, d), ((0, pad), (0, 0))).reshape(c, t, d)
    targets_CxT = jnp.pad(targets_BxQ.reshape(n), (0, pad)).reshape(c, t)
    if weights_BxQ is not None:
        return h_CxTxD, targets_CxT, jnp.pad(weights_BxQ.reshape(n), (0, pad)).reshape(c, t)
    mask = (np.arange(c * t) < n).reshape(c, t).astype(np.float32) if pad else None
    return h_CxTxD, targets_CxT, mask


def _logsumexp(logits_TxV, t: int):
    """logsumexp over the whole vocabulary, of which this device has the columns."""
    if t == 1:
        return jax.nn.logsumexp(logits_TxV, axis=-1)
    top_T = tensor.pmax(jnp.max(logits_TxV, axis=-1), t)
    total_T = tensor.psum(jnp.sum(jnp.exp(logits_TxV - top_T[:, None]), axis=-1), t)
    return top_T + jnp.log(total_T)


def _chunk_xent(h_TxD, w_DxV, targets_T, mask_T, dtype, grads: bool, t: int = 1):
    """(summed loss, and with `grads` dh [T, D] and dw [D, V] float32) of one chunk. With
    t tensor devices w and the logits are this device's V/t columns of the vocabulary,
    dh is this device's share of the gradient (`tensor.gather`'s transpose sums them)."""
    f = accumulation(dtype)
    logits_TxV = jnp.einsum("td,dv->tv", h_TxD, w_DxV.astype(dtype), preferred_element_type=f)
    logz_T = _logsumexp(logits_TxV, t)
    columns = logits_TxV.shape[-1]
    local_T = targets_T - tensor.index(t) * columns  # the target's column here, if here
    mine_T = (local_T >= 0) & (local_T < columns)
    found_T = jnp.take_along_axis(logits_TxV, jnp.clip(local_T, 0, columns - 1)[:, None], -1)
    target_T = tensor.psum(jnp.where(mine_T, found_T[:, 0], 0), t)
    per_token = logz_T - target_T
    loss = jnp.sum(per_token if mask_T is None else per_token * mask_T)
    if not grads:
        return loss
    # d loss / d logits = softmax - one_hot(target), in the compute dtype for the matmuls.
    onehot = jax.nn.one_hot(local_T, columns, dtype=f)  # zeros where not here
    d_TxV = jnp.exp(logits_TxV - logz_T[:, None]) - onehot
    if mask_T is not None:
        d_TxV = d_TxV * mask_T[:, None]
    d_TxV = d_TxV.astype(dtype)
    dh = jnp.einsum("tv,dv->td", d_TxV, w_DxV.astype(dtype), preferred_element_type=f)
    dw = jnp.einsum("td,tv->dv", h_TxD, d_TxV, preferred_element_type=f)
    return loss, dh.astype(h_TxD.dtype), dw


def _xent_scan(h_BxQxD, w_DxV, targets_BxQ, dtype, chunk, grads: bool, t: int = 1, weights=None):
    """Chunk by chunk: a loop when there is more than one, so one chunk's logits are live."""
    h_CxTxD, targets_CxT, mask_CxT = _chunks(h_BxQxD, targets_BxQ, chunk, weights)
    one = lambda h, y, m: _chunk_xent(h, w_DxV, y, m, dtype, grads, t)  # noqa: E731
    if h_CxTxD.shape[0] == 1:  # no loop: XLA's cost analysis counts a loop body once
        out = one(h_CxTxD[0], targets_CxT[0], None if mask_CxT is None else mask_CxT[0])
        return out if not grads else (out[0], out[1][None], out[2])

    def body(carry, xs):
        out = one(*xs)
        if not grads:
            return carry + out, None
        loss, dw = carry
        return (loss + out[0], dw + out[2]), out[1]

    f = accumulation(dtype)
    zero = jnp.zeros((), f)
    init = zero if not grads else (zero, jnp.zeros(w_DxV.shape, f))
    carry, dh_CxTxD = jax.lax.scan(body, init, (h_CxTxD, targets_CxT, mask_CxT))
    return carry if not grads else (carry[0], dh_CxTxD, carry[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def chunked_xent(
    h_BxQxD, w_DxV, targets_BxQ, dtype: str, chunk: int, t: int = 1, weights_BxQ=None
) -> jax.Array:
    """Summed cross-entropy of logits h @ w (float32, from `dtype` operands), `chunk`
    tokens at a time. Its gradients are computed in the forward, chunk by chunk (the loss's
    cotangent is a scalar that only scales them): what the backward keeps is dh and dw, not
    the logits, and no chunk's logits are recomputed. With t tensor devices, w holds this
    device's columns of the vocabulary (`_chunk_xent`); the loss is the whole one.
    `weights_BxQ` (float32; None: all 1) weigh each token's loss (0: not counted)."""
    return _xent_scan(h_BxQxD, w_DxV, targets_BxQ, dtype, chunk, False, t, weights_BxQ)


def _chunked_xent_fwd(h_BxQxD, w_DxV, targets_BxQ, dtype, chunk, t, weights_BxQ=None):
    args = (h_BxQxD, w_DxV, targets_BxQ, dtype, chunk, True, t, weights_BxQ)
    loss, dh_CxTxD, dw = _xent_scan(*args)
    dh_BxQxD = dh_CxTxD.reshape(-1, h_BxQxD.shape[-1])[: targets_BxQ.size]
    saved = (dh_BxQxD.reshape(h_BxQxD.shape), dw.astype(w_DxV.dtype), targets_BxQ)
    return loss, saved + (() if weights_BxQ is None else (weights_BxQ,))


def _chunked_xent_bwd(dtype, chunk, t, saved, g):
    dh, dw, targets, *weights = saved
    zeros = np.zeros(targets.shape, jax.dtypes.float0)
    grads = (g * dh).astype(dh.dtype), (g * dw).astype(dw.dtype), zeros
    return grads + ((jnp.zeros_like(weights[0]),) if weights else (None,))


chunked_xent.defvjp(_chunked_xent_fwd, _chunked_xent_bwd)


def hidden(
    params: Params,
    tokens_BxL: jax.Array,
    cfg: GPTConfig,
    segment_lengths: tuple[int, ...] | None = None,
    checkpoint: str | None = None,
    *,
    document_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> jax.Array:
    """The last layer's outputs [B, L, D]; with `segment_lengths`, segment by segment.
    `document_ids` [B, L] (packed rows, 0 padding; `seqpipe.models.document_mask`): each token
    attends only within its document; `positions` [B, L]: where RoPE puts each token (default: its
    index in the row)."""
    batch, seq_len = tokens_BxL.shape
    segment_lengths = segment_lengths or (seq_len,)
    if sum(segment_lengths) != seq_len:
        raise ValueError(f"segment lengths {segment_lengths} do not sum to {seq_len}")
    k_cache, v_cache = empty_kv(cfg, cfg.num_layers, batch)
    outputs, offset = [], 0
    for length in segment_lengths:
        x = embed(params, tokens_BxL[:, offset : offset + length], cfg)
        seg_packing = document_mask.of_rows(document_ids, positions, offset, length, True)
        y, k_seg, v_seg = layers(
            params["layers"],
            x,
            k_cache,
            v_cache,
            offset,
            cfg,
            checkpoint,
            packing=seg_packing,
        )
        k_cache = jnp.concatenate([k_cache, k_seg], axis=2)
        v_cache = jnp.concatenate([v_cache, v_seg], axis=2)
        outputs.append(y)
        offset += length
    return jnp.concatenate(outputs, axis=1)


def forward(
    params: Params,
    tokens_BxL: jax.Array,
    cfg: GPTConfig,
    segment_lengths: tuple[int, ...] | None = None,
    checkpoint: str | None = None,
    *,
    document_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> jax.Array:
    """Logits of the whole model; with `segment_lengths`, computed segment by segment;
    packed rows with `document_ids` and `positions` (`hidden`)."""
    packed = dict(document_ids=document_ids, positions=positions)
    return logits(
        params, hidden(params, tokens_BxL, cfg, segment_lengths, checkpoint, **packed), cfg
    )


def loss(
    params: Params,
    tokens_BxL1: jax.Array,
    cfg: GPTConfig,
    segment_lengths: tuple[int, ...] | None = None,
    checkpoint: str | None = None,
    *,
    documents: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> jax.Array:
    """Mean next-token cross-entropy of a [B, L+1] token window. Packed rows
    (`documents`, `positions` [B, L+1]): the mean over the counted targets
    (`document_mask.counted_targets`), each token attending within its document where
    `cfg.document_mask` says so."""
    inputs, targets = tokens_BxL1[:, :-1], tokens_BxL1[:, 1:]
    if cfg.num_experts:  # the router losses over the pipeline's segments
        cfg = dataclasses.replace(cfg, router_tokens=inputs.size)
        if sum(cfg.router_segments) == inputs.shape[1]:
            segment_lengths = segment_lengths or cfg.router_segments
    if documents is None and positions is None:
        y = hidden(params, inputs, cfg, segment_lengths, checkpoint)
        return head_loss_sum(params, y, targets, cfg) / targets.size
    ids = documents[:, :-1] if documents is not None and cfg.document_mask else None
    pos = None if positions is None else positions[:, :-1]
    y = hidden(params, inputs, cfg, segment_lengths, checkpoint, document_ids=ids, positions=pos)
    if documents is None:
        return head_loss_sum(params, y, targets, cfg) / targets.size
    counted = document_mask.counted_targets(documents)
    total = head_loss_sum(params, y, targets, cfg, counted)
    return total / jnp.maximum(jnp.sum(counted), 1)


def flops_per_token(cfg: GPTConfig, seq_len: int, causal: bool = False) -> float:
    """Training FLOPs per token, PaLM convention: 6N (non-embedding matmuls and head) + 12*N_l*D*L.

    The attention term counts the full L x L score matrix as PaLM does; `causal` halves
    it, the work a kernel that skips masked blocks does (`seqpipe.schedule.partition` accounts for
    the causal shape per segment separately).
    """
    n, d, v = cfg.num_layers, cfg.d_model, cfg.vocab_size
    attention = 12.0 * n * cfg.q_width * seq_len * (0.5 if causal else 1.0)
    return 6.0 * (n * layer_matmul_params(cfg) + d * v) + attention


def layer_matmul_params(cfg: GPTConfig) -> int:
    """Weights of one layer's matmuls that a token goes through: Q and O (D x H*E each), K
    and V (D x K*E each), two MLP matrices (three with swiglu); with experts, the router
    (D x X) and the chosen experts' three each (active parameters), the mean over the
    layers where they mix dense and sparse MLPs. Biases and norm gains are not matmuls."""
    d, kv_width = cfg.d_model, cfg.kv_heads * cfg.head_dim
    attention = 2 * d * cfg.q_width + 2 * d * kv_width
    dense = attention + (3 if cfg.mlp == "swiglu" else 2) * d * cfg.d_ff
    if not cfg.num_experts:
        return dense
    experts = cfg.experts_per_token * 3 * d * cfg.expert_width
    shared = (3 * cfg.shared_expert_d_ff + 1) * d if cfg.shared_expert_d_ff else 0
    sparse = attention + d * cfg.num_experts + experts + shared
    if not cfg.mixed:
        return sparse
    sparse_count = len(cfg.sparse_layers)  # the mean over the layers
    return (sparse_count * sparse + (cfg.num_layers - sparse_count) * dense) / cfg.num_layers
