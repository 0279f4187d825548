"""What the attention-kernel tests share: a K/V prefix held in a cache among neighbours,
and the MLIR verifier's verdict on the Triton modules JAX lowers."""

import jax
import jax.numpy as jnp

from seqpipe.kernels import kv_cache


def in_cache(kp, vp, dtype):
    """A `kv_cache.Prefix` holding kp, vp in slot 1, layer 2 of two-slot, three-layer caches
    (stored as words) whose other positions hold 7s, as the executor's neighbours would
    (slot and layer differ, so reading one for the other fails)."""
    b, length, h, e = kp.shape
    base = jnp.full((2, 3, b, length + 5, h, e), 7.0, dtype)
    words = [
        kv_cache.to_words(base.at[1, 2, :, :length].set(jax.lax.stop_gradient(x).astype(dtype)))
        for x in (kp, vp)
    ]
    return kv_cache.Prefix(*words, jnp.int32(1), jnp.int32(2))


def verify_triton_lowerings(monkeypatch) -> list:
    """The MLIR verifier's verdict on each Triton module JAX lowers from here on."""
    from jax._src.pallas.triton import lowering

    verified = []
    lower = lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        verified.append(result.module.operation.verify())
        return result

    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    return verified
