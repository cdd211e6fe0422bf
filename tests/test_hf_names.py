"""The jaxmem <-> Hugging Face tensor-name table (jaxmem.io.hf_names).

Round trip jaxmem -> HF -> jaxmem is bitwise (a transpose and a reshape); the names and shapes
equal those of a real transformers LlamaForCausalLM (skipped without transformers).
"""

import jax
import numpy as np
import pytest

from jaxmem.families.config import ModelConfig
from jaxmem.io.hf_names import (hf_names, hf_state_items, params_from_hf, spec_for, tensor_specs,
                                to_hf)
from jaxmem.families.params import abstract_params, count_params

CFG = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=12, max_position_embeddings=64)


def random_params(c, seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda s: rng.standard_normal(s.shape).astype(np.float32),
                                  abstract_params(c))


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_is_bitwise_and_covers_every_param(tied):
    c = CFG.replace(tie_embeddings=tied)
    params = random_params(c)
    state = dict(hf_state_items(c, params))
    assert list(state) == hf_names(c)
    assert ("lm_head.weight" in state) is (not tied)
    back = params_from_hf(c, state.__getitem__)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, params)
    assert len(tensor_specs(c)) == len(jax.tree_util.tree_leaves(params))


def test_projection_layouts():
    c = CFG
    params = random_params(c)
    q = params["layers"]["self_attn"]["q_proj"][1]  # [D, N, H]
    hf_q = to_hf(spec_for(c, ("layers", "self_attn", "q_proj")), q)
    assert hf_q.shape == (4 * 12, 32)  # [N*H, D]
    np.testing.assert_array_equal(hf_q[5 * 1 + 12 * 2], q[:, 2, 5])  # row n*H + h is head n, dim h
    o = params["layers"]["self_attn"]["o_proj"][0]  # [N, H, D]
    hf_o = to_hf(spec_for(c, ("layers", "self_attn", "o_proj")), o)
    np.testing.assert_array_equal(hf_o[:, 12 * 3 + 7], o[3, 7])  # column n*H + h
    assert spec_for(c, ("layers", "mlp", "down_proj")).hf_shape == (32, 48)
    assert spec_for(c, ("layers", "mlp", "up_proj")).module(2) == "model.layers.2.mlp.up_proj"


def test_wrong_shape_names_the_tensor():
    c = CFG
    state = dict(hf_state_items(c, random_params(c)))
    state["model.layers.1.mlp.gate_proj.weight"] = np.zeros((48, 31), np.float32)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.gate_proj\.weight has shape "
                                         r"\(48, 31\), expected \(48, 32\)"):
        params_from_hf(c, state.__getitem__)


@pytest.mark.torch
@pytest.mark.parametrize("tied", [False, True])
def test_names_and_shapes_equal_transformers(tied):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    c = CFG.replace(tie_embeddings=tied)
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, tie_word_embeddings=tied)
    sd = transformers.LlamaForCausalLM(hf_config).state_dict()
    if tied:
        sd.pop("lm_head.weight", None)  # the tied head is the embedding; files omit it
    assert sorted(sd) == sorted(hf_names(c))
    shapes = {s.name(0) if s.stacked else s.name(): s.hf_shape for s in tensor_specs(c)}
    for name, shape in shapes.items():
        assert tuple(sd[name].shape) == shape, name


@pytest.mark.parametrize("preset", ["llama-3.2-1b", "llama-3-8b"])
def test_full_size_tables_hold_every_parameter(preset):
    """Without allocating: the HF tensors of a full-size preset add up to its parameter count
    (1,235,814,400 for Llama 3.2 1B: 146 tensors, the tied head not among them)."""
    import math

    from jaxmem.families import PRESETS

    c = PRESETS[preset]
    specs = tensor_specs(c)
    total = sum(math.prod(s.hf_shape) * (c.num_layers if s.stacked else 1) for s in specs)
    assert total == count_params(abstract_params(c))  # the table covers the module's params
    if preset == "llama-3.2-1b":
        assert total == 1_235_814_400 and len(hf_names(c)) == 146
