"""Parameter roles, and the code that asks for them (weight decay, keeping norms fp32)."""

import jax
import jax.numpy as jnp
import pytest

from jaxmem.families import PRESETS
from jaxmem.families.config import ModelConfig
from jaxmem.families.params import abstract_params, count_params, num_params
from jaxmem.model.roles import count_by_role, param_role, param_roles
from jaxmem.train.optim import decay_mask
from jaxmem.model.precision import cast_params

CFG = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
                  max_position_embeddings=64)


def test_every_param_of_the_model_has_its_role():
    roles = param_roles(abstract_params(CFG))
    assert roles["embed_tokens"] == "embedding" and roles["lm_head"] == "lm_head"
    assert roles["norm"]["scale"] == "norm"
    layers = roles["layers"]
    assert layers["input_layernorm"]["scale"] == "norm"
    assert layers["post_attention_layernorm"]["scale"] == "norm"
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert layers["self_attn"][name] == name
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert layers["mlp"][name] == name


def test_paths_as_key_tuples_and_keypaths():
    assert param_role(("layers", "mlp", "up_proj")) == "up_proj"
    keypath = (jax.tree_util.DictKey("layers"), jax.tree_util.DictKey("self_attn"),
               jax.tree_util.DictKey("k_proj"))
    assert param_role(keypath) == "k_proj"
    # a weight object's leaves take the role of the weight they stand for, whatever they are named
    assert param_role(keypath[:2] + (jax.tree_util.DictKey("q_proj"),
                                     jax.tree_util.GetAttrKey("scale"))) == "q_proj"
    with pytest.raises(ValueError, match="parameter layers/mlp/bias has no role"):
        param_role(("layers", "mlp", "bias"))
    with pytest.raises(ValueError, match=r"layers/0/kernel has no role"):
        param_role((jax.tree_util.DictKey("layers"), jax.tree_util.SequenceKey(0),
                    jax.tree_util.DictKey("kernel")))


@pytest.mark.parametrize("cfg", [CFG, CFG.replace(tie_embeddings=True), PRESETS["llama-3.2-1b"]],
                         ids=["untied", "tied", "llama-3.2-1b"])
def test_count_by_role(cfg):
    counts = count_by_role(abstract_params(cfg))
    L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    assert counts == {"embedding": V * D, "norm": (2 * L + 1) * D, "q_proj": L * D * N * H,
                      "k_proj": L * D * K * H, "v_proj": L * D * K * H, "o_proj": L * N * H * D,
                      "gate_proj": L * D * F, "up_proj": L * D * F, "down_proj": L * F * D,
                      "lm_head": 0 if cfg.tie_embeddings else D * V, "bias": 0}
    assert sum(counts.values()) == count_params(abstract_params(cfg))


def test_qwen_parameters_have_roles():
    """Qwen3's QK-norm scales are norms, Qwen2's q/k/v biases biases (no decay either)."""
    cfg = CFG.replace(family="qwen2", qkv_bias=True, qk_norm=True)
    counts = count_by_role(abstract_params(cfg))
    L, D, N, K, H = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                     cfg.resolved_head_dim)
    assert counts["bias"] == L * (N + 2 * K) * H and counts["norm"] == (2 * L + 1) * D + 2 * L * H
    params = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), abstract_params(cfg))
    mask = decay_mask(params)["layers"]["self_attn"]
    assert not any(mask[k] for k in ("q_bias", "k_bias", "v_bias"))
    assert not mask["q_norm"]["scale"] and not mask["k_norm"]["scale"]
    assert mask["q_proj"]


def test_decay_mask_and_norm_casting_follow_roles():
    params = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), abstract_params(CFG))
    mask = decay_mask(params)
    assert not mask["embed_tokens"] and not mask["norm"]["scale"]
    assert not mask["layers"]["input_layernorm"]["scale"]  # [L, D]: 2-D but a norm
    assert mask["lm_head"] and all(mask["layers"]["self_attn"].values())
    assert all(mask["layers"]["mlp"].values())
    assert decay_mask(params, decay_embeddings=True)["embed_tokens"]
    cast = cast_params(params, jnp.bfloat16)
    dtypes = jax.tree_util.tree_map(lambda x: x.dtype, cast)
    roles = param_roles(params)
    for role, dtype in zip(jax.tree_util.tree_leaves(roles), jax.tree_util.tree_leaves(dtypes)):
        assert dtype == (jnp.float32 if role == "norm" else jnp.bfloat16), role
    assert all(x.dtype == jnp.bfloat16
               for x in jax.tree_util.tree_leaves(cast_params(params, jnp.bfloat16, False)))
    with pytest.raises(ValueError, match="lora_a has no role"):
        decay_mask({"lora_a": jnp.zeros((2, 2))})


@pytest.mark.parametrize("preset", ["tiny", "llama-3.2-1b", "llama-3-8b"])
def test_planner_counts_norm_params_by_role(preset):
    """The amp compute copy (jaxmem.memory.counted.compute_copy) leaves out the params whose
    role is a norm, and an untied embedding: 2 RMSNorms per block and the final one, D scales
    each, counted on the abstract params (no allocation)."""
    from jaxmem.config.run import RunConfig
    from jaxmem.memory.counted import compute_copy
    from jaxmem.memory.spec import StepSpec
    spec = StepSpec.from_run_config(RunConfig().replace({"model.preset": preset,
                                                         "precision.mode": "amp-bf16"}))
    c = spec.model
    norms = (2 * c.num_layers + 1) * c.hidden_size
    embedding = 0 if c.tie_embeddings else c.vocab_size * c.hidden_size
    assert compute_copy(spec, {}) == (num_params(c) - norms - embedding) * 2