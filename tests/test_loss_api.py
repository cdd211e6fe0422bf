"""jaxmem.loss.fused_cross_entropy, the public fused LM head + cross-entropy, equals optax's
cross-entropy over full logits in value and gradients (fp32, highest matmul precision)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmem.loss as jl
from numerics import assert_reordered_fp32

B, T, D, V = 2, 11, 8, 24  # T = 11: no chunk below divides it, so the last chunk is padded


def reference(hidden, head_dv, targets, weights):
    logits = jnp.einsum("BTD,DV->BTV", hidden, head_dv)  # [B, T, V]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # [B, T]
    return jnp.sum(loss * weights) / jnp.sum(weights)


def data(seed=0, d=D, v=V):
    k = jax.random.split(jax.random.key(seed), 3)
    hidden = jax.random.normal(k[0], (B, T, d), jnp.float32)
    head = jax.random.normal(k[1], (d, v), jnp.float32) / np.sqrt(d)
    targets = jax.random.randint(k[2], (B, T), 0, v)
    # right padding of 4 positions in row 0, 1 in row 1, and one fractional weight
    weights = (jnp.arange(T)[None, :] < jnp.array([[T - 4], [T - 1]])).astype(jnp.float32)
    weights = weights.at[1, 2].set(0.5)
    return hidden, head, targets, weights


@pytest.mark.parametrize("layout", ["dv", "vd"])
@pytest.mark.parametrize("chunk", [3, None])
def test_value_and_gradients_equal_optax_over_full_logits(layout, chunk):
    hidden, head, targets, weights = data()
    stored = head if layout == "dv" else head.T  # the tied embedding [V, D] is passed as it is
    with jax.default_matmul_precision("highest"):
        want, (gx, gw) = jax.value_and_grad(reference, (0, 1))(hidden, head, targets, weights)
        got, (fx, fw) = jax.value_and_grad(
            lambda h, w: jl.fused_cross_entropy(h, w, targets, weights, chunk,
                                                head_layout=layout), (0, 1))(hidden, stored)
    # chunked/fused vs full logits: another summation order (tests/numerics.py)
    assert_reordered_fp32((got, fx, fw if layout == "dv" else fw.T), (want, gx, gw))
    assert fx.dtype == hidden.dtype and fw.shape == stored.shape


def test_sum_reduction_no_weights_and_enum_arguments():
    hidden, head, targets, _ = data(1)
    ones = jnp.ones((B, T))
    with jax.default_matmul_precision("highest"):
        total, count = jl.fused_cross_entropy(hidden, head, targets, chunk=4,
                                              reduction=jl.Reduction.SUM,
                                              head_layout=jl.HeadLayout.DV)
        want = reference(hidden, head, targets, ones)
    assert float(count) == B * T
    assert_reordered_fp32(total / count, want)


def test_square_head_uses_the_stated_layout_not_the_shape():
    """D == V: both layouts are shape-valid; the result follows head_layout, and the two differ."""
    hidden, head, targets, weights = data(2, d=16, v=16)
    with jax.default_matmul_precision("highest"):
        dv = jl.fused_cross_entropy(hidden, head, targets, weights, head_layout="dv")
        vd = jl.fused_cross_entropy(hidden, head, targets, weights, head_layout="vd")
        assert_reordered_fp32(dv, reference(hidden, head, targets, weights))
        assert_reordered_fp32(vd, reference(hidden, head.T, targets, weights))
    assert abs(float(dv) - float(vd)) > 1e-3


def test_all_padding_gives_zero_loss_and_zero_gradients():
    hidden, head, targets, _ = data(3)
    zero = jnp.zeros((B, T))
    loss, g = jax.value_and_grad(lambda h: jl.fused_cross_entropy(h, head, targets, zero))(hidden)
    assert float(loss) == 0.0
    np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(head_layout="vd"), "head must be [V, D] with D = 8 (head_layout='vd'), got shape (8, 24)"),
    (dict(head_layout="tied"), "head_layout must be one of 'dv', 'vd', got 'tied'"),
    (dict(reduction="avg"), "reduction must be one of 'mean', 'sum', got 'avg'"),
    (dict(chunk=0), "chunk must be positive, got 0"),
])
def test_errors_name_the_argument(kwargs, message):
    hidden, head, targets, _ = data(4)
    with pytest.raises(ValueError) as e:
        jl.fused_cross_entropy(hidden, head, targets, **kwargs)
    assert str(e.value) == "fused_cross_entropy: " + message


def test_a_quantized_head_equals_its_dequantized_array():
    """A weight object as the head ("dv"): an int8 QuantizedWeight (jaxmem.quant) gives the loss
    and d(hidden) of its dequantized [D, V] array."""
    import jaxmem.quant as jq

    hidden, head, targets, weights = data(5)
    q = jq.quantize({"kernel": head}, "int8", block_size=8)["kernel"]
    dense = jq.dequantize(q)
    with jax.default_matmul_precision("highest"):
        f = lambda h, w: jl.fused_cross_entropy(h, w, targets, weights, 4)  # noqa: E731
        got, gx = jax.value_and_grad(f)(hidden, q)
        want, wx = jax.value_and_grad(f)(hidden, dense)
    assert_reordered_fp32((got, gx), (want, wx))  # blockwise dequantize in the chunk loop
