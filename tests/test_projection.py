"""The projection layer: init is bitwise what it was, weight objects plug in, shapes are checked."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.families import PRESETS
from jaxmem.families.config import ModelConfig
from jaxmem.einsum import ProjectedWeight
from jaxmem.families.decoder import Decoder
from jaxmem.families.params import init_params
from jaxmem.model.precision import cast_params

TIED = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   max_position_embeddings=64, tie_embeddings=True)


# --- a reference: the parameter declarations of commit adbef04, plain `self.param` calls ----------

def _normal(fan_in):
    return nn.initializers.normal(stddev=fan_in ** -0.5)


class _RefBlock(nn.Module):
    """Declares a block's params as adbef04 did, in the same scopes and order; computes nothing."""

    c: ModelConfig

    @nn.compact
    def __call__(self, x, _):
        c = self.c
        D, N, K, H, F = (c.hidden_size, c.num_heads, c.num_kv_heads, c.resolved_head_dim,
                         c.intermediate_size)
        ones = nn.initializers.ones
        _Scope(self, "input_layernorm").param("scale", ones, (D,), jnp.float32)
        attn = _Scope(self, "self_attn")
        for name, shape, fan_in in [("q_proj", (D, N, H), D), ("k_proj", (D, K, H), D),
                                    ("v_proj", (D, K, H), D), ("o_proj", (N, H, D), N * H)]:
            attn.param(name, _normal(fan_in), shape, jnp.float32)
        _Scope(self, "post_attention_layernorm").param("scale", ones, (D,), jnp.float32)
        mlp = _Scope(self, "mlp")
        for name, shape, fan_in in [("gate_proj", (D, F), D), ("up_proj", (D, F), D),
                                    ("down_proj", (F, D), F)]:
            mlp.param(name, _normal(fan_in), shape, jnp.float32)
        return x, None


class _Scope:
    """A named child scope of `module`, to declare params in (what a child module would get)."""

    def __init__(self, module, name):
        self.scope = module.scope.push(name)

    def param(self, name, init, shape, dtype):
        return self.scope.param(name, init, shape, dtype)


class _RefLlama(nn.Module):
    c: ModelConfig

    @nn.compact
    def __call__(self, tokens):
        c = self.c
        self.param("embed_tokens", _normal(c.hidden_size), (c.vocab_size, c.hidden_size),
                   jnp.float32)
        stack = nn.scan(_RefBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=nn.broadcast, length=c.num_layers)
        x, _ = stack(c, name="layers")(jnp.zeros(()), None)
        _Scope(self, "norm").param("scale", nn.initializers.ones, (c.hidden_size,), jnp.float32)
        if not c.tie_embeddings:
            self.param("lm_head", _normal(c.hidden_size), (c.hidden_size, c.vocab_size),
                       jnp.float32)
        return x


def _flat(tree):
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("cfg", [PRESETS["tiny"], pytest.param(TIED, marks=pytest.mark.slow)],
                         ids=["tiny", "tied"])
def test_init_is_bitwise_the_plain_param_declarations(cfg):
    """Same paths, shapes and values as plain `self.param` declarations in the same scopes."""
    key = jax.random.PRNGKey(0)
    ours = _flat(init_params(cfg, key))
    ref = _flat(jax.jit(lambda k: _RefLlama(cfg).init(k, jnp.zeros((1, 8), jnp.int32)))(key)
                ["params"])
    assert sorted(ours) == sorted(ref)
    for path in ref:
        assert ours[path].dtype == np.float32, path
        np.testing.assert_array_equal(ours[path], ref[path], err_msg=path)


# Recorded from commit adbef04 (init_params(tiny, PRNGKey(0))): sum |w| in float64, first, last.
ADBEF04_TINY = {
    "['embed_tokens']": (2343.623442369665, 0.006730109453201294, 0.16041311621665955),
    "['layers']['mlp']['down_proj']": (8012.680986380352, -0.020540693774819374,
                                       -0.010821833275258541),
    "['layers']['mlp']['gate_proj']": (13839.446527511886, 0.05987260118126869,
                                       0.027770493179559708),
    "['layers']['mlp']['up_proj']": (13896.219714151648, -0.09320275485515594,
                                     0.07032601535320282),
    "['layers']['self_attn']['k_proj']": (2304.3257126386006, -0.04958884418010712,
                                          0.0007202329579740763),
    "['layers']['self_attn']['o_proj']": (4628.635520696105, 0.09609375894069672,
                                          0.02509198896586895),
    "['layers']['self_attn']['q_proj']": (4624.562621897858, 0.0650486946105957,
                                          0.04031645506620407),
    "['layers']['self_attn']['v_proj']": (2297.464195344027, -0.001573680667206645,
                                          0.11190386116504669),
    "['lm_head']": (2333.9985473959377, 0.05318819358944893, -0.12211954593658447),
}


def test_tiny_init_matches_values_recorded_before_the_projection_layer():
    params = _flat(init_params(PRESETS["tiny"], jax.random.PRNGKey(0)))
    norms = [p for p in params if p.endswith("['scale']")]
    assert sorted(set(params) - set(norms)) == sorted(ADBEF04_TINY)
    for path, (abs_sum, first, last) in ADBEF04_TINY.items():
        w = params[path].reshape(-1)
        # rtol 1e-5: one ulp differences in N(0,1) sampling pass, any other RNG stream fails
        np.testing.assert_allclose(np.abs(w.astype(np.float64)).sum(), abs_sum, rtol=1e-5)
        np.testing.assert_allclose([w[0], w[-1]], [first, last], rtol=1e-5, err_msg=path)
    for path in norms:
        np.testing.assert_array_equal(params[path], 1.0)


