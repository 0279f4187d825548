"""A mixture-of-experts MLP (Mixtral's, Qwen3-MoE's): a router picks `experts_per_token` of
`num_experts` SwiGLU experts per token, and the token's output is their outputs weighted
by the router's probabilities (renormalized over the chosen ones where the family does so).

Dropless: the token-expert assignments are sorted by expert and each expert's run of
tokens is multiplied by its weights in one grouped matmul (`jax.lax.ragged_dot`), so a
token costs its chosen experts alone and no token is dropped.

Router losses (`moe_aux_loss`, `moe_z_loss`) are computed per unit of work: per layer, row
and segment, over the tokens of that row in that segment, which a pipeline stage has
whole when it runs the segment (across its tensor and context devices). The
load-balancing loss is Switch Transformer's, as transformers computes it for one layer and
one sequence: X * sum_e f_e * P_e, f_e the share of the segment's assignments that went to
expert e (k per token, so f sums to k), P_e its mean router probability. The z-loss is
the mean of logsumexp(router logits)^2. Each is averaged over the sparse layers and over the
batch's tokens (a segment weighs as its share of the row), and enters the training
objective with its coefficient through its gradient alone (`_with_router_losses`): the
executor's backward runs a unit's vjp, and this adds the router losses' gradients to it
wherever the layer is differentiated, with no output of its own. The loss the trainer
reports is the language model's.

Their values come out the same way, as the gradient of a meter: a zero parameter
`router_meter` [N, 3] (`model.metered`) whose cotangent is each unit's (load-balancing,
z) values, unscaled, and the share of its assignments a capacity dropped. Its gradient is
then every layer's, summed by the same accumulators and reductions as every other
gradient, over units, stages, tensor and context devices, and averaged over data
replicas (`model.router_metrics` reads it).

With a capacity factor (`moe_capacity_factor` > 0) each expert takes at most
ceil(factor x L x k / X) of the assignments of a row's segment of L tokens, those with
the highest routing weights (Megatron-LM's "probs" drop policy: it needs no order of
the positions, which context parallelism permutes); a dropped assignment adds nothing
to its token's output.

Parameters, per layer (HF Mixtral / Qwen3-MoE names in brackets, transposed):
  router  [N, D, X]     (block_sparse_moe.gate / mlp.gate)
  e_gate  [N, X, D, F]  (experts.j.w1 / gate_proj)
  e_in    [N, X, D, F]  (experts.j.w3 / up_proj)
  e_out   [N, X, F, D]  (experts.j.w2 / down_proj)
F = `expert_d_ff`. With `shared_expert_d_ff` (Qwen 2 MoE's shared expert and its gate):
  s_gate, s_in [N, D, S], s_out [N, S, D]  (shared_expert.gate/up/down_proj)
  s_router [N, D]                         (shared_expert_gate, [1, D])
Under tensor parallelism each expert's F columns are split as a dense MLP's: each device
routes its own positions, gathers the segment's tokens and routing, runs its columns of
every chosen expert, and leaves partial sums for the reduce-scatter. Over data replicas
the experts themselves are split (`mlp`: expert parallelism).
"""

import functools
import math

import jax
import jax.numpy as jnp

from seqpipe.parallel import tensor
from seqpipe.parallel.sharding import DATA

PARAMS = ("router", "e_gate", "e_in", "e_out")
METER = "router_meter"  # [N, len(METERED)]: its gradient is each layer's METERED values
METERED = ("aux_loss", "z_loss", "dropped")
EXPERTS = PARAMS[1:]  # [N, X, ...]: split over the data replicas (expert parallelism)
SHARED = ("s_gate", "s_in", "s_out", "s_router")  # the shared expert and its gate


def init(cfg, normal, n: int, std: float, out_std: float) -> dict:
    """A stack of n layers' MoE parameters, drawn by `normal(shape, std)`."""
    d, x, f, s = cfg.d_model, cfg.num_experts, cfg.expert_width, cfg.shared_expert_d_ff
    params = {
        "router": normal((n, d, x), std),
        "e_gate": normal((n, x, d, f), std),
        "e_in": normal((n, x, d, f), std),
        "e_out": normal((n, x, f, d), out_std),
    }
    if s:
        params.update(
            s_gate=normal((n, d, s), std),
            s_in=normal((n, d, s), std),
            s_out=normal((n, s, d), out_std),
            s_router=normal((n, d), std),
        )
    return params


