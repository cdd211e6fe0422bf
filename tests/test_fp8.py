"""fp8 quantization, scaled matmul and fp8 einsum: values within bounds derived from the formats.

Error bounds used below. Round-to-nearest into a format with `nmant` mantissa bits has relative
error at most u = 2^-(nmant+1) for normal values (e4m3: 2^-4, e5m2: 2^-3, bf16: 2^-8). For a
product C = A B whose operands carry independent, zero-mean relative errors da, db (the
Gaussian data here), E||dC||_F^2 / E||C||_F^2 = E[da^2] + E[db^2] + E[da^2]E[db^2]
<= u_a^2 + u_b^2 + u_a^2 u_b^2, because the errors of the K terms of each sum add in quadrature,
just as the terms themselves do. So the relative Frobenius error is bounded by
sqrt(u_a^2 + u_b^2 + u_a^2 u_b^2) (+ u_out for rounding the result): 0.089 for e4m3 x e4m3 and
0.14 for e5m2 x e4m3. Values in the subnormal range have larger relative error, but with the
amax at 448 they are below amax / 2^14.8, a negligible share of a Gaussian's Frobenius norm.
The measured errors are about 40% of these bounds (0.038 forward, 0.058 gradients).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxmem.model.fp8 import E4M3, E5M2, fp8_einsum, quantize, scaled_matmul
from numerics import assert_reordered_fp32

SEED = 0


def u(dtype) -> float:
    """Unit roundoff (half an ulp at 1) of a format."""
    return 2.0 ** -(ml_dtypes.finfo(dtype).nmant + 1)


def product_bound(dtype_a, dtype_b, out_dtype=jnp.float32) -> float:
    """Relative Frobenius error bound for a product of operands rounded to these formats."""
    ua, ub = u(dtype_a), u(dtype_b)
    out = 0.0 if out_dtype == jnp.float32 else u(out_dtype)
    return float(np.sqrt(ua**2 + ub**2 + ua**2 * ub**2) + out)


def flat_eqns(jaxpr):
    """Every equation of a jaxpr, nested ones (jit, custom_vjp, ...) included, in order."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    yield from flat_eqns(sub)


def rel_fro(actual, expected) -> float:
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def normal(key, shape, scale=1.0, dtype=jnp.float32):
    return (scale * jax.random.normal(jax.random.key(key), shape)).astype(dtype)


# ----------------------------------------------------------------------------------- quantize


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e4])
def test_quantize_round_trip_within_half_ulp(dtype, magnitude):
    x = normal(SEED, (4096,), magnitude)
    q, scale = quantize(x, dtype)
    assert q.dtype == dtype and scale.dtype == jnp.float32 and scale.shape == ()
    x64 = np.asarray(x, np.float64)
    back = np.asarray(q, np.float64) * float(scale)
    fi = ml_dtypes.finfo(dtype)
    # The amax lands exactly on the format's max (fp32 rounding of x / scale aside).
    np.testing.assert_allclose(np.abs(np.asarray(q, np.float64)).max(), float(fi.max), rtol=0)
    # Normal range: half an ulp relative; subnormal range: half the smallest subnormal, absolute.
    # The 1e-6 covers the fp32 rounding of x / scale and of q * scale.
    bound = np.maximum(u(dtype) * np.abs(x64), 0.5 * float(fi.smallest_subnormal) * float(scale))
    assert np.all(np.abs(back - x64) <= bound * (1 + 1e-6) + 1e-6 * np.abs(x64))
    normal_range = np.abs(x64) / float(scale) >= float(fi.smallest_normal)
    assert normal_range.mean() > 0.99  # the half-ulp bound covers almost every element
    relative = np.abs(back - x64)[normal_range] / np.abs(x64)[normal_range]
    assert relative.max() <= u(dtype) * (1 + 1e-6)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("magnitude", [3e-5, 1.0, 7e3])
