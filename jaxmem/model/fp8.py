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

The GEMM form (what XLA's GPU gemm rewriter turns into one `__cublas$lt$matmul$f8` call: its
`CreateF8CustomCall` takes only a dot whose operands have one free and one contracted axis
besides batch axes, leaving multi-axis einsums to earlier canonicalization passes, and
cuBLASLt's fp8 kernels take only the "TN" layout, the contracted axis minor on both sides):
every fp8 einsum here, forward and both backward products, is brought to

    dot_general(dequant(A [M, K]), dequant(B [N, K]))  -> [M, N]     contracting axis 1 of both

by a transpose and a reshape of the *fp8* tensors (1 byte an element) before they are dequantized,
where dequant(q) = convert(q) * broadcast(scale) is the pattern the rewriter folds into the GEMM.
The dequantized dtype is the GEMM's output dtype (bf16 in the model: the GEMM writes bf16, not
an fp32 result and a second pass to round it), which is exact because the einsum's scales are
powers of two (`quantize(..., power_of_two=True)`): q * 2^k is exact in bf16.

The compiler has to be asked for fp8 GEMMs: jaxmem.model.fp8_compile says how and why.

Not `jax.nn.scaled_matmul`: that is *block* scaling (MXFP8/NVFP4: one e8m0 or e4m3 scale per
block of 32 or 16 along K, lowered to cuDNN on Blackwell). Per-tensor fp8 on Hopper goes through
XLA's gemm rewriter, whose pattern `_gemm` is written in.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
import ml_dtypes
import numpy as np

E4M3 = jnp.float8_e4m3fn  # forward operands: 3 mantissa bits, range to 448
E5M2 = jnp.float8_e5m2  # gradients: 2 mantissa bits, range to 57344 (gradients span more)


def quantize(x: jax.Array, dtype=E4M3, margin: int = 0,
             power_of_two: bool = False) -> tuple[jax.Array, jax.Array]:
    """Per-tensor current scaling: returns `(q, scale)` with `q` in `dtype` and `x ~= q * scale`.

    `scale` is an fp32 scalar (a dequantization scale, see the module docstring). `margin` leaves
    2^margin of headroom below the format's max. Math is in fp32 whatever `x`'s dtype. Values are
    clipped to +-max before the cast, because e4m3fn has no inf: an overflowing cast gives NaN.
    An all-zero tensor gets scale 1. A non-finite `x` gives a non-finite `q * scale`, on purpose:
    the loss scaler's finite check must still see an overflow that happened upstream.
    power_of_two: round the scale up to a power of two (the amax then lands in (max/2, max]
    instead of on max: one octave of the format's bottom end lost, no precision lost for normal
    values). x / scale is then exact, and so is q * scale in bf16 (the einsum's dequantization).
    """
    fp8_max = float(ml_dtypes.finfo(dtype).max)
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32))
    scale = amax * (2.0**margin / fp8_max)
    # Floor at the smallest normal fp32 so a tiny (but nonzero) amax cannot make x / scale inf.
    scale = jnp.maximum(scale, np.finfo(np.float32).tiny)
    if power_of_two:  # the smallest 2^e >= scale; frexp: scale = mant * 2^e, mant in [0.5, 1)
        mant, exp = jnp.frexp(scale)
        scale = jnp.ldexp(jnp.float32(1), jnp.where(mant == 0.5, exp - 1, exp))
    scale = jnp.where(amax == 0, 1.0, scale)
    q = jnp.clip(x32 / scale, -fp8_max, fp8_max).astype(dtype)
    return q, scale.astype(jnp.float32)


