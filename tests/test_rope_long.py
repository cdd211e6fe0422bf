"""Llama 3.1's RoPE scaling at long positions against transformers' LlamaRotaryEmbedding.

jaxmem's inverse frequencies are a constant made from the config (jaxmem.model.layers.
rope_inv_freq) and equal transformers' bitwise; the cos/sin tables at positions up to 1M
(max_position_embeddings raised past Llama 3.1's 131,072: the same frequencies, applied as is)
agree to a few fp32 ulps, measured 6e-8 on the CPU.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxmem.families import get_preset  # noqa: E402
from jaxmem.io.hf import config_to_hf  # noqa: E402
from jaxmem.model.layers import rope_inv_freq, rope_tables  # noqa: E402

POSITIONS = [0, 1, 2047, 8191, 8192, 65535, 131071, 131072, 200000, 524287, 1048575]
# cos/sin of the same fp32 angle: CPU measured 6e-8 (1 ulp); a GPU's cosf / sinf are within
# 2 ulps of the true value (CUDA's libdevice), so 1e-6 holds on either backend.
ATOL = 1e-6


def _hf_rotary(model_cfg):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(LlamaConfig(**config_to_hf(model_cfg)))


@pytest.mark.parametrize("preset", ["llama-3.1-8b", "llama-3.2-1b"])
def test_llama3_rope_equals_transformers_at_long_positions(preset):
    cfg = get_preset(preset, max_position_embeddings=1048576)
    assert cfg.rope_type == "llama3" and cfg.rope_original_max_position_embeddings == 8192
    hf = _hf_rotary(cfg)
    assert hf.rope_type == "llama3" and hf.attention_scaling == 1.0  # cos/sin are not rescaled
    H = cfg.resolved_head_dim
    ours = np.asarray(rope_inv_freq(H, cfg.rope_theta, cfg.llama3_rope))
    np.testing.assert_array_equal(ours, hf.inv_freq.numpy())
    # the three bands are all there: kept, blended, divided by the factor
    plain = np.asarray(rope_inv_freq(H, cfg.rope_theta))
    assert (ours == plain).any() and np.isclose(ours, plain / cfg.rope_factor).any()
    assert ((ours < plain) & ~np.isclose(ours, plain / cfg.rope_factor)).any()

    pos = np.array([POSITIONS])
    cos_hf, sin_hf = hf(torch.zeros(1, len(POSITIONS), H), torch.tensor(pos))
    cos, sin = (np.asarray(a) for a in rope_tables(pos, H, cfg.rope_theta, cfg.llama3_rope))
    # transformers' tables repeat the H/2 frequencies twice (rotate_half); jaxmem keeps one half
    np.testing.assert_array_equal(cos_hf[..., :H // 2].numpy(), cos_hf[..., H // 2:].numpy())
    np.testing.assert_allclose(cos, cos_hf[..., :H // 2].numpy(), rtol=0, atol=ATOL)
    np.testing.assert_allclose(sin, sin_hf[..., :H // 2].numpy(), rtol=0, atol=ATOL)
    # negative control: plain RoPE at these positions is far from the scaled tables
    cos_plain, _ = rope_tables(pos, H, cfg.rope_theta)
    assert np.abs(np.asarray(cos_plain) - cos_hf[..., :H // 2].numpy())[0, 1:].max() > 0.1


def test_the_scaling_does_not_depend_on_max_position_embeddings():
    """Past 131,072 the same frequencies go on: raising max_position_embeddings changes no
    angle (what docs/long-context.md says "extended" means)."""
    short, long = get_preset("llama-3.1-8b"), get_preset("llama-3.1-8b",
                                                         max_position_embeddings=1048576)
    assert short.llama3_rope == long.llama3_rope
    H = short.resolved_head_dim
    np.testing.assert_array_equal(np.asarray(rope_inv_freq(H, short.rope_theta, short.llama3_rope)),
                                  _hf_rotary(long).inv_freq.numpy())