def test_quantize_power_of_two_scale_is_exact(dtype, magnitude):
    x = normal(SEED, (4096,), magnitude)
    q, scale = quantize(x, dtype, power_of_two=True)
    mantissa, _ = np.frexp(float(scale))
    assert mantissa == 0.5  # a power of two
    fp8_max = float(ml_dtypes.finfo(dtype).max)
    amax_q = float(np.abs(np.asarray(q, np.float64)).max())
    assert fp8_max / 2 < amax_q <= fp8_max  # the amax lands in the format's top octave
    # x / scale is exact, so q is x rounded once: within half an ulp of x for normal values.
    x64, back = np.asarray(x, np.float64), np.asarray(q, np.float64) * float(scale)
    normal_range = np.abs(x64) / float(scale) >= float(ml_dtypes.finfo(dtype).smallest_normal)
    assert normal_range.mean() > 0.98
    relative = np.abs(back - x64)[normal_range] / np.abs(x64)[normal_range]
    assert relative.max() <= u(dtype)


def test_quantize_huge_values_saturate_without_nan():
    x = jnp.array([3e38, -3e38, 1e37, 1.0, 0.0], jnp.float32)
    q, scale = quantize(x, E4M3)
    qf = np.asarray(q, np.float32)
    assert np.all(np.isfinite(qf)) and np.isfinite(float(scale))
    np.testing.assert_array_equal(qf[:2], [448.0, -448.0])
    back = qf.astype(np.float64) * float(scale)
    np.testing.assert_allclose(back[:3], np.asarray(x[:3], np.float64), rtol=u(E4M3), atol=0)
    # One scale per tensor covers 448 / 2^-9 ~ 2^17.8: 1.0 next to 3e38 flushes to zero.
    np.testing.assert_array_equal(back[3:], [0.0, 0.0])


def test_quantize_clips_instead_of_nan():
    """A too-small scale cannot overflow the cast: e4m3fn has no inf and would give NaN."""
    x = normal(SEED, (256,), 1e3)
    q, _ = quantize(x, E4M3, margin=-3)  # amax maps to 8 * 448: half the values would overflow
    qf = np.asarray(q, np.float32)
    assert not np.isnan(qf).any()
    assert np.abs(qf).max() == 448.0


def test_quantize_margin_leaves_headroom():
    x = normal(SEED, (1024,))
    q, scale = quantize(x, E4M3, margin=2)
    assert float(np.abs(np.asarray(q, np.float32)).max()) == 448.0 / 4
    np.testing.assert_allclose(float(scale), 4 * float(jnp.abs(x).max()) / 448.0, rtol=1e-6)


def test_quantize_zero_tensor():
    q, scale = quantize(jnp.zeros((8, 8), jnp.bfloat16), E4M3)
    assert float(scale) == 1.0
    np.testing.assert_array_equal(np.asarray(q, np.float32), 0.0)


def test_quantize_propagates_non_finite():
    """An overflow upstream must stay visible to the loss scaler's finite check."""
    x = jnp.array([1.0, jnp.inf, 2.0], jnp.float32)
    q, scale = quantize(x, E5M2)
    with np.errstate(invalid="ignore"):
        assert not np.all(np.isfinite(np.asarray(q, np.float32) * float(scale)))


# ------------------------------------------------------------------------------ scaled_matmul


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_scaled_matmul_matches_fp32_reference(out_dtype):
    # Magnitudes far outside e4m3's range ([2^-9, 448]) on purpose: scaling must handle them.
    a = normal(SEED, (64, 128), 1e4)
    b = normal(SEED + 1, (128, 256), 1e-5)
    (aq, sa), (bq, sb) = quantize(a), quantize(b)
    out = scaled_matmul(aq, bq, sa, sb, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (64, 256)
    reference = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    error = rel_fro(out, reference)
    assert error < product_bound(E4M3, E4M3, out_dtype)  # 0.089 (fp32 out), 0.093 (bf16 out)
    assert error > 0.005  # and it is really fp8: bf16 operands would give ~0.003


def test_scaled_matmul_is_torch_scaled_mm_convention():
    """out = (a_q * scale_a) @ (b_q * scale_b): the scales are dequantization scales."""
    aq = normal(SEED, (16, 32), 50.0).astype(E4M3)
    bq = normal(SEED + 1, (32, 8), 50.0).astype(E5M2)
    sa, sb = jnp.float32(0.25), jnp.float32(3.0)
    out = scaled_matmul(aq, bq, sa, sb, out_dtype=jnp.float32)
    expected = (np.asarray(aq, np.float64) * 0.25) @ (np.asarray(bq, np.float64) * 3.0)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-3)