def _gemm(a, b, scale_a, scale_b, out_dtype, dequant=None):
    """`(a * scale_a) @ (b * scale_b).T` for fp8 a [(G,) M, K], b [(G,) N, K] -> [(G,) M, N].

    The form XLA's GPU gemm rewriter (`gemm_rewriter.cc`, `MatchFp8Param` / `CreateF8CustomCall`)
    replaces with one `__cublas$lt$matmul$f8` call on Hopper/Ada: each operand is
    convert(fp8) * broadcast(scalar scale), the dot has one contracting axis, minor on both
    operands (cuBLASLt fp8 is "TN" only), and at most one batch axis G. fp8 inputs, fp32
    accumulation, scales applied in the epilogue, the result written in its own dtype.
    dequant: the dtype of the dequantized operands and of the dot's result (default fp32). bf16
    for a bf16 result saves the fp32 result and the pass that rounds it; it is exact only for
    power-of-two scales (an e4m3/e5m2 value times 2^k fits bf16's 8 bits). Elsewhere (CPU,
    older GPUs) the same graph runs as a matmul of the dequantized values, which is numerically
    what the fp8 GEMM computes (up to the summation order).
    """
    dequant = jnp.float32 if dequant is None else dequant
    batch = tuple(range(a.ndim - 2))
    a_wide = a.astype(dequant) * scale_a.astype(dequant)  # [(G,) M, K]
    b_wide = b.astype(dequant) * scale_b.astype(dequant)  # [(G,) N, K]
    contract = ((a.ndim - 1,), (b.ndim - 1,))
    out = lax.dot_general(a_wide, b_wide, (contract, (batch, batch)),
                          preferred_element_type=dequant)  # [(G,) M, N]
    return out.astype(out_dtype)


def scaled_matmul(a, b, scale_a, scale_b, out_dtype=jnp.bfloat16) -> jax.Array:
    """`(a * scale_a) @ (b * scale_b)` in `out_dtype`: `torch._scaled_mm` with per-tensor scales.

    `a`: (M, K), `b`: (K, N), both fp8 (cuBLASLt needs at least one e4m3 operand); `scale_a`,
    `scale_b`: fp32 scalars, dequantization scales as `quantize` returns them. Accumulates in fp32.
    b is transposed to (N, K) in fp8 (K minor, as cuBLASLt's fp8 GEMM needs). The dot's result
    is fp32 (exact for any scale), then rounded to `out_dtype`.
    """
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"scaled_matmul takes 2-D operands, got {a.shape} and {b.shape}")
    return _gemm(a, b.T, scale_a, scale_b, out_dtype)  # (M, N)


# ------------------------------------------------------------------------ trace-time counter

_COUNTERS: list[collections.Counter] = []


@contextlib.contextmanager
def count_traced():
    """Counts `fp8_einsum` calls traced inside the block, by subscripts (experiments.fp8_diag).

        with count_traced() as n:
            jax.jit(step).lower(state, batch)
        sum(n.values())   # fp8 einsums in the traced Python: 7 per traced decoder block

    A count of Python calls: a scanned block's body is traced once (or a few times, by Flax's
    lifting) whatever the number of layers, and remat recomputes without tracing again.
    """
    counts = collections.Counter()
    _COUNTERS.append(counts)
    try:
        yield counts
    finally:
        _COUNTERS.remove(counts)


# --------------------------------------------------------------------------------- fp8_einsum


@dataclasses.dataclass(frozen=True)
class _Spec:
    """The static part of one fp8_einsum call (hashable: a `nondiff_argnums` argument).

    Index groups, each in the order it has in x (or in w for `n`):
    batch: in x, w and out (a dot batch axis); m: x and out only (GEMM rows);
    n: w and out only (GEMM columns); k: x and w only (contracted).
    """

    lhs: str  # index letters of x, e.g. 'BTD'
    rhs: str  # index letters of w, e.g. 'DNH'
    out: str  # index letters of the result, e.g. 'BTNH'
    x_dtype: np.dtype  # gradients come back in the primals' dtypes
    w_dtype: np.dtype
    out_dtype: np.dtype
    batch: str = ""
    m: str = ""
    n: str = ""
    k: str = ""

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
        for i in set(lhs) & set(rhs):
            if x.shape[lhs.index(i)] != w.shape[rhs.index(i)]:
                raise ValueError(f"fp8_einsum {subscripts!r}: index {i!r} has sizes "
                                 f"{x.shape[lhs.index(i)]} and {w.shape[rhs.index(i)]}")
        if out_dtype is None:
            out_dtype = jnp.result_type(x.dtype, w.dtype)
        return cls(lhs, rhs, out, np.dtype(x.dtype), np.dtype(w.dtype), np.dtype(out_dtype),
                   batch="".join(i for i in lhs if i in rhs and i in out),
                   m="".join(i for i in lhs if i in out and i not in rhs),
                   n="".join(i for i in rhs if i in out and i not in lhs),
                   k="".join(i for i in lhs if i in rhs and i not in out))


