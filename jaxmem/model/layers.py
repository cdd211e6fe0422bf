"""Small building blocks of the decoder: RMSNorm, rotary position embeddings, the attention mask.

Each is a few lines of math with no parameters of its own except RMSNorm's `scale`. They compute
their statistics in fp32 whatever the input dtype (PyTorch autocast does the same for norms and
RoPE), and return the input dtype, so the model computes in the dtype of the params it is given.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

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


def rope_tables(positions: jax.Array, head_dim: int, theta: float):
    """cos/sin tables [B, T, H/2] in fp32 for integer positions [B, T]."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
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