def test_scaled_matmul_graph_is_the_xla_fp8_gemm_pattern():
    """convert(fp8 -> f32) * scale on both operands, dot with f32 accumulation, convert out."""
    aq, bq = jnp.ones((16, 32), E4M3), jnp.ones((32, 8), E4M3)
    jaxpr = jax.make_jaxpr(scaled_matmul)(aq, bq, jnp.float32(1), jnp.float32(1))
    eqns = [e for e in flat_eqns(jaxpr.jaxpr)
            if e.primitive.name in ("convert_element_type", "mul", "dot_general")]
    assert [e.primitive.name for e in eqns] == ["convert_element_type", "mul",
                                                "convert_element_type", "mul",
                                                "dot_general", "convert_element_type"]
    assert [str(e.invars[0].aval.dtype) for e in eqns[:4:2]] == ["float8_e4m3fn"] * 2
    assert eqns[4].params["preferred_element_type"] == jnp.float32
    assert eqns[-1].outvars[0].aval.dtype == jnp.bfloat16


def test_scaled_matmul_rejects_non_2d():
    with pytest.raises(ValueError, match="2-D"):
        scaled_matmul(jnp.ones((2, 3, 4), E4M3), jnp.ones((4, 5), E4M3), 1.0, 1.0)


# -------------------------------------------------------------------------------- fp8_einsum

B, T, D, N, H, F = 2, 16, 64, 4, 16, 128
CASES = {  # the model's projections: subscripts -> (x shape, w shape)
    "BTD,DNH->BTNH": ((B, T, D), (D, N, H)),  # q/k/v projection
    "BTNH,NHD->BTD": ((B, T, N, H), (N, H, D)),  # attention output projection
    "BTD,DF->BTF": ((B, T, D), (D, F)),  # MLP up / gate
    "BTF,FD->BTD": ((B, T, F), (F, D)),  # MLP down
}


def _loss(einsum, subscripts, cotangent):
    """A linear loss <y, r>, so that the gradient arriving at the einsum is exactly r."""
    return lambda x, w: jnp.sum(einsum(subscripts, x, w).astype(jnp.float32) * cotangent)


def _operands(subscripts, x_dtype=jnp.float32, w_dtype=jnp.float32):
    x_shape, w_shape = CASES[subscripts]
    x = normal(SEED, x_shape, 3.0, x_dtype)
    w = normal(SEED + 1, w_shape, 0.02, w_dtype)
    out_shape = jax.eval_shape(lambda x, w: jnp.einsum(subscripts, x, w), x, w).shape
    return x, w, normal(SEED + 2, out_shape, 1e-4)  # gradients are small: e5m2 needs its scale


@pytest.mark.parametrize("subscripts", list(CASES))
@pytest.mark.slow  # 3.0 s cold on 2 cores (default run kept under 5 min)
def test_fp8_einsum_forward_and_grads_match_fp32(subscripts):
    x, w, r = _operands(subscripts)
    y = fp8_einsum(subscripts, x, w)
    assert y.dtype == jnp.float32
    assert rel_fro(y, jnp.einsum(subscripts, x, w)) < product_bound(E4M3, E4M3)  # 0.089

    grads = jax.grad(_loss(fp8_einsum, subscripts, r), argnums=(0, 1))(x, w)
    reference = jax.grad(_loss(jnp.einsum, subscripts, r), argnums=(0, 1))(x, w)
    for got, want in zip(grads, reference):
        assert rel_fro(got, want) < product_bound(E5M2, E4M3)  # 0.14
        assert rel_fro(got, want) > 0.01  # the backward really is fp8, not the fp32 fallback


def test_fp8_einsum_grad_dtypes_follow_operands():
    subscripts = "BTD,DF->BTF"
    x, w, r = _operands(subscripts, x_dtype=jnp.bfloat16, w_dtype=jnp.float32)
    assert fp8_einsum(subscripts, x, w).dtype == jnp.float32  # promoted, by default
    assert fp8_einsum(subscripts, x, w, out_dtype=jnp.bfloat16).dtype == jnp.bfloat16
    dx, dw = jax.grad(_loss(fp8_einsum, subscripts, r), argnums=(0, 1))(x, w)
    assert (dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.float32)


