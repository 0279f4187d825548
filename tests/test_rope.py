"""Rope scaling's inverse frequencies (`seqpipe.kernels.rope`) against values worked out by hand
from transformers' formulas (`modeling_rope_utils`), and the Llama-family keys' checks."""

import math
import re

import numpy as np
import pytest

from seqpipe.kernels import rope
from seqpipe.kernels.rope import RopeScaling
from seqpipe.run import config as config_lib

# head_dim 8, base 10000: the default frequencies are 10000^(-i/4) = 1, 0.1, 0.01, 0.001.
PLAIN = [1.0, 0.1, 0.01, 0.001]


def test_default_and_linear():
    np.testing.assert_allclose(rope.inverse_frequencies(8, 1e4, RopeScaling()), PLAIN, rtol=1e-12)
    linear = RopeScaling(type="linear", factor=4.0)
    np.testing.assert_allclose(
        rope.inverse_frequencies(8, 1e4, linear), np.divide(PLAIN, 4), rtol=1e-12
    )
    assert rope.attention_factor(linear) == 1.0


def test_llama3_by_hand():
    """Original context 1024, low/high frequency factors 1 and 4: wavelengths (2 pi / f)
    6.3 and 63 are under 1024 / 4 = 256 (kept), 6283 over 1024 (divided by the factor 8),
    628 between: interpolated with smooth = (1024 / 628.3 - 1) / (4 - 1)."""
    s = RopeScaling(
        type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=1024,
    )
    smooth = (1024 / (2 * math.pi / 0.01) - 1) / 3
    want = [1.0, 0.1, (1 - smooth) * 0.01 / 8 + smooth * 0.01, 0.001 / 8]
    np.testing.assert_allclose(rope.inverse_frequencies(8, 1e4, s), want, rtol=1e-12)
    assert 0.2 < smooth < 0.22


def test_yarn_by_hand():
    """Original context 32, beta 32 and 1: the correction range is
    [floor(8 ln(32 / (32 * 2 pi)) / (2 ln 1e4)), ceil(8 ln(32 / (2 pi)) / (2 ln 1e4))]
    = [floor(-0.80), ceil(0.71)] -> [0, 1]: the first frequency is kept (extrapolated),
    the rest divided by the factor 4 (interpolated). cos and sin are scaled by
    0.1 ln 4 + 1."""
    s = RopeScaling(type="yarn", factor=4.0, original_max_position_embeddings=32)
    want = [1.0, 0.1 / 4, 0.01 / 4, 0.001 / 4]
    np.testing.assert_allclose(rope.inverse_frequencies(8, 1e4, s), want, rtol=1e-12)
    assert rope.attention_factor(s) == pytest.approx(0.1 * math.log(4) + 1)
    cos, sin = rope.tables(np.array([0, 3]), 8, 1e4, s)
    assert cos[0, 0] == pytest.approx(0.1 * math.log(4) + 1, rel=1e-6)
    np.testing.assert_allclose(sin[1], np.sin(3 * np.array(want)) * 1.1386294, rtol=1e-6)


def test_yarn_ramp_between_two_dimensions():
    """head_dim 16, original context 4096: the range is [floor(16 ln(4096 / (64 pi)) /
    (2 ln 1e4)), ceil(16 ln(4096 / (2 pi)) / (2 ln 1e4))] = [floor(2.62), ceil(5.63)] =
    [2, 6]: dimensions i <= 2 kept, i >= 6 interpolated (divided by the factor 2), i = 3,
    4, 5 a quarter, half and three quarters of the way."""
    s = RopeScaling(type="yarn", factor=2.0, original_max_position_embeddings=4096)
    inv = 1e4 ** (-np.arange(8) / 8)
    ramp = np.array([0, 0, 0, 0.25, 0.5, 0.75, 1, 1])
    want = inv / 2 * ramp + inv * (1 - ramp)
    np.testing.assert_allclose(rope.inverse_frequencies(16, 1e4, s), want, rtol=1e-12)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("num_kv_heads", 3, "model.num_kv_heads=3 must divide model.num_heads=4"),
        ("mlp", "relu", "model.mlp='relu' is not valid; choose one of ['gelu', 'swiglu']"),
        ("norm_eps", 0.0, "model.norm_eps=0.0 must be > 0"),
    ],
)
def test_llama_keys_refused_in_one_line(key, value, message):
    c = config_lib.base_config()
    c.model[key] = value
    with pytest.raises(config_lib.ConfigError, match=re.escape(message)) as e:
        config_lib.validate(c)
    assert "\n" not in str(e.value)


def test_rope_scaling_section_checked_in_one_line():
    c = config_lib.base_config()
    c.model.rope_scaling.update(type="llama3", low_freq_factor=4.0, high_freq_factor=4.0)
    with pytest.raises(config_lib.ConfigError, match="high_freq_factor=4.0 must exceed") as e:
        config_lib.validate(c)
    assert "\n" not in str(e.value)
    c = config_lib.base_config()
    c.model.rope_scaling = {"type": "linear"}  # a file that replaced the section
    with pytest.raises(config_lib.ConfigError, match="rope_scaling.factor is missing"):
        config_lib.validate(c)
    with pytest.raises(config_lib.ConfigError, match="rope_scaling.kind: unknown key"):
        config_lib.apply_overrides(config_lib.base_config(), {"model.rope_scaling.kind": "x"})


def test_a_file_with_an_unknown_rope_scaling_key_is_refused(tmp_path):
    path = tmp_path / "typo.py"
    path.write_text(
        "from seqpipe.run.config import base_config\n"
        "def get_config():\n"
        "    c = base_config()\n"
        "    c.model.rope_scaling.update(type='linear', factr=2.0)\n"
        "    return c\n"
    )
    with pytest.raises(config_lib.ConfigError, match="config key model.rope_scaling.factr is"):
        config_lib.load(str(path))
