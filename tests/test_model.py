"""Model properties: param counts, causality, padding, RoPE, GQA, the sharding hook, config."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.errors import ConfigError
from jaxmem.families import PRESETS, get_preset
from jaxmem.families.config import ModelConfig
from jaxmem.model.layers import apply_rope, rope_tables
from jaxmem.families.decoder import Decoder
from jaxmem.families.params import abstract_params, count_params, init_params
from jaxmem.sharding import activation_sharding, constrain
from numerics import assert_reordered_fp32

PUBLISHED = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3-8b": 8_030_261_248,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "llama-2-7b": 6_738_415_616,
}

CFG = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_position_embeddings=64)


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.PRNGKey(0))


def tokens(seed, shape=(2, 16)):
    return jax.random.randint(jax.random.PRNGKey(seed), shape, 0, CFG.vocab_size)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_param_counts_without_allocation(name):
    abstract = abstract_params(PRESETS[name])
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(abstract))
    assert count_params(abstract) == PUBLISHED[name]


def test_small_preset_is_about_25m():
    assert 24e6 < count_params(abstract_params(PRESETS["small"])) < 27e6


def test_logits_shape_and_dtype(params):
    logits = Decoder(CFG).apply({"params": params}, tokens(1))
    assert logits.shape == (2, 16, CFG.vocab_size) and logits.dtype == jnp.float32
    bf16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    assert Decoder(CFG).apply({"params": bf16}, tokens(1)).dtype == jnp.float32


def test_causality(params):
    """Changing token t never changes logits at positions < t."""
    x = tokens(2)
    base = Decoder(CFG).apply({"params": params}, x)
    for t in (5, 11, 15):
        changed = x.at[:, t].set((x[:, t] + 7) % CFG.vocab_size)
        out = Decoder(CFG).apply({"params": params}, changed)
        np.testing.assert_array_equal(np.asarray(out[:, :t]), np.asarray(base[:, :t]))
        assert not np.allclose(out[:, t:], base[:, t:])


def test_padding_does_not_affect_real_tokens(params):
    """Right padding: any content in padded slots leaves real positions' logits unchanged."""
    x = tokens(3)
    mask = jnp.broadcast_to(jnp.arange(16) < 10, (2, 16))
    a = Decoder(CFG).apply({"params": params}, x, padding_mask=mask)
    garbage = jnp.where(mask, x, (x * 13 + 5) % CFG.vocab_size)
    b = Decoder(CFG).apply({"params": params}, garbage, padding_mask=mask)
    np.testing.assert_allclose(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    # Without the mask, causal-only logits of the real prefix are the same as well.
    c = Decoder(CFG).apply({"params": params}, x)
    assert_reordered_fp32(a[:, :10], c[:, :10])  # another program: tests/numerics.py
    assert np.isfinite(np.asarray(b)).all()


def test_left_padding_masks_keys(params):
    """Left padding: real tokens never attend to padded keys, whatever those hold."""
    x = tokens(4)
    mask = jnp.broadcast_to(jnp.arange(16) >= 4, (2, 16))
    pos = jnp.broadcast_to(jnp.maximum(jnp.arange(16) - 4, 0), (2, 16))
    a = Decoder(CFG).apply({"params": params}, x, padding_mask=mask, positions=pos)
    b = Decoder(CFG).apply({"params": params}, x.at[:, :4].set(1), padding_mask=mask, positions=pos)
    np.testing.assert_allclose(a[:, 4:], b[:, 4:], rtol=0, atol=1e-6)
    # and equals the unpadded sequence run on its own
    c = Decoder(CFG).apply({"params": params}, x[:, 4:])
    assert_reordered_fp32(a[:, 4:], c)  # another program (a shorter one): tests/numerics.py
    assert np.isfinite(np.asarray(a)).all()


def test_rope_relative_position():
    """<rope(q, m), rope(k, n)> depends only on m - n."""
    H = 32
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 1, 1, H))
    k = jax.random.normal(jax.random.PRNGKey(1), (1, 1, 1, H))

    def score(m, n):
        cq, sq = rope_tables(jnp.array([[m]]), H, 10000.0)
        ck, sk = rope_tables(jnp.array([[n]]), H, 10000.0)
        return float(jnp.sum(apply_rope(q, cq, sq) * apply_rope(k, ck, sk)))

    ref = score(7, 3)
    for m, n in [(4, 0), (10, 6), (104, 100)]:
        np.testing.assert_allclose(score(m, n), ref, rtol=1e-4)
    assert abs(score(7, 0) - ref) > 1e-3
    # position 0 is the identity
    c, s = rope_tables(jnp.zeros((1, 1), jnp.int32), H, 10000.0)
    np.testing.assert_array_equal(apply_rope(q, c, s), q)


def test_gqa_equals_mha_with_repeated_kv_heads(params):
    """A GQA model equals an MHA model whose k/v heads are the GQA heads repeated."""
    mha_cfg = CFG.replace(num_kv_heads=CFG.num_heads)
    rep = CFG.num_heads // CFG.num_kv_heads
    mha = jax.tree_util.tree_map(lambda x: x, params)
    attn = dict(mha["layers"]["self_attn"])
    for name in ("k_proj", "v_proj"):  # [L, D, K, H] -> [L, D, N, H], head k -> heads k*rep..
        attn[name] = jnp.repeat(attn[name], rep, axis=2)
    mha["layers"] = {**mha["layers"], "self_attn": attn}
    x = tokens(5)
    assert_reordered_fp32(Decoder(mha_cfg).apply({"params": mha}, x),
                          Decoder(CFG).apply({"params": params}, x))