def test_fp8_einsum_under_jit_and_checkpoint():
    subscripts = "BTD,DNH->BTNH"
    x, w, r = _operands(subscripts)
    loss = _loss(fp8_einsum, subscripts, r)
    eager = jax.grad(loss, argnums=(0, 1))(x, w)
    jitted = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1)))(x, w)
    # jitted and eager add in another order (tests/numerics.py); on a GPU with fp8 (H100) XLA
    # also rewrites the jitted dots into cuBLASLt fp8 gemms, which apply the scales after the sum,
    # where eager runs each op alone (an fp32 gemm of the upcast operands).
    assert_reordered_fp32(jitted, eager)
    assert_reordered_fp32(remat, eager)


def test_fp8_einsum_backward_uses_fp8_operands():
    """All three dots (y, dx, dw) take fp8 inputs: 4 e4m3 and 2 e5m2 converts feed them."""
    subscripts = "BTD,DF->BTF"
    x, w, r = _operands(subscripts)
    jaxpr = jax.make_jaxpr(jax.grad(_loss(fp8_einsum, subscripts, r), argnums=(0, 1)))(x, w)
    eqns = list(flat_eqns(jaxpr.jaxpr))
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3
    assert all(d.params["preferred_element_type"] == jnp.float32 for d in dots)
    converts = [e for e in eqns if e.primitive.name == "convert_element_type"]
    upcasts = [str(e.invars[0].aval.dtype) for e in converts]
    upcasts = [dtype for dtype in upcasts if dtype.startswith("float8")]
    assert sorted(upcasts) == ["float8_e4m3fn"] * 4 + ["float8_e5m2"] * 2


@pytest.mark.parametrize("subscripts", list(CASES))
def test_fp8_einsum_products_are_2d_gemms_contracting_the_minor_axis(subscripts):
    """Forward, dx and dw are each one [M, K] x [N, K] dot: no batch axis, K minor on both
    (cuBLASLt's fp8 'TN' form), whatever axes the einsum has."""
    x, w, r = _operands(subscripts)
    jaxpr = jax.make_jaxpr(jax.grad(_loss(fp8_einsum, subscripts, r), argnums=(0, 1)))(x, w)
    dots = [e for e in flat_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 3
    for d in dots:
        assert d.params["dimension_numbers"] == (((1,), (1,)), ((), ()))
        assert [v.aval.ndim for v in d.invars] == [2, 2]


def _reference_fp8_einsum(subscripts):
    """The implementation before the 2-D GEMMs: one multi-axis fp32 einsum per product, on the
    same power-of-two-scaled fp8 operands. The 2-D form must change the layout only."""

    def dq(q, scale):
        return q.astype(jnp.float32) * scale

    lhs, rest = subscripts.split(",")
    rhs, out = rest.split("->")

    @jax.custom_vjp
    def f(x, w):
        return fwd(x, w)[0]

    def fwd(x, w):
        (xq, sx), (wq, sw) = quantize(x, power_of_two=True), quantize(w, power_of_two=True)
        return jnp.einsum(subscripts, dq(xq, sx), dq(wq, sw)), (xq, sx, wq, sw)

    def bwd(res, g):
        xq, sx, wq, sw = res
        gq, sg = quantize(g, E5M2, power_of_two=True)
        return (jnp.einsum(f"{out},{rhs}->{lhs}", dq(gq, sg), dq(wq, sw)),
                jnp.einsum(f"{lhs},{out}->{rhs}", dq(xq, sx), dq(gq, sg)))

    f.defvjp(fwd, bwd)
    return lambda subscripts_, x, w: f(x, w)


@pytest.mark.parametrize("subscripts", [*CASES, "BTD,BDF->BTF"])
def test_fp8_einsum_equals_the_multi_axis_einsum_on_the_same_fp8_operands(subscripts):
    shapes = {**CASES, "BTD,BDF->BTF": ((B, T, D), (B, D, F))}  # a batch index: one batch axis
    x_shape, w_shape = shapes[subscripts]
    x, w = normal(SEED, x_shape, 3.0), normal(SEED + 1, w_shape, 0.02)
    r = normal(SEED + 2, jax.eval_shape(lambda: jnp.einsum(subscripts, x, w)).shape, 1e-4)
    reference = _reference_fp8_einsum(subscripts)
    with jax.default_matmul_precision("highest"):  # fp32 products on a GPU too
        got = jax.value_and_grad(_loss(fp8_einsum, subscripts, r), argnums=(0, 1))(x, w)
        want = jax.value_and_grad(_loss(reference, subscripts, r), argnums=(0, 1))(x, w)
    # Same fp8 values, same scales: only the fp32 summation order differs.
    assert_reordered_fp32(got, want)


def test_fp8_einsum_bf16_gemm_is_computed_and_written_in_bf16():
    """bf16 operands: the dequantized operands and the dot's result are bf16 (no fp32 result and
    rounding pass); exact dequantization, so the result is the fp32 product rounded to bf16."""
    subscripts = "BTD,DF->BTF"
    x, w, _ = _operands(subscripts, jnp.bfloat16, jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda x, w: fp8_einsum(subscripts, x, w))(x, w)
    (dot,) = [e for e in flat_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert [str(v.aval.dtype) for v in dot.invars] == ["bfloat16", "bfloat16"]
    assert dot.outvars[0].aval.dtype == jnp.bfloat16
    y = fp8_einsum(subscripts, x, w)
    with jax.default_matmul_precision("highest"):
        y32 = fp8_einsum(subscripts, x.astype(jnp.float32), w.astype(jnp.float32))
    # Same power-of-two scales for the bf16 and fp32 inputs (their amax is the same value).
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y32), rtol=2**-8,
                               atol=2**-8 * float(jnp.abs(y32).max()))