# --- weight objects -------------------------------------------------------------------------------

@jax.tree_util.register_pytree_node_class
class RecordingWeight:
    """A test double: wraps the dense weight; records each `project` call (at trace time)."""

    calls: list = []

    def __init__(self, w):
        self.w = w

    def tree_flatten(self):
        return (self.w,), None

    @classmethod
    def tree_unflatten(cls, _, leaves):
        return cls(*leaves)

    def project(self, subscripts, x, einsum):
        RecordingWeight.calls.append((subscripts, tuple(self.w.shape)))
        return einsum(subscripts, x, self.w)


@jax.tree_util.register_pytree_node_class
class PackedWeight:
    """Stores W flattened (a leaf of another shape, as packed quantized codes are) plus a scale."""

    def __init__(self, flat, scale, shape):
        self.flat, self.scale, self.shape = flat, scale, shape

    def tree_flatten(self):
        return (self.flat, self.scale), self.shape

    @classmethod
    def tree_unflatten(cls, shape, leaves):
        return cls(*leaves, shape)

    def project(self, subscripts, x, einsum):
        return einsum(subscripts, x, self.flat.reshape(self.shape) * self.scale)


CFG = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_position_embeddings=32)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.PRNGKey(1))


def _with(params, group, name, value):
    layers = {**params["layers"], group: {**params["layers"][group], name: value}}
    return {**params, "layers": layers}


TOKENS = jax.random.randint(jax.random.PRNGKey(2), (2, 8), 0, CFG.vocab_size)


def test_weight_object_plugs_in_without_model_changes(params):
    up = params["layers"]["mlp"]["up_proj"]  # [L, D, F]
    assert isinstance(RecordingWeight(up), ProjectedWeight)
    RecordingWeight.calls.clear()
    wrapped = _with(params, "mlp", "up_proj", RecordingWeight(up))
    got = Decoder(CFG).apply({"params": wrapped}, TOKENS)
    want = Decoder(CFG).apply({"params": params}, TOKENS)
    D, F = CFG.hidden_size, CFG.intermediate_size
    # traced inside the layer scan (Flax's scan traces its body more than once), on one
    # layer's slice of the stacked leaf
    assert RecordingWeight.calls and set(RecordingWeight.calls) == {("BTD,DF->BTF", (D, F))}
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


def test_weight_object_with_packed_leaves_of_other_shapes(params):
    """Leaves need not have the declared shape (Flax's init-shape check is not applied)."""
    q = params["layers"]["self_attn"]["q_proj"]  # [L, D, N, H]
    L = q.shape[0]
    packed = PackedWeight(q.reshape(L, -1) / 2, jnp.full((L,), 2.0), q.shape[1:])
    got = Decoder(CFG).apply({"params": _with(params, "self_attn", "q_proj", packed)}, TOKENS)
    np.testing.assert_allclose(got, Decoder(CFG).apply({"params": params}, TOKENS), rtol=1e-6)


def test_cast_params_keeps_weight_objects_and_integer_leaves(params):
    q = params["layers"]["self_attn"]["q_proj"]
    L = q.shape[0]
    codes = jnp.arange(q.size, dtype=jnp.int8).reshape(L, -1)
    tree = _with(params, "self_attn", "q_proj", PackedWeight(codes, jnp.ones((L,)), q.shape[1:]))
    cast = cast_params(tree, jnp.bfloat16)
    obj = cast["layers"]["self_attn"]["q_proj"]
    assert isinstance(obj, PackedWeight) and obj.shape == q.shape[1:]
    assert obj.flat.dtype == jnp.int8 and obj.scale.dtype == jnp.bfloat16
    np.testing.assert_array_equal(obj.flat, codes)
    assert cast["layers"]["input_layernorm"]["scale"].dtype == jnp.float32
    assert cast["layers"]["mlp"]["up_proj"].dtype == jnp.bfloat16


def test_wrong_shape_names_the_param_and_both_shapes(params):
    bad = _with(params, "mlp", "down_proj", params["layers"]["mlp"]["down_proj"][:, :-1])
    F, D = CFG.intermediate_size, CFG.hidden_size
    with pytest.raises(ValueError, match=rf"layers/mlp/down_proj has shape \({F - 1}, {D}\), "
                                         rf"the model expects \({F}, {D}\)"):
        Decoder(CFG).apply({"params": bad}, TOKENS)
    head = {**params, "lm_head": params["lm_head"].T}
    with pytest.raises(ValueError, match=rf"lm_head has shape \({CFG.vocab_size}, {D}\)"):
        Decoder(CFG).apply({"params": head}, TOKENS)


def test_tied_head_uses_the_embedding_transpose():
    p = init_params(TIED, jax.random.PRNGKey(3))
    x = jax.random.randint(jax.random.PRNGKey(4), (1, 8), 0, TIED.vocab_size)
    logits = Decoder(TIED).apply({"params": p}, x)
    # the same model with an untied head holding E^T gives the same logits
    untied = {**p, "lm_head": p["embed_tokens"].T}
    np.testing.assert_array_equal(logits, Decoder(TIED.replace(tie_embeddings=False))
                                  .apply({"params": untied}, x))
    assert logits.dtype == jnp.float32
