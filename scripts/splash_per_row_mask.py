"""Whether a per-row mask lets splash skip by documents (docs/long-context.md, "Packed
documents: kernels"): splash built inside `jax.vmap` from a traced [Q, P + Q] boolean mask
(its "dynamic" mask) per row, in interpret mode, against dense attention with the same mask:
the output and the gradients of q, k, v, and the blocks each row's mask info keeps.

    .venv/bin/python scripts/splash_per_row_mask.py

Private API of jax 0.10.2: `_make_splash_attention` turns every field of the mask info
into an array, its `is_dynamic_mask` flag included, which `jit` then cannot branch on; the
flag is put back.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

Q, P, E, BLOCK = 128, 256, 128, 128
SIZES = sa.BlockSizes(
    block_q=BLOCK,
    block_kv=BLOCK,
    block_kv_compute=BLOCK,
    block_q_dkv=BLOCK,
    block_kv_dkv=BLOCK,
    block_kv_dkv_compute=BLOCK,
    block_q_dq=BLOCK,
    block_kv_dq=BLOCK,
)
# Row 0: documents [0, 300), [300, 384); row 1: [0, 100), [100, 200), [200, 384): the
# segment's queries (keys 256..383) see nothing of row 1's first key block.
IDS = np.stack([np.repeat([1, 2], [300, 84]), np.repeat([1, 2, 3], [100, 100, 184])])


def document_mask(kv_ids):
    causal = jnp.arange(P + Q)[None, :] <= P + jnp.arange(Q)[:, None]
    return causal & (kv_ids[P:, None] == kv_ids[None, :])


def splash_row(q, k, v, kv_ids):
    kernel = sk._make_splash_attention(
        document_mask(kv_ids)[None],
        block_sizes=SIZES,
        is_mqa=False,
        head_shards=1,
        q_seq_shards=1,
        interpret=True,
    )

    def dynamic(info):
        return None if info is None else info._replace(is_dynamic_mask=True)

    infos = (kernel.fwd_mask_info, kernel.dq_mask_info, kernel.dkv_mask_info)
    kernel = sk.SplashAttentionKernel(*(dynamic(i) for i in infos), **kernel.kwargs)
    return kernel(q, k, v), kernel.fwd_mask_info.block_mask[0, 0]


def dense(q, k, v, ids):
    mask = jax.vmap(document_mask)(ids)[:, None]
    s = jnp.einsum("bhqe,bhke->bhqk", q, k, precision="highest")
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), -1)
    return jnp.einsum("bhqk,bhke->bhqe", p, v, precision="highest")


def main() -> None:
    ids = jnp.asarray(IDS, jnp.int32)
    q, k, v = (
        jax.random.normal(jax.random.key(i), (2, 1, n, E))
        for i, n in ((0, Q), (1, P + Q), (2, P + Q))
    )
    weights = jnp.cos(jnp.arange(E))

    def splash_loss(q, k, v):
        out, _ = jax.vmap(splash_row)(q, k, v, ids)
        return (out * weights).sum()

    def dense_loss(q, k, v):
        return (dense(q, k, v, ids) * weights).sum()

    _, blocks = jax.jit(jax.vmap(splash_row))(q, k, v, ids)
    got = jax.jit(jax.value_and_grad(splash_loss, argnums=(0, 1, 2)))(q, k, v)
    want = jax.value_and_grad(dense_loss, argnums=(0, 1, 2))(q, k, v)
    print("blocks kept per row (0 empty, 1 partial, 2 full):", np.asarray(blocks).tolist())
    print("loss error:", float(abs(got[0] - want[0])))
    for name, x, y in zip(("dq", "dk", "dv"), got[1], want[1], strict=True):
        print(
            f"{name} error relative to its largest entry:",
            float(jnp.abs(x - y).max() / jnp.abs(y).max()),
        )


if __name__ == "__main__":
    main()