def route(h_BxQxD, router_DxX, k: int, renormalize: bool):
    """(probabilities [b, Q, X] float32, router logits, chosen experts [b, Q, k], their
    weights [b, Q, k]): softmax over every expert, then the top k, renormalized to sum to
    one where `renormalize` (Mixtral; Qwen3-MoE's norm_topk_prob)."""
    logits = jnp.einsum("bqd,dx->bqx", h_BxQxD, router_DxX).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, chosen = jax.lax.top_k(probs, k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, logits, chosen, weights


def experts(h_TxD, chosen_Txk, weights_Txk, e_gate, e_in, e_out):
    """sum_j weights[t, j] * expert_{chosen[t, j]}(h[t]) for every token, [T, D]: the
    assignments sorted by expert, each expert's run through its SwiGLU by `ragged_dot`
    (an id past the experts is in no group: its rows give zeros)."""
    tokens, k = chosen_Txk.shape
    flat = chosen_Txk.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=e_gate.shape[0]).astype(jnp.int32)
    x = h_TxD[order // k]
    gate = jax.lax.ragged_dot(x, e_gate, sizes)
    up = jax.lax.ragged_dot(x, e_in, sizes)
    act = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)
    y = jax.lax.ragged_dot(act, e_out, sizes)
    y = y * weights_Txk.reshape(-1)[order][:, None].astype(y.dtype)
    unsorted = jnp.zeros_like(y).at[order].set(y)
    return unsorted.reshape(tokens, k, -1).sum(axis=1)


def capacity(cfg, length: int) -> int:
    """Assignments each expert keeps of a row's segment of `length` tokens."""
    return math.ceil(cfg.moe_capacity_factor * length * cfg.experts_per_token / cfg.num_experts)


def _size(axis: str | None) -> int:
    return 1 if axis is None else jax.lax.axis_size(axis)


def capped(chosen_BxQxk, weights_BxQxk, cfg, axes: tuple[str, ...]):
    """(chosen, weights, assignments dropped [b]) under the capacity factor: of a row's
    segment, whose positions are split over the devices of `axes`, each expert keeps the
    ceil(factor x L x k / X) assignments of the highest weights; the others go to no
    expert (id X) with weight zero. Ties between equal weights fall to the gathered order."""
    b, q, k = chosen_BxQxk.shape
    x = cfg.num_experts
    rows = jnp.arange(b)[:, None]

    def gather(a):  # the row's segment's assignments, [b, L x k]: only their order is used
        a = jax.lax.stop_gradient(a)
        return (jax.lax.all_gather(a, axes, axis=1, tiled=True) if axes else a).reshape(b, -1)

    every, weights = gather(chosen_BxQxk), gather(weights_BxQxk)
    kept = capacity(cfg, every.shape[1] // k)
    order = jnp.lexsort((-weights, every), axis=-1)  # by expert, the highest weights first
    by_expert = jnp.take_along_axis(every, order, axis=-1)
    counts = jnp.zeros((b, x), jnp.int32).at[rows, every].add(1)
    starts = jnp.cumsum(counts, axis=-1) - counts
    rank = jnp.arange(every.shape[1]) - jnp.take_along_axis(starts, by_expert, axis=-1)
    keep = jnp.zeros_like(rank, bool).at[rows, order].set(rank < kept)
    mine = jax.lax.axis_index(axes) if axes else 0
    keep = jax.lax.dynamic_slice_in_dim(keep.reshape(b, -1, q, k), mine, 1, axis=1)[:, 0]
    dropped = jnp.sum(~keep, axis=(1, 2)).astype(jnp.float32)
    return jnp.where(keep, chosen_BxQxk, x), jnp.where(keep, weights_BxQxk, 0), dropped


def router_losses(probs, logits, chosen, cfg, axes: tuple[str, ...], dropped=None):
    """This device's share of the layer's METERED values [3]: its (load-balancing, z)
    losses, unscaled and normalized as the module docstring says, and the share of its
    assignments dropped (`dropped` [b], None: none); summed over the devices of `axes`
    (tensor, context: those that split the segment's positions) they are the layer's."""
    count = jnp.sum(jax.nn.one_hot(chosen, cfg.num_experts, dtype=jnp.float32), axis=(1, 2))
    if axes:
        count = jax.lax.psum(count, axes)
    count = jax.lax.stop_gradient(count)  # [b, X], k per token of the row's segment
    segment = jnp.sum(count, axis=-1, keepdims=True) / cfg.experts_per_token
    norm = len(cfg.sparse_layers) * cfg.router_tokens
    aux = cfg.num_experts * jnp.sum(count / segment * jnp.sum(probs, axis=1)) / norm
    z = jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2) / norm
    share = 0.0 if dropped is None else jnp.sum(dropped) / (norm * cfg.experts_per_token)
    return jnp.stack([aux, z, share])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _with_router_losses(x, losses, coefficients, meter):
    """x; its backward also gives `losses` their `coefficients` as cotangent (their
    gradients join whatever flows through x) and `meter` their values."""
    return x


