"""Small building blocks of the decoder: RMSNorm, rotary position embeddings, the attention mask.

Each is a few lines of math with no parameters of its own except RMSNorm's `scale`. They compute
their statistics in fp32 whatever the input dtype (PyTorch autocast does the same for norms and
RoPE), and return the input dtype, so the model computes in the dtype of the params it is given.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.model.lean import rms_norm, rope


def scaled_normal(fan_in: int):
    """N(0, fan_in^-1/2) init: unit-variance outputs for unit-variance inputs."""
    return nn.initializers.normal(stddev=fan_in ** -0.5)


def cpu_lacks(dtype) -> bool:
    """XLA:CPU has no fp16 x fp16 -> fp32 dot (attention, LM head); there we upcast operands.

    Only the CPU backend takes this path, where fp16 is emulated anyway and makes no memory claim.
    """
    return jnp.dtype(dtype) == jnp.float16 and jax.default_backend() == "cpu"


class RMSNorm(nn.Module):
    """x / rms(x) * scale, with the mean square in fp32 (a bf16 sum of squares loses digits)."""

    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)  # [D]
        return rms_norm(x, scale, self.eps)  # the backward keeps x and scale (jaxmem.model.lean)


def rope_inv_freq(head_dim: int, theta: float, llama3: tuple | None = None) -> jax.Array:
    """RoPE's inverse frequencies [H/2] (fp32), optionally with Llama 3's scaling.

    llama3: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings), as
    transformers' `_compute_llama3_parameters`: wavelengths longer than original/low_freq_factor
    are stretched by `factor` (those dimensions see positions beyond the original training
    length), wavelengths shorter than original/high_freq_factor are kept, and the band between
    blends the two linearly in original/wavelength. fp32 throughout, like transformers.
    """
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if llama3 is None:
        return inv_freq
    factor, low, high, original = (jnp.float32(v) for v in llama3)
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = jnp.float32(2 * np.pi) / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return jnp.where(medium, blended, scaled)


def rope_tables(positions: jax.Array, head_dim: int, theta: float, llama3: tuple | None = None):
    """cos/sin tables [B, T, H/2] in fp32 for integer positions [B, T] (llama3: rope_inv_freq)."""
    inv_freq = rope_inv_freq(head_dim, theta, llama3)  # [H/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate [B, T, heads, H] by position, Hugging Face's rotate_half layout (halves, not pairs).

    The backward keeps only cos/sin (jaxmem.model.lean.rope)."""
    return rope(x, cos, sin)


def attention_mask(padding_mask: jax.Array | None, seq_len: int) -> jax.Array | None:
    """[B, 1, T, S] boolean mask: causal AND key-is-not-padding, or None for causal only.

    A padded query still attends to itself, so no softmax row is empty (no NaN); its output is
    ignored by the loss, and no real query ever attends to a padded key.
    """
    if padding_mask is None:
        return None
    causal = jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool))  # [T, S]
    mask = causal[None] & padding_mask.astype(bool)[:, None, :]  # [B, T, S]
    mask = mask | jnp.eye(seq_len, dtype=bool)[None]
    return mask[:, None]  # [B, 1, T, S]