def _matrix(a, letters: str, batch: str, rows: str, cols: str):
    """a (axes named by `letters`) -> [(G,) R, C]: one transpose (if the order differs) and one
    reshape, applied to the fp8 tensor, so the copy moves 1 byte an element."""
    order = batch + rows + cols
    perm = tuple(letters.index(i) for i in order)
    size = dict(zip(letters, a.shape))
    if perm != tuple(range(a.ndim)):
        a = jnp.transpose(a, perm)
    shape = (math.prod(size[i] for i in batch),) if batch else ()
    return a.reshape(shape + (math.prod(size[i] for i in rows), math.prod(size[i] for i in cols)))


def _unmatrix(y, sizes: dict, batch: str, rows: str, cols: str, target: str):
    """[(G,) R, C] -> the axes of `target` (the inverse of `_matrix`)."""
    order = batch + rows + cols
    y = y.reshape(tuple(sizes[i] for i in order))
    perm = tuple(order.index(i) for i in target)
    return y if perm == tuple(range(y.ndim)) else jnp.transpose(y, perm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_einsum(spec: _Spec, x, w):
    return _fp8_einsum_fwd(spec, x, w)[0]


def _dequant(dtype):
    """The GEMM's dequantized dtype for a result in `dtype`: bf16 results are computed in bf16
    (exact: the scales below are powers of two), anything else in fp32 and then rounded."""
    return jnp.bfloat16 if np.dtype(dtype) == jnp.bfloat16 else jnp.float32


def _forward(spec: _Spec, x, wq, sw):
    """y = x . (wq * sw) with x quantized here; returns (y, the backward's residuals)."""
    s = spec
    xq, sx = quantize(x, E4M3, power_of_two=True)  # e.g. BTD
    a = _matrix(xq, s.lhs, s.batch, s.m, s.k)  # e.g. [B*T, D]
    b = _matrix(wq, s.rhs, s.batch, s.n, s.k)  # e.g. [N*H, D]
    sizes = dict(zip(s.lhs + s.rhs, x.shape + wq.shape))
    y = _gemm(a, b, sx, sw, s.out_dtype, _dequant(s.out_dtype))  # e.g. [B*T, N*H]
    y = _unmatrix(y, sizes, s.batch, s.m, s.n, s.out)  # e.g. BTNH
    # Residuals are the fp8 operands (1 byte per element) and two scalars, not x and w.
    return y, (xq, sx, wq, sw)


def _fp8_einsum_fwd(spec: _Spec, x, w):
    return _forward(spec, x, *quantize(w, E4M3, power_of_two=True))  # w e.g. DNH


def _fp8_einsum_bwd(spec: _Spec, residuals, g):
    s = spec
    xq, sx, wq, sw = residuals
    gq, sg = quantize(g, E5M2, power_of_two=True)  # e.g. BTNH; e5m2: gradients span more octaves
    sizes = dict(zip(s.lhs + s.rhs, xq.shape + wq.shape))
    # dx [M, K] = g [M, N] . w [K, N]: e.g. 'BTNH,DNH->BTD' as [B*T, N*H] x [D, N*H]
    dx = _gemm(_matrix(gq, s.out, s.batch, s.m, s.n), _matrix(wq, s.rhs, s.batch, s.k, s.n),
               sg, sw, s.x_dtype, _dequant(s.x_dtype))
    # dw [N, K] = g [N, M] . x [K, M]: e.g. 'BTNH,BTD->DNH' as [N*H, B*T] x [D, B*T]
    dw = _gemm(_matrix(gq, s.out, s.batch, s.n, s.m), _matrix(xq, s.lhs, s.batch, s.k, s.m),
               sg, sx, s.w_dtype, _dequant(s.w_dtype))
    return (_unmatrix(dx, sizes, s.batch, s.m, s.k, s.lhs),
            _unmatrix(dw, sizes, s.batch, s.n, s.k, s.rhs))


_fp8_einsum.defvjp(_fp8_einsum_fwd, _fp8_einsum_bwd)


# A weight quantized once for many products (the MLP's sequence tiles): same GEMMs, but the
# weight's amax and e4m3 copy come in as arguments instead of being made on every call.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_einsum_quantized(spec: _Spec, x, w, wq, sw):
    return _forward(spec, x, wq, sw)[0]


def _quantized_fwd(spec: _Spec, x, w, wq, sw):
    return _forward(spec, x, wq, sw)


def _quantized_bwd(spec: _Spec, residuals, g):
    dx, dw = _fp8_einsum_bwd(spec, residuals, g)  # dw goes to w; wq and sw are constants
    return dx, dw, jnp.zeros_like(residuals[2]), jnp.zeros_like(residuals[3])


_fp8_einsum_quantized.defvjp(_quantized_fwd, _quantized_bwd)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """A weight with its e4m3 copy and power-of-two scale, made once by `prepare_weight` and
    multiplied by many `fp8_einsum`s (a weight object, jaxmem.model.projection.project).

    w: the weight; its gradient is computed as `fp8_einsum` would and flows to it.
    q, scale: `quantize(stop_gradient(w), E4M3, power_of_two=True)`: not differentiated.
    """

    w: jax.Array
    q: jax.Array
    scale: jax.Array

    def tree_flatten(self):
        return (self.w, self.q, self.scale), None

    @classmethod
    def tree_unflatten(cls, _, leaves):
        return cls(*leaves)

    def project(self, subscripts: str, x: jax.Array, einsum=None) -> jax.Array:
        """`fp8_einsum(subscripts, x, w)` with the stored e4m3 copy of w (`einsum` is unused:
        a prepared weight is multiplied in fp8 by construction)."""
        for counts in _COUNTERS:
            counts[subscripts] += 1
        spec = _Spec.parse(subscripts, x, self.w, None)
        return _fp8_einsum_quantized(spec, x, self.w, self.q, self.scale)


def prepare_weight(w, like=None):
    """`Fp8Weight` for a floating array (quantized once here), anything else unchanged.

    jaxmem.model.tiled calls it once per weight before its loop over sequence tiles, so the
    tiles share one amax and one e4m3 copy per weight instead of quantizing it tile by tile.
    like: an earlier result for the same weight: its e4m3 copy and scale are reused, bound to
    this `w` (the tiled backward differentiates each tile with respect to the weight itself).
    """
    if not isinstance(w, jax.Array) or not jnp.issubdtype(w.dtype, jnp.floating):
        return w
    if isinstance(like, Fp8Weight):
        return Fp8Weight(w, like.q, like.scale)
    q, scale = quantize(jax.lax.stop_gradient(w), E4M3, power_of_two=True)
    return Fp8Weight(w, q, scale)


def fp8_einsum(subscripts: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """Two-operand einsum with fp8 operands in both passes, for training.

    Forward: x and w are quantized to e4m3fn with current per-tensor power-of-two scaling and
    multiplied as one 2-D GEMM (`_gemm`; one cuBLASLt fp8 GEMM on Hopper). Backward: the
    incoming gradient is quantized to e5m2 and both input gradients are 2-D fp8 GEMMs of it with
    the saved e4m3 operands (e5m2 x e4m3, a pair cuBLASLt accepts). Gradients come back in x's
    and w's dtypes; the output is in `out_dtype` (default: the promoted dtype of x and w).

    `subscripts` is any explicit 'x,w->out' einsum in which every index appears in at least two
    of the three terms, e.g. the model's 'BTD,DNH->BTNH', 'BTNH,NHD->BTD', 'BTD,DF->BTF',
    'BTF,FD->BTD' (batch indices, present in all three, become the GEMM's one batch axis).
    """
    for counts in _COUNTERS:
        counts[subscripts] += 1
    return _fp8_einsum(_Spec.parse(subscripts, x, w, out_dtype), x, w)


# The einsum's hook for code that multiplies one weight many times (jaxmem.model.tiled).
fp8_einsum.prepare_weight = prepare_weight