def _with_router_losses_fwd(x, losses, coefficients, meter):
    return x, (jax.lax.stop_gradient(losses), jnp.zeros((0,), meter.dtype))


def _with_router_losses_bwd(coefficients, saved, g):
    values, meter_like = saved
    return g, jnp.asarray(coefficients, values.dtype), values.astype(meter_like.dtype)


_with_router_losses.defvjp(_with_router_losses_fwd, _with_router_losses_bwd)


def local_experts(h_TxD, chosen_Txk, weights_Txk, e_gate, e_in, e_out, first):
    """`experts` of the assignments to this device's experts alone, `first` to `first` +
    its count (expert parallelism): the others' are sorted after every group (their count
    falls outside the bincount), where `ragged_dot` gives zeros."""
    local = e_gate.shape[0]
    mine = (chosen_Txk >= first) & (chosen_Txk < first + local)
    chosen = jnp.where(mine, chosen_Txk - first, local)
    return experts(h_TxD, chosen, weights_Txk, e_gate, e_in, e_out)


def exchanged(h_TxD, chosen_Txk, weights_Txk, e_gate, e_in, e_out, slots: int):
    """`experts` with the experts split over the data replicas, each assignment sent to its
    expert's device and its output back by all-to-all (GShard's dispatch): buffers of
    `slots` assignments per expert, which the capacity bounds (a dropped assignment, id
    X, is sent nowhere), so each expert runs its slots as one batched matmul."""
    tokens, k = chosen_Txk.shape
    local, d = e_gate.shape[0], jax.lax.axis_size(DATA)
    x, width = local * d, h_TxD.shape[1]
    flat = chosen_Txk.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # each expert's assignments, in token order
    counts = jnp.bincount(flat, length=x + 1)
    rank = jnp.arange(flat.size) - (jnp.cumsum(counts) - counts)[flat[order]]
    slot = jnp.zeros_like(flat).at[order].set(rank)  # an assignment's place in its buffer
    at = jnp.where(flat < x, flat * slots + slot, x * slots)  # past the buffers: not sent
    tokens_of = jnp.arange(flat.size) // k
    send = jnp.zeros((x * slots, width), h_TxD.dtype).at[at].set(h_TxD[tokens_of], mode="drop")
    recv = jax.lax.all_to_all(send.reshape(d, local, slots, width), DATA, 0, 0)
    h = recv.transpose(1, 0, 2, 3).reshape(local, d * slots, width)  # each expert's slots
    gate = jnp.einsum("esd,edf->esf", h, e_gate)
    up = jnp.einsum("esd,edf->esf", h, e_in)
    act = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(h.dtype)
    y = jnp.einsum("esf,efd->esd", act, e_out).reshape(local, d, slots, width)
    back = jax.lax.all_to_all(y.transpose(1, 0, 2, 3), DATA, 0, 0).reshape(x * slots, width)
    y = back.at[at].get(mode="fill", fill_value=0)
    y = y * weights_Txk.reshape(-1)[:, None].astype(y.dtype)
    return y.reshape(tokens, k, width).sum(axis=1)


