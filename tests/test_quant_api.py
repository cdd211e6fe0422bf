"""jaxmem.quant + jaxmem.lora on a model that is not jaxmem's: a Flax Linen MLP of Dense /
DenseGeneral layers (and an NNX Linear) with NF4 / int8 kernels and LoRA adapters."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmem.lora as jlora
import jaxmem.quant as jq
from numerics import assert_reordered_fp32


class MLP(nn.Module):
    """A user's own model: x [B, 64] -> [B, 16, 2] -> [B, 8]."""

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(128)(x))  # [B, 128]
        h = nn.DenseGeneral((16, 2))(h)  # [B, 16, 2]
        return nn.DenseGeneral(8, axis=(-2, -1))(jnp.tanh(h))  # [B, 8]


@functools.lru_cache(maxsize=1)
def setup():
    """(x [4, 64], the fp32 params, the params with NF4 kernels where 32 divides the rows)."""
    x = jax.random.normal(jax.random.key(0), (4, 64))
    params = jax.jit(MLP().init)(jax.random.key(1), x)["params"]
    q = jq.quantize(params, "nf4", block_size=32, double_quant=True,
                    where=lambda p, w: p.endswith("kernel") and w.shape[0] % 32 == 0)
    return x, params, q


def n_in(path, w):
    """DenseGeneral_1 contracts two axes (axis=(-2, -1)); the others one."""
    return 2 if path.startswith("DenseGeneral_1") else 1


@jax.jit
def apply(params, x):
    with jlora.linen():  # the one line a Linen user adds
        return MLP().apply({"params": params}, x)


def merged(tree):
    """Each LoraWeight / QuantizedWeight as its dense array: the plain Linen model's params."""
    return jax.tree_util.tree_map(
        lambda w: w.merged() if isinstance(w, jlora.LoraWeight) else w, jq.dequantize(tree),
        is_leaf=lambda w: isinstance(w, jlora.LoraWeight))


def test_quantize_selects_kernels_and_names_errors():
    x, params, q = setup()
    kinds = {k: type(v["kernel"]).__name__ for k, v in q.items()}
    # DenseGeneral_1's kernel [16, 2, 8] has 16 input rows: not a multiple of 32, left dense
    assert kinds == {"Dense_0": "QuantizedWeight", "DenseGeneral_0": "QuantizedWeight",
                     "DenseGeneral_1": "ArrayImpl"}
    assert q["Dense_0"]["bias"] is params["Dense_0"]["bias"]
    assert jq.bits_per_param(q["Dense_0"]["kernel"]) == pytest.approx(4 + 8 / 32 + (32 + 32) / (64 * 128))  # + scale, offset
    with pytest.raises(ValueError, match="quantize: kind must be one of 'nf4', 'int8', got 'fp4'"):
        jq.quantize(params, "fp4")
    with pytest.raises(ValueError, match=r"block_size 48 does not divide the input size 64 of "
                                         r"Dense_0/kernel \(shape \(64, 128\), n_in=1\)"):
        jq.quantize({"Dense_0": params["Dense_0"]}, jq.QuantKind.INT8, block_size=48)


@pytest.mark.parametrize("kind, rel", [(jq.QuantKind.NF4, 0.11), ("int8", 0.01)])
def test_dequantize_error_is_the_formats(kind, rel):
    w = jax.random.normal(jax.random.key(2), (256, 64))
    d = jq.dequantize(jq.quantize({"kernel": w}, kind))["kernel"]
    err = float(jnp.sqrt(jnp.mean((d - w) ** 2) / jnp.mean(w ** 2)))
    assert 0 < err < rel


def test_linen_model_with_nf4_lora_equals_the_dequantized_base_at_zero_b():
    x, _, q = setup()
    wrapped = jlora.wrap(q, rank=4, key=jax.random.key(3), alpha=8, n_in=n_in)
    assert isinstance(wrapped["Dense_0"]["kernel"].base, jq.QuantizedWeight)
    with jax.default_matmul_precision("highest"):
        got = apply(wrapped, x)
        want = jax.jit(MLP().apply)({"params": jq.dequantize(q)}, x)  # plain Linen, dense fp32 kernels
    assert_reordered_fp32(got, want)  # another program (tests/numerics.py)


def test_only_the_adapters_train_and_the_result_is_the_merged_model():
    x, _, q = setup()
    y = jax.random.normal(jax.random.key(4), (4, 8))
    wrapped = jlora.wrap(q, rank=4, key=jax.random.key(3), alpha=8, n_in=n_in)
    adapters, frozen = jlora.split(wrapped)
    # the trainable tree: A and B of the three wrapped kernels, nothing else
    shapes = sorted(tuple(a.shape) for a in jax.tree_util.tree_leaves(adapters))
    assert shapes == sorted([(64, 4), (4, 128), (128, 4), (4, 16, 2), (16, 2, 4), (4, 8)])

    def loss(adapters):
        return jnp.mean((apply(jlora.combine(adapters, frozen), x) - y) ** 2)

    opt = optax.adam(1e-2)
    state = opt.init(adapters)

    @jax.jit
    def step(adapters, state):
        updates, state = opt.update(jax.grad(loss)(adapters), state)
        return optax.apply_updates(adapters, updates), state

    with jax.default_matmul_precision("highest"):
        first = float(loss(adapters))
        for _ in range(20):
            adapters, state = step(adapters, state)
        trained = jlora.combine(adapters, frozen)
        last = float(loss(adapters))
        # a LoRA-wrapped NF4 model = the plain Linen model with W_deq + scale * A B kernels
        assert_reordered_fp32(apply(trained, x), MLP().apply({"params": merged(trained)}, x))
    assert last < 0.8 * first, (first, last)
    b = trained["Dense_0"]["kernel"].b
    assert float(jnp.abs(b).max()) > 0  # B moved away from its zero init
    for name in ("Dense_0", "DenseGeneral_0"):  # the 4-bit codes are the ones quantized
        np.testing.assert_array_equal(trained[name]["kernel"].base.codes, q[name]["kernel"].codes)


def test_nnx_linear_with_the_two_hooks():
    from flax import nnx

    layer = nnx.Linear(64, 32, rngs=nnx.Rngs(0), promote_dtype=jlora.promote_dtype,
                       dot_general=jlora.dot_general)
    x = jax.random.normal(jax.random.key(5), (3, 64))
    base = jq.quantize({"kernel": layer.kernel[...]}, "nf4")["kernel"]
    w = jlora.wrap({"kernel": base}, rank=2, key=jax.random.key(6),
                   b_init=jax.nn.initializers.normal(0.1))["kernel"]
    layer.kernel.set_value(w)
    with jax.default_matmul_precision("highest"):
        got = layer(x)
        want = x @ w.merged() + layer.bias[...]
        assert_reordered_fp32(got, want)
        assert_reordered_fp32(jlora.dense(x, w), x @ w.merged())


def test_wrap_refuses_rank_zero():
    with pytest.raises(ValueError, match="wrap: rank must be positive, got 0"):
        jlora.wrap({"kernel": jnp.ones((4, 4))}, rank=0, key=jax.random.key(0))
