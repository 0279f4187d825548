"""Rotary position embeddings: inverse frequencies, with the ways a context is extended.

`inverse_frequencies` follows transformers' `modeling_rope_utils` (`rope_type` default,
`linear`, `llama3`, `yarn`) formula for formula, so a checkpoint trained with one of them
sees the same angles here. Pure NumPy (float64): the angles depend only on static shapes,
so a backward never stores them.
"""

import dataclasses
import math

import numpy as np

SCALINGS = ("none", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """`model.rope_scaling`: `type` one of SCALINGS; `factor` how much longer the context
    gets (linear, llama3, yarn); llama3's `low_freq_factor`, `high_freq_factor`; the
    pretrained context `original_max_position_embeddings` (llama3, yarn); yarn's
    `beta_fast`, `beta_slow` (its ramp, in rotations). Yarn's attention factor is
    transformers' default, 0.1 ln(factor) + 1."""

    type: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    @classmethod
    def from_config(cls, section) -> "RopeScaling":
        if isinstance(section, cls):
            return section
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in dict(section or {}).items() if k in names})


NO_SCALING = RopeScaling()


def default_frequencies(head_dim: int, base: float) -> np.ndarray:
    """base^(-2i / head_dim), i < head_dim / 2."""
    return 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def inverse_frequencies(head_dim: int, base: float, scaling: RopeScaling) -> np.ndarray:
    """The [head_dim / 2] inverse frequencies (radians per position) of `scaling`."""
    inv = default_frequencies(head_dim, base)
    kind, factor = scaling.type, scaling.factor
    if kind == "none":
        return inv
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        return _llama3(inv, scaling)
    if kind == "yarn":
        return _yarn(inv, head_dim, base, scaling)
    raise ValueError(f"rope scaling {kind!r} is not one of {list(SCALINGS)}")


def _llama3(inv: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama 3.1: wavelengths above original / low_freq_factor are stretched by `factor`,
    below original / high_freq_factor kept, and interpolated smoothly between."""
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled)


def _yarn(inv: np.ndarray, head_dim: int, base: float, s: RopeScaling) -> np.ndarray:
    """YaRN: interpolated (divided by `factor`) below the dimension that turns beta_slow
    times over the original context, extrapolated (kept) above the one that turns beta_fast
    times, a linear ramp between (transformers' truncated correction range)."""

    def correction_dim(rotations):
        ctx = s.original_max_position_embeddings
        return head_dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp
    return (inv / s.factor) * (1 - extrapolated) + inv * extrapolated


def attention_factor(scaling: RopeScaling) -> float:
    """What cos and sin are multiplied by: yarn's 0.1 ln(factor) + 1 (1 for a factor <= 1),
    1 for every other scaling."""
    if scaling.type != "yarn" or scaling.factor <= 1:
        return 1.0
    return 0.1 * math.log(scaling.factor) + 1.0


def tables(
    positions: np.ndarray, head_dim: int, base: float, scaling: RopeScaling, dtype=np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) [len(positions), head_dim / 2] at the given absolute positions, computed
    in float64 and given in `dtype` (float32; float64 for a float64 model)."""
    angle = positions.astype(np.float64)[:, None] * inverse_frequencies(head_dim, base, scaling)
    mscale = attention_factor(scaling)
    return (
        (np.cos(angle) * mscale).astype(dtype),
        (np.sin(angle) * mscale).astype(dtype),
    )