def shared_expert(p, h_BxQxD, segment_BxQxD, t: int):
    """Qwen 2 MoE's shared expert, which every token goes through: a SwiGLU MLP scaled by
    sigmoid(h . s_router). Under tensor parallelism its columns split as a dense MLP's
    (partial sums over the segment), and each device gates its own positions (a gate
    computed from the gathered segment on every device would add t copies of its
    gradient) and gathers the gates."""
    gate = jnp.einsum("bqd,d->bq", h_BxQxD, p["s_router"]).astype(jnp.float32)
    gate = tensor.gather(jax.nn.sigmoid(gate)[..., None], t)
    up = jnp.einsum("bqd,df->bqf", segment_BxQxD, p["s_in"])
    act = jax.nn.silu(jnp.einsum("bqd,df->bqf", segment_BxQxD, p["s_gate"]).astype(jnp.float32))
    y = jnp.einsum("bqf,fd->bqd", (act * up.astype(jnp.float32)).astype(up.dtype), p["s_out"])
    return (gate * y.astype(jnp.float32)).astype(y.dtype)


def mlp(p, h_BxQxD, cfg, context_axis: str | None = None):
    """The MoE MLP on this device's positions [b, Q/t, D] (normed): partial sums over the
    whole segment [b, Q, D] under tensor parallelism (the caller's reduce-scatter adds
    them), else the output; the router losses' gradients ride on it. `context_axis`: the
    mesh axis the segment's positions are also split over (context parallelism), if any.

    With experts split over the data replicas (`cfg.expert_parallel` > 1) every replica's
    tokens and routing are gathered over `data`, each device runs its own experts'
    assignments, and a reduce-scatter returns each replica its tokens' sums; or, with
    `moe_dispatch` all_to_all, each assignment goes to its expert's device and back
    (`exchanged`)."""
    t, e = cfg.tensor, cfg.expert_parallel
    probs, logits, chosen, weights = route(
        h_BxQxD, p["router"], cfg.experts_per_token, cfg.router_renormalize
    )
    # The devices that split the segment's positions.
    axes = ((tensor.AXIS,) if t > 1 else ()) + ((context_axis,) if context_axis else ())
    kept, dropped = chosen, None
    if cfg.moe_capacity_factor:
        kept, weights, dropped = capped(chosen, weights, cfg, axes)
    segment, gathered_weights = tensor.gather(h_BxQxD, t), tensor.gather(weights, t)
    # The chosen experts carry no gradient: a plain gather.
    gathered = kept if t == 1 else jax.lax.all_gather(kept, tensor.AXIS, axis=1, tiled=True)
    b, q, d = segment.shape
    h, gathered, gathered_weights = (
        x.reshape(b * q, -1) for x in (segment, gathered, gathered_weights)
    )
    if e == 1:
        y = experts(h, gathered, gathered_weights, p["e_gate"], p["e_in"], p["e_out"])
    elif cfg.moe_dispatch == "all_to_all":
        # A row's segment keeps at most `capacity` assignments an expert: b rows, b x that.
        slots = min(b * capacity(cfg, q * _size(context_axis)), h.shape[0] * cfg.experts_per_token)
        y = exchanged(h, gathered, gathered_weights, p["e_gate"], p["e_in"], p["e_out"], slots)
    else:
        h, gathered_weights = (tensor.all_gather(x, DATA, 0) for x in (h, gathered_weights))
        gathered = jax.lax.all_gather(gathered, DATA, axis=0, tiled=True)
        first = jax.lax.axis_index(DATA) * p["e_gate"].shape[0]
        y = local_experts(h, gathered, gathered_weights, p["e_gate"], p["e_in"], p["e_out"], first)
        y = tensor.reduce_scatter(y, DATA, 0)
    y = y.reshape(b, q, d)
    if cfg.shared_expert_d_ff:
        y = y + shared_expert(p, h_BxQxD, segment, t)
    meter = p.get(METER)
    if not (cfg.moe_aux_loss or cfg.moe_z_loss or meter is not None):
        return y
    losses = router_losses(probs, logits, chosen, cfg, axes, dropped)
    meter = jnp.zeros(len(METERED), jnp.float32) if meter is None else meter
    return _with_router_losses(y, losses, (cfg.moe_aux_loss, cfg.moe_z_loss, 0.0), meter)