def test_tied_embeddings_have_no_lm_head():
    p = abstract_params(CFG.replace(tie_embeddings=True))
    assert "lm_head" not in p
    assert "lm_head" in abstract_params(CFG)


def test_sharding_hook_is_a_no_op_without_rules(params):
    x = jnp.ones((2, 3))
    assert constrain(x, "block") is x
    with pytest.raises(ValueError, match="unknown activation kind 'blocks'"):
        constrain(x, "blocks")
    # PartitionSpec rules without a mesh in context change nothing either
    with activation_sharding({"embed": jax.sharding.PartitionSpec("data")}):
        assert constrain(x, "embed") is x and constrain(x, "logits") is x
    logits = Decoder(CFG).apply({"params": params}, tokens(6))
    replicated = {k: jax.sharding.PartitionSpec() for k in ("embed", "block", "logits")}
    with activation_sharding(replicated):
        unsharded = Decoder(CFG).apply({"params": params}, tokens(6))
    np.testing.assert_array_equal(unsharded, logits)
    with pytest.raises(ValueError, match="unknown kind"):
        with activation_sharding({"hidden": None}):
            pass


def test_sharding_hook_sees_embed_block_and_logits(params):
    """A recording rule is called at the three points with [B, T, D], [B, T, D], [B, T, V]."""
    seen = []

    def rule(x, kind):
        seen.append((kind, x.shape))
        return x

    base = Decoder(CFG).apply({"params": params}, tokens(7))
    with activation_sharding(rule):
        logits = Decoder(CFG).apply({"params": params}, tokens(7))
    B, T, D, V = 2, 16, CFG.hidden_size, CFG.vocab_size
    assert set(seen) == {("embed", (B, T, D)), ("block", (B, T, D)), ("logits", (B, T, V))}
    assert [k for k, _ in seen].count("embed") == 1 and [k for k, _ in seen].count("logits") == 1
    np.testing.assert_array_equal(logits, base)
    seen.clear()
    Decoder(CFG).apply({"params": params}, tokens(7))  # uninstalled on exit
    assert seen == []


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_sharding_hook_applies_partition_specs_under_a_mesh(params, axis_type):
    """With a (one-device) mesh in context, PartitionSpec rules become sharding constraints."""
    if not hasattr(jax, "set_mesh"):
        pytest.skip("this jax has no jax.set_mesh")
    mesh = jax.make_mesh((1,), ("data",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
    rules = {kind: jax.sharding.PartitionSpec("data") for kind in ("embed", "block", "logits")}
    x = tokens(8)
    fn = jax.jit(lambda p, t: Decoder(CFG).apply({"params": p}, t))
    with jax.set_mesh(mesh), activation_sharding(rules):
        text = fn.lower(params, x).as_text()
        logits = fn(params, x)
    assert text.count("sharding_constraint") + text.count("mhlo.sharding") >= 3
    plain = jax.jit(lambda p, t: Decoder(CFG).apply({"params": p}, t))(params, x)
    assert_reordered_fp32(logits, plain)  # sharded (a 1-device mesh) vs plain: tests/numerics.py


@pytest.mark.parametrize("overrides, field", [
    (dict(hidden_size=0), "hidden_size"),
    (dict(num_layers=-1), "num_layers"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(hidden_size=100, num_heads=3), "num_heads"),
    (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
    (dict(head_dim=0), "head_dim"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(norm_placement="middle"), "norm_placement"),
    (dict(qk_norm_scope="heads"), "qk_norm_scope"),
])
def test_invalid_config_names_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**{**dict(hidden_size=64, num_heads=4, num_kv_heads=2), **overrides})


def test_qk_norm_over_the_projection_has_its_width_and_normalizes_across_heads():
    """qk_norm_scope "projection": q_norm / k_norm scales [N*H] / [K*H] (the tensor table's
    too), and the norm couples the heads: scaling one head's q_proj columns changes the other
    heads' normed queries, which a per-head norm leaves as they were."""
    from jaxmem.families.decoder import _qk_norm
    from jaxmem.families.names import decoder_tensors
    import flax.linen as nn

    c = CFG.replace(qk_norm=True, qk_norm_scope="projection")
    N, K, H = c.num_heads, c.num_kv_heads, c.resolved_head_dim
    shapes = {s.hf_name: s.shape for s in decoder_tensors(c)}
    assert shapes["model.layers.{i}.self_attn.q_norm.weight"] == (N * H,)
    assert shapes["model.layers.{i}.self_attn.k_norm.weight"] == (K * H,)
    assert abstract_params(c)["layers"]["self_attn"]["q_norm"]["scale"].shape == (2, N * H)

    class Norm(nn.Module):
        config: ModelConfig

        @nn.compact
        def __call__(self, y):
            return _qk_norm(self.config, "q_norm", y)

    y = jax.random.normal(jax.random.PRNGKey(0), (1, 3, N, H))
    louder = y.at[:, :, 0].multiply(10.0)  # head 0 ten times larger
    for scope, coupled in (("projection", True), ("head", False)):
        norm = Norm(c.replace(qk_norm_scope=scope))
        params = norm.init(jax.random.PRNGKey(1), y)
        a, b = (np.asarray(norm.apply(params, t))[:, :, 1:] for t in (y, louder))
        assert (np.abs(a - b).max() > 0.1) == coupled, scope


def test_unknown_preset_and_field():
    with pytest.raises(ConfigError, match="unknown preset 'nope'.*tiny"):
        get_preset("nope")
    with pytest.raises(ConfigError, match="hiden_size"):
        get_preset("tiny", hiden_size=3)
