"""Small building blocks of the decoder: RMSNorm, rotary position embeddings, the attention masks.

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


class RMSNorm(nn.Module):
    """x / rms(x) * scale, with the mean square in fp32 (a bf16 sum of squares loses digits).

    plus_one: the weight w is stored as Gemma's checkpoints hold it, initialised to 0, and the
    scale is 1 + w in fp32 (transformers' Gemma3RMSNorm)."""

    eps: float = 1e-5
    plus_one: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],), jnp.float32)  # [D]
        if self.plus_one:
            scale = 1.0 + scale.astype(jnp.float32)
        return rms_norm(x, scale, self.eps)  # the backward keeps x and scale (jaxmem.model.lean)


def rope_inv_freq(head_dim: int, theta: float, llama3: tuple | None = None,
                  linear: float | None = None) -> jax.Array:
    """RoPE's inverse frequencies [H/2] (fp32), optionally with Llama 3's scaling; bitwise
    transformers' (`_compute_default_rope_parameters` / `_compute_llama3_parameters`).

    llama3: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
    wavelengths longer than original/low_freq_factor are stretched by `factor` (those dimensions
    see positions beyond the original training length), wavelengths shorter than
    original/high_freq_factor are kept, and the band between blends the two linearly in
    original/wavelength. The same at every position: nothing depends on how far past
    `original` or `max_position_embeddings` a position is. linear: every frequency divided by
    this factor (transformers' `_compute_linear_scaling_rope_parameters`; Gemma 3's global layers).

    The inputs are Python numbers, so this is a constant made with numpy one fp32 operation at a
    time, as torch does: under jit, XLA rewrites such chains (x / c, a * b + c) and 18 of the 64
    Llama 3.1 frequencies came out an ulp off, which at position 1M moves an angle by 1e-4.
    torch evaluates `2 * math.pi / inv_freq` as reciprocal(inv_freq) * 2pi; so does this.
    """
    f32 = np.float32
    exponent = np.arange(0, head_dim, 2, dtype=f32) / f32(head_dim)
    # theta ** exponent correctly rounded to fp32 (what torch's fp32 pow gives for these)
    inv_freq = f32(1) / (np.float64(theta) ** exponent.astype(np.float64)).astype(f32)
    if llama3 is not None:
        factor, low, high, original = (f32(v) for v in llama3)
        wavelen = (f32(1) / inv_freq) * f32(2 * np.pi)
        scaled = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (f32(1) - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < original / high) & ~(wavelen > original / low)
        inv_freq = np.where(medium, blended, scaled).astype(f32)
    if linear is not None:
        inv_freq = (inv_freq / f32(linear)).astype(f32)
    return jnp.asarray(inv_freq, jnp.float32)


def rope_tables(positions: jax.Array, head_dim: int, theta: float, llama3: tuple | None = None,
                linear: float | None = None):
    """cos/sin tables [B, T, H/2] in fp32 for integer positions [B, T] (llama3, linear:
    rope_inv_freq). For partial rotary `head_dim` is the rotary dims R (frequencies over R, as
    transformers computes them); apply_rope then turns the first R dims of a head."""
    inv_freq = rope_inv_freq(head_dim, theta, llama3, linear)  # [H/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate [B, T, heads, H] by position, Hugging Face's rotate_half layout (halves, not pairs);
    tables [B, T, R/2] of R < H dims turn the first R dims only (partial rotary, Phi-3).

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


def segment_mask(seg_q: jax.Array, seg_k: jax.Array, q_index: jax.Array,
                 k_index: jax.Array) -> jax.Array:
    """[B, 1, Tq, S] boolean mask of packed rows: causal AND same segment AND key not padding.

    seg_q [B, Tq], seg_k [B, S]: segment ids (0 = padding, 1, 2, ... = the k-th example of the
    row); q_index [Tq], k_index [S]: the rows' positions in the sequence (what causality compares).
    A padding query attends to itself only, so no softmax row is empty (no NaN); its output is
    ignored by the loss, and no real query ever sees a key of another segment or of padding.
    """
    causal = q_index[:, None] >= k_index[None, :]  # [Tq, S]
    same = (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_k[:, None, :] != 0)  # [B, Tq, S]
    diag = q_index[:, None] == k_index[None, :]  # [Tq, S]
    return ((causal[None] & same) | diag[None])[:, None]  # [B, 1, Tq, S]


def window_cache_mask(kv_valid: jax.Array, index, n_new: int, ring: int,
                      window: int) -> jax.Array:
    """[B, 1, T, R + T] mask of `n_new` new tokens (slots index..index+T-1) over a local
    layer's ring cache of R = `ring` slots followed by the new tokens themselves.

    Ring entry j holds the latest slot a < index with a = j (mod R) (none when a < 0); a query
    at slot q sees it when that slot is valid and q - a < window, and sees a new token at slot
    s <= q when q - s < window and s is valid (and itself always: no empty softmax row)."""
    B, S = kv_valid.shape
    q_slot = index + jnp.arange(n_new)  # [T]
    held = index - 1 - jnp.mod(index - 1 - jnp.arange(ring), ring)  # [R] slot in each entry
    held_valid = (held >= 0) & jnp.take(kv_valid, jnp.clip(held, 0, S - 1), axis=1)  # [B, R]
    old = held_valid[:, None, :] & (q_slot[:, None] - held[None, :] < window)[None]  # [B, T, R]
    t = jnp.arange(n_new)
    causal = (t[:, None] >= t[None, :]) & (t[:, None] - t[None, :] < window)  # [T, T]
    new_valid = jax.lax.dynamic_slice_in_dim(kv_valid, index, n_new, axis=1)  # [B, T]
    new = (causal[None] & new_valid[:, None, :]) | jnp.eye(n_new, dtype=bool)[None]  # [B, T, T]
    return jnp.concatenate([old, new], axis=2)[:, None]  # [B, 1, T, R + T]


def cache_mask(kv_valid: jax.Array, index, n_new: int) -> jax.Array:
    """[B, 1, T, S] mask of `n_new` new tokens written at cache slots index..index+T-1.

    kv_valid [B, S]: True for cache slots that hold a real token (left-padded prompts leave
    False slots at the front of a row). A new token sees the valid slots up to its own; a padded
    one sees itself (no empty softmax row; its output is never used).
    """
    slots = jnp.arange(kv_valid.shape[1])  # [S]
    q_slot = index + jnp.arange(n_new)  # [T]
    causal = q_slot[:, None] >= slots[None, :]  # [T, S]
    diag = q_slot[:, None] == slots[None, :]  # [T, S]
    return ((causal[None] & kv_valid[:, None, :]) | diag[None])[:, None]  # [B, 1, T, S]