class _Block(nn.Module):
    """A residual MLP block through fp8_einsum, to run under nn.remat + nn.scan."""

    @nn.compact
    def __call__(self, x, _):
        w_up = self.param("w_up", nn.initializers.normal(0.02), (D, F))
        w_down = self.param("w_down", nn.initializers.normal(0.02), (F, D))
        h = jax.nn.relu(fp8_einsum("BTD,DF->BTF", x, w_up))  # (B, T, F)
        return x + fp8_einsum("BTF,FD->BTD", h, w_down), None  # (B, T, D)


@pytest.mark.slow  # two gradient compiles
def test_fp8_einsum_inside_nn_scan_and_remat():
    layers = 3
    stack = nn.scan(nn.remat(_Block), variable_axes={"params": 0}, split_rngs={"params": True},
                    length=layers)()
    x = normal(SEED, (B, T, D))
    params = stack.init(jax.random.key(SEED + 1), x, None)
    loss = jax.jit(lambda p: jnp.mean(stack.apply(p, x, None)[0] ** 2))

    def unrolled(p):  # the same layers applied one by one, without scan or remat
        h = x
        for i in range(layers):
            layer = jax.tree.map(lambda leaf: leaf[i], p["params"])
            h, _ = _Block().apply({"params": layer}, h, None)
        return jnp.mean(h**2)

    value, grads = jax.value_and_grad(loss)(params)
    value_ref, grads_ref = jax.jit(jax.value_and_grad(unrolled))(params)
    assert all(g.shape[0] == layers for g in jax.tree.leaves(grads))
    # scan + remat and the unrolled layers: two programs whose gemms XLA fuses and orders
    # differently (tests/numerics.py; see test_fp8_einsum_under_jit_and_checkpoint)
    assert_reordered_fp32((value, grads), (value_ref, grads_ref))


@pytest.mark.parametrize("subscripts", ["BTD,DF", "BTD,DF->BTE", "BTD,EF->BTF", "BTDD,DF->BTF"])
def test_fp8_einsum_rejects_unsupported_subscripts(subscripts):
    with pytest.raises(ValueError, match="fp8_einsum"):
        fp8_einsum(subscripts, jnp.ones((B, T, D)), jnp.ones((D, F)))


# ---------------------------------------------------------------------------- tiled MLP in fp8


