"""Scaled fp8 matmuls: the JAX counterpart of `torch._scaled_mm`, and an fp8 einsum to train with.

fp8 e4m3fn spans only [2^-9, 448] and e5m2 [2^-16, 57344] (`python -m jaxmem.dtypes`), so a
tensor is never cast to fp8 as it is: it is first multiplied by a per-tensor factor that puts its
absolute max at the top of the format, and the matmul multiplies the factor back out.

Scale convention (one convention, everywhere in this file): `scale` is the DEQUANTIZATION scale,
as `torch._scaled_mm`'s `scale_a` / `scale_b` are:

    q = fp8(clip(x / scale))      x ~= q * scale      scale = amax(|x|) * 2^margin / fp8_max

so `scaled_matmul(a_q, b_q, scale_a, scale_b) = (a_q * scale_a) @ (b_q * scale_b)`, the pair that
`quantize` returns goes straight into `scaled_matmul`, and torch code ports without inverting.

Scaling is *current* (just in time, stateless): each call takes the amax of the tensor it is
about to quantize. The alternative, *delayed* scaling (Transformer Engine, flax's `Fp8DotGeneral`)
uses an amax history from earlier steps, which is state: it would live in the train state, be
checkpointed, be threaded through `nn.scan` and remat, and be stale right after a loss spike.
Current scaling costs one extra reduction over each operand and keeps every function here pure,
so it works unchanged under `jit`, `grad`, `jax.checkpoint` and `nn.scan`.

Not `jax.nn.scaled_matmul`: that is *block* scaling (MXFP8/NVFP4: one e8m0 or e4m3 scale per
block of 32 or 16 along K, lowered to cuDNN on Blackwell). Per-tensor fp8 on Hopper goes through
XLA's gemm rewriter, whose pattern `_scaled_einsum` is written in.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

E4M3 = jnp.float8_e4m3fn  # forward operands: 3 mantissa bits, range to 448
E5M2 = jnp.float8_e5m2  # gradients: 2 mantissa bits, range to 57344 (gradients span more)


def quantize(x: jax.Array, dtype=E4M3, margin: int = 0) -> tuple[jax.Array, jax.Array]:
    """Per-tensor current scaling: returns `(q, scale)` with `q` in `dtype` and `x ~= q * scale`.

    `scale` is an fp32 scalar (a dequantization scale, see the module docstring). `margin` leaves
    2^margin of headroom below the format's max. Math is in fp32 whatever `x`'s dtype. Values are
    clipped to +-max before the cast, because e4m3fn has no inf: an overflowing cast gives NaN.
    An all-zero tensor gets scale 1. A non-finite `x` gives a non-finite `q * scale`, on purpose:
    the loss scaler's finite check must still see an overflow that happened upstream.
    """
    fp8_max = float(ml_dtypes.finfo(dtype).max)
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32))
    scale = amax * (2.0**margin / fp8_max)
    # Floor at the smallest normal fp32 so a tiny (but nonzero) amax cannot make x / scale inf.
    scale = jnp.where(amax == 0, 1.0, jnp.maximum(scale, np.finfo(np.float32).tiny))
    q = jnp.clip(x32 / scale, -fp8_max, fp8_max).astype(dtype)
    return q, scale.astype(jnp.float32)


def _scaled_einsum(subscripts, a, b, scale_a, scale_b, out_dtype):
    """`einsum((a * scale_a), (b * scale_b))` for fp8 `a`, `b`, in the form XLA makes an fp8 GEMM.

    XLA's GPU gemm rewriter (`gemm_rewriter.cc`, tests `ScaledABUnscaledDF8`) matches
    convert(fp8 -> f32) * broadcast(scalar scale) on each operand feeding a dot with f32 result,
    optionally followed by a convert of the output, and replaces the lot with one
    `__cublas$lt$matmul$f8` call on Hopper/Ada: fp8 inputs, fp32 accumulation, scales applied in
    the epilogue. Elsewhere (CPU, older GPUs) the same graph runs as an f32 matmul of the
    dequantized values, which is numerically what the fp8 GEMM computes.
    """
    a_wide = a.astype(jnp.float32) * scale_a.astype(jnp.float32)
    b_wide = b.astype(jnp.float32) * scale_b.astype(jnp.float32)
    out = jnp.einsum(subscripts, a_wide, b_wide, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def scaled_matmul(a, b, scale_a, scale_b, out_dtype=jnp.bfloat16) -> jax.Array:
    """`(a * scale_a) @ (b * scale_b)` in `out_dtype`: `torch._scaled_mm` with per-tensor scales.

    `a`: (M, K), `b`: (K, N), both fp8 (cuBLASLt needs at least one e4m3 operand); `scale_a`,
    `scale_b`: fp32 scalars, dequantization scales as `quantize` returns them. Accumulates in fp32.
    """
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"scaled_matmul takes 2-D operands, got {a.shape} and {b.shape}")
    return _scaled_einsum("MK,KN->MN", a, b, scale_a, scale_b, out_dtype)  # (M, N)


@dataclasses.dataclass(frozen=True)
class _Spec:
    """The static part of one fp8_einsum call (hashable: a `nondiff_argnums` argument)."""

    lhs: str  # index letters of x, e.g. 'BTD'
    rhs: str  # index letters of w, e.g. 'DNH'
    out: str  # index letters of the result, e.g. 'BTNH'
    x_dtype: np.dtype  # gradients come back in the primals' dtypes
    w_dtype: np.dtype
    out_dtype: np.dtype

    @classmethod
    def parse(cls, subscripts: str, x, w, out_dtype) -> _Spec:
        """Check that `subscripts` is a two-operand einsum whose transposes are einsums too."""
        spec = subscripts.replace(" ", "")
        if spec.count("->") != 1 or spec.split("->")[0].count(",") != 1:
            raise ValueError(f"fp8_einsum needs explicit 'x,w->out' subscripts, got {subscripts!r}")
        operands, out = spec.split("->")
        lhs, rhs = operands.split(",")
        terms = (lhs, rhs, out)
        if not all(t.isalpha() and len(set(t)) == len(t) for t in terms):
            raise ValueError(f"fp8_einsum: letters only, none repeated in a term: {subscripts!r}")
        # Every index must appear in at least two terms (contracted, free or batch); an index in
        # one term only would be a sum over one operand, whose gradient is a broadcast, not a dot.
        for index in set(lhs + rhs + out):
            if sum(index in t for t in terms) < 2:
                raise ValueError(f"fp8_einsum: index {index!r} in one term only: {subscripts!r}")
        if (x.ndim, w.ndim) != (len(lhs), len(rhs)):
            raise ValueError(f"fp8_einsum {subscripts!r}: got operands {x.shape} and {w.shape}")
        if out_dtype is None:
            out_dtype = jnp.result_type(x.dtype, w.dtype)
        return cls(lhs, rhs, out, np.dtype(x.dtype), np.dtype(w.dtype), np.dtype(out_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_einsum(spec: _Spec, x, w):
    return _fp8_einsum_fwd(spec, x, w)[0]


def _fp8_einsum_fwd(spec: _Spec, x, w):
    xq, sx = quantize(x, E4M3)  # e.g. BTD
    wq, sw = quantize(w, E4M3)  # e.g. DNH
    y = _scaled_einsum(f"{spec.lhs},{spec.rhs}->{spec.out}", xq, wq, sx, sw, spec.out_dtype)
    # Residuals are the fp8 operands (1 byte per element) and two scalars, not x and w.
    return y, (xq, sx, wq, sw)


def _fp8_einsum_bwd(spec: _Spec, residuals, g):
    xq, sx, wq, sw = residuals
    gq, sg = quantize(g, E5M2)  # e.g. BTNH; e5m2 for range: gradients span many octaves
    # dx = g . w over the indices x does not keep: 'BTNH,DNH->BTD'
    dx = _scaled_einsum(f"{spec.out},{spec.rhs}->{spec.lhs}", gq, wq, sg, sw, spec.x_dtype)
    # dw = x . g over the indices w does not keep: 'BTD,BTNH->DNH'
    dw = _scaled_einsum(f"{spec.lhs},{spec.out}->{spec.rhs}", xq, gq, sx, sg, spec.w_dtype)
    return dx, dw


_fp8_einsum.defvjp(_fp8_einsum_fwd, _fp8_einsum_bwd)


def fp8_einsum(subscripts: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """Two-operand einsum with fp8 operands in both passes, for training.

    Forward: x and w are quantized to e4m3fn with current per-tensor scaling and contracted
    through `_scaled_einsum` (one fp8 GEMM on Hopper). Backward: the incoming gradient is
    quantized to e5m2 and both input gradients are fp8 GEMMs of it with the saved e4m3 operands
    (e5m2 x e4m3, a pair cuBLASLt accepts). Gradients come back in x's and w's dtypes; the output
    is in `out_dtype` (default: the promoted dtype of x and w).

    `subscripts` is any explicit 'x,w->out' einsum in which every index appears in at least two
    of the three terms, e.g. the model's 'BTD,DNH->BTNH', 'BTNH,NHD->BTD', 'BTD,DF->BTF',
    'BTF,FD->BTD' (batch indices, present in all three, are allowed too).
    """
    return _fp8_einsum(_Spec.parse(subscripts, x, w, out_dtype), x, w)
