"""Backward passes that keep only what they need: SwiGLU, RMSNorm and RoPE as custom VJPs.

jax's autodiff keeps every elementwise intermediate its backward reads: for SwiGLU
`silu(gate) * up` that is gate, up, sigmoid(gate), silu(gate) and the product besides the
product's copy the down projection keeps (six [B, T, F] tensors per layer where PyTorch keeps
three); RMSNorm keeps an fp32 copy of its input, the normalized value and two statistics; RoPE
keeps four broadcast cos/sin tables per layer. Here each keeps its inputs only and recomputes
the rest in the backward (a few elementwise ops per element, no matmul), the way attention
recomputes its probabilities (jaxmem.model.attention):

    swiglu(gate, up)            keeps gate, up                 [B, T, F] x 2
    geglu(gate, up)             keeps gate, up                 (Gemma's GELU-tanh gate)
    rms_norm(x, scale, eps)     keeps x, scale                 (the statistic is recomputed)
    rope(x, cos, sin)           keeps cos, sin                 (the rotation is linear in x)

A custom VJP, not a nested `jax.checkpoint`: inside a block's `nn.remat` an inner checkpoint's
policy is overridden by the outer one, while a custom VJP's backward only ever sees the residuals
its forward returns. The remat tags stay outside these functions (on gate, up and the product in
jaxmem.families.decoder), so `names:mlp_gate,mlp_up` still keeps exactly those tensors and every other
policy recomputes them (tests/test_lean.py checks both with jax's saved residuals).

Numerics: the forward is the same expression as before. The backward is the analytic derivative;
in fp32 it equals autodiff's to rounding (tests: 1e-6 relative), in bf16/fp16 it rounds at
different points, so low-precision gradients differ from the autodiff ones in the last bits.
RoPE's cos/sin come from integer positions, so they get no cotangent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


# --- SwiGLU -----------------------------------------------------------------------------------

@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up, elementwise [B, T, F], in the inputs' dtype."""
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(res, d):
    gate, up = res
    sig = jax.nn.sigmoid(gate)
    silu = gate * sig
    d_gate = d * up * (sig * (1 + gate * (1 - sig)))  # d silu/d gate = s (1 + g (1 - s))
    return d_gate.astype(gate.dtype), (d * silu).astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


_GELU_C = (2 / 3.141592653589793) ** 0.5


@jax.custom_vjp
def geglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """gelu_tanh(gate) * up (Gemma's GeGLU; torch's gelu(approximate="tanh")), keeping gate
    and up for the backward as swiglu does."""
    return jax.nn.gelu(gate, approximate=True) * up


def _geglu_fwd(gate, up):
    return geglu(gate, up), (gate, up)


def _geglu_bwd(res, d):
    gate, up = res
    g = gate.astype(jnp.float32)
    t = jnp.tanh(_GELU_C * (g + 0.044715 * g ** 3))
    gelu = 0.5 * g * (1 + t)
    d_gelu = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * _GELU_C * (1 + 3 * 0.044715 * g * g)
    d32 = d.astype(jnp.float32)
    return ((d32 * up.astype(jnp.float32) * d_gelu).astype(gate.dtype),
            (d32 * gelu).astype(up.dtype))


geglu.defvjp(_geglu_fwd, _geglu_bwd)

GATED = {"silu": swiglu, "gelu_tanh": geglu}  # ModelConfig.mlp_activation -> its gated product


# --- RMSNorm ----------------------------------------------------------------------------------

def _rms_forward(x, scale, eps):
    x32 = x.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)  # [..., 1]
    return x32, rstd


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) * scale with fp32 statistics, returned in x's dtype; scale [D]."""
    x32, rstd = _rms_forward(x, scale, eps)
    return (x32 * rstd * scale.astype(jnp.float32)).astype(x.dtype)


def _rms_norm_fwd(x, scale, eps):
    return rms_norm(x, scale, eps), (x, scale)


def _rms_norm_bwd(eps, res, dy):
    x, scale = res
    x32, rstd = _rms_forward(x, scale, eps)
    xhat = x32 * rstd  # [..., D]
    dy32 = dy.astype(jnp.float32)
    d_scale = jnp.sum(dy32 * xhat, axis=tuple(range(x.ndim - 1)))  # [D]
    g = dy32 * scale.astype(jnp.float32)  # d(xhat)
    dx = rstd * (g - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    return dx.astype(x.dtype), d_scale.astype(scale.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


# --- RoPE -------------------------------------------------------------------------------------

def _rotate(x, cos, sin):
    """Rotate [B, T, heads, H] (rotate_half layout) by the [B, T, R/2] tables, in fp32: the
    first R dims of each head (R = H but for partial rotary, Phi-3), the rest passed as they are
    (transformers' apply_rotary_pos_emb: rotate_half within the R dims)."""
    R, H = 2 * cos.shape[-1], x.shape[-1]
    x = x.astype(jnp.float32)
    x1, x2 = jnp.split(x[..., :R] if R < H else x, 2, axis=-1)  # [B, T, heads, R/2] each
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    passed = [x[..., R:]] if R < H else []  # the unrotated dims (partial rotary)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, *passed], axis=-1)


@jax.custom_vjp
def rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding of x [B, T, heads, H] by cos/sin [B, T, R/2] (R <= H: partial rotary
    turns the first R dims), in x's dtype."""
    return _rotate(x, cos, sin).astype(x.dtype)


def _rope_fwd(x, cos, sin):
    return rope(x, cos, sin), (cos, sin, jnp.zeros((0,), x.dtype))


def _rope_bwd(res, d):
    cos, sin, dtype_of_x = res
    # The transpose of a rotation by +angle is the rotation by -angle.
    dx = _rotate(d, cos, -sin).astype(dtype_of_x.dtype)
    return dx, None, None


rope.defvjp(_rope_fwd, _rope_bwd)