def _converts_to_e4m3(jaxpr, in_loop=False):
    """(operand shape, inside a scan/while body?) for every convert to e4m3 in a jaxpr."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type" and eqn.params["new_dtype"] == E4M3:
            yield tuple(eqn.invars[0].aval.shape), in_loop
        loop = in_loop or eqn.primitive.name in ("scan", "while")
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _converts_to_e4m3(sub, loop)


def test_tiled_mlp_in_fp8_matches_fp32_and_quantizes_weights_once():
    """The MLP in 4 sequence tiles through fp8_einsum: values and gradients within fp8's error of
    the fp32 MLP, and each weight quantized once per pass, outside the loop over tiles."""
    from jaxmem.model.lean import swiglu
    from jaxmem.model.tiled import tiled_mlp

    x = normal(SEED, (B, T, D))
    wg, wu = normal(SEED + 1, (D, F), D**-0.5), normal(SEED + 2, (D, F), D**-0.5)
    wd = normal(SEED + 3, (F, D), F**-0.5)
    r = normal(SEED + 4, (B, T, D), 1e-3)

    def fp32_mlp(x, wg, wu, wd):
        return jnp.einsum("BTF,FD->BTD", swiglu(jnp.einsum("BTD,DF->BTF", x, wg),
                                                jnp.einsum("BTD,DF->BTF", x, wu)), wd)

    def loss(mlp):
        return lambda *a: jnp.sum(mlp(*a) * r)

    tiled = lambda x, wg, wu, wd: tiled_mlp(x, wg, wu, wd, fp8_einsum, T // 4)  # noqa: E731
    with jax.default_matmul_precision("highest"):
        got = jax.jit(jax.value_and_grad(loss(tiled), argnums=(0, 1, 2, 3)))(x, wg, wu, wd)
        want = jax.jit(jax.value_and_grad(loss(fp32_mlp), argnums=(0, 1, 2, 3)))(x, wg, wu, wd)
    assert rel_fro(got[0], want[0]) < 2 * product_bound(E4M3, E4M3)
    with jax.default_matmul_precision("highest"):
        y, y32 = tiled(x, wg, wu, wd), fp32_mlp(x, wg, wu, wd)
    assert 0.005 < rel_fro(y, y32) < 2 * product_bound(E4M3, E4M3)
    for g, w in zip(got[1], want[1]):
        # Two fp8 products in a row (gate/up, then down) in each pass: twice one product's bound.
        assert 0.01 < rel_fro(g, w) < 2 * product_bound(E5M2, E4M3)

    jaxpr = jax.make_jaxpr(jax.grad(loss(tiled), argnums=(0, 1, 2, 3)))(x, wg, wu, wd)
    weights = [(s, loop) for s, loop in _converts_to_e4m3(jaxpr.jaxpr) if s in ((D, F), (F, D))]
    # 3 weights, quantized once in the forward and once in the backward, never inside the loop.
    assert sorted(weights) == [((D, F), False)] * 4 + [((F, D), False)] * 2
    activations = [s for s, loop in _converts_to_e4m3(jaxpr.jaxpr) if loop]
    assert activations and all(s[1] == T // 4 for s in activations)  # per tile: [B, T/4, *]


def test_fp8_model_tiles_its_mlp_under_full_remat(monkeypatch):
    """fp8 no longer turns the MLP tiling off: with the tile limit lowered, the tiny model's MLP
    runs in sequence tiles (e4m3 converts of [B, chunk, F] inside a loop) under `full` remat."""
    from jaxmem.families import get_preset
    from jaxmem.model import tiled
    from jaxmem.families.decoder import Decoder
    from jaxmem.model.remat import RematPolicy

    cfg = get_preset("tiny")
    monkeypatch.setattr(tiled, "TILE_BYTES", 2 * 8 * cfg.intermediate_size * 4)
    monkeypatch.setattr(tiled, "TILE_MIN_TOKENS_PER_WIDTH", 0)  # tiny: tiled anyway
    assert tiled.mlp_tile(2, 32, cfg.intermediate_size) == 8  # 4 tiles of 8
    tokens = jnp.zeros((2, 32), jnp.int32)
    model = Decoder(cfg, RematPolicy.parse("full"), fp8_einsum)
    params = jax.eval_shape(lambda: Decoder(cfg).init(jax.random.key(0), tokens)["params"])
    loss = lambda p: jnp.mean(model.apply({"params": p}, tokens))  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params)
    tiles = {s for s, loop in _converts_to_e4m3(jaxpr.jaxpr) if loop and s[:2] == (2, 8)}
    assert (2, 8, cfg.intermediate_size) in tiles
