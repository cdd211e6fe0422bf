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


@pytest.mark.parametrize("preset", ["llama-3.2-1b", "llama-3-8b", "phi-4-mini"])
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
    if preset == "phi-4-mini":  # fused qkv_proj / gate_up_proj: 6 tensors a layer
        assert total == 3_836_021_760 and len(hf_names(c)) == 32 * 6 + 2


# ----------------------------------------------------------------------------- fused tensors

QKV = [("layers", "self_attn", p) for p in ("q_proj", "k_proj", "v_proj")]
GATE_UP = [("layers", "mlp", p) for p in ("gate_proj", "up_proj")]


@pytest.fixture
def fused(monkeypatch):
    """CFG as a family whose table stores q, k, v in one `qkv_proj` (rows q, k, v) and gate, up
    in one `gate_up_proj` (Phi-3's layout), registered for this test only."""
    from jaxmem.families import base
    from jaxmem.families.names import decoder_tensors, fuse

    def table(c):
        specs = fuse(decoder_tensors(c), QKV, "model.layers.{i}.self_attn.qkv_proj.weight")
        return fuse(specs, GATE_UP, "model.layers.{i}.mlp.gate_up_proj.weight")
    fam = base.Family("fusedtest", "FusedForCausalLM", fields=lambda d: {},
                      hf_keys=lambda c: {}, tensors=table)
    monkeypatch.setitem(base.FAMILIES, "fusedtest", fam)
    return CFG.replace(family="fusedtest")


def test_fused_table_reads_and_writes_each_tensor_once(fused):
    c, plain = fused, CFG
    params = random_params(c)
    state = dict(hf_state_items(c, params))
    assert list(state) == hf_names(c)
    layer = [n.removeprefix("model.layers.1.") for n in hf_names(c) if ".layers.1." in n]
    assert layer == ["input_layernorm.weight", "post_attention_layernorm.weight",
                     "self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                     "mlp.gate_up_proj.weight", "mlp.down_proj.weight"]
    # rows: q (N*H = 48), k (K*H = 24), v (24); gate (F = 48) then up (48)
    qkv, gate_up = state["model.layers.1.self_attn.qkv_proj.weight"], \
        state["model.layers.1.mlp.gate_up_proj.weight"]
    assert qkv.shape == (96, 32) and gate_up.shape == (96, 32)
    plain_state = dict(hf_state_items(plain, params))
    for name, rows in (("q_proj", slice(0, 48)), ("k_proj", slice(48, 72)),
                       ("v_proj", slice(72, 96))):
        np.testing.assert_array_equal(qkv[rows],
                                      plain_state[f"model.layers.1.self_attn.{name}.weight"])
    np.testing.assert_array_equal(gate_up[48:], plain_state["model.layers.1.mlp.up_proj.weight"])
    reads = []
    back = params_from_hf(c, lambda n: reads.append(n) or state[n])
    assert sorted(reads) == sorted(state)  # each fused tensor read once, not once per part
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, params)
    k = spec_for(c, QKV[1])
    assert (k.hf_shape, k.tensor_shape, k.module(0)) == (
        (24, 32), (96, 32), "model.layers.0.self_attn.qkv_proj")
    assert k.tensor_index((slice(2, 5), slice(0, 32))) == (slice(50, 53, 1), slice(0, 32))


def test_fused_tensor_of_the_wrong_shape_is_named(fused):
    state = dict(hf_state_items(fused, random_params(fused)))
    state["model.layers.2.self_attn.qkv_proj.weight"] = np.zeros((90, 32), np.float32)
    with pytest.raises(ValueError, match=r"tensor model\.layers\.2\.self_attn\.qkv_proj\.weight "
                                         r"has shape \(90, 32\), expected \(96, 32\)"):
        params_from_hf(fused, state.__getitem__)


def test_fused_checkpoint_files_whole_and_sliced(fused, tmp_path):
    """save_hf writes the fused tensors (shapes and index), load_hf_params reads them back, the
    shard-by-shard reader (HFSlices) cuts a part's rectangle out of the fused tensor, and a
    missing fused tensor is named."""
    import json

    from jaxmem.io.hf import HFError, load_hf_params
    from jaxmem.io.hf_export import save_hf
    from jaxmem.peft.slices import HFSlices

    params = random_params(fused)
    save_hf(tmp_path / "hf", fused, params, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert "model.layers.0.self_attn.qkv_proj.weight" in index["weight_map"]
    assert not any("q_proj" in n or "gate_proj" in n for n in index["weight_map"])
    back = load_hf_params(tmp_path / "hf", fused)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, params)
    v = spec_for(fused, QKV[2])
    box = HFSlices(tmp_path / "hf").hf_slice(v, 1, (slice(3, 9), slice(4, 20)))
    want = to_hf(v, params["layers"]["self_attn"]["v_proj"][1])[3:9, 4:20]
    np.testing.assert_array_equal(box, want)
    up = spec_for(fused, GATE_UP[1])
    np.testing.assert_array_equal(
        HFSlices(tmp_path / "hf").hf_slice(up, 0, (slice(0, 48), slice(0, 32))),
        to_hf(up, params["layers"]["mlp"]["up_proj"][0]))
    save_hf(tmp_path / "cut", fused, params)
    from safetensors.numpy import load_file, save_file
    st = load_file(str(tmp_path / "cut" / "model.safetensors"))
    del st["model.layers.1.mlp.gate_up_proj.weight"]
    save_file(st, str(tmp_path / "cut" / "model.safetensors"))
    with pytest.raises(HFError, match=r"no tensor model\.layers\.1\.mlp\.gate_up_proj\.weight"):
        load_hf_params(tmp_path / "cut", fused)


def test_fused_adapter_is_the_targets_adapters_exactly(fused):
    """q, k, v adapters of rank r -> one qkv_proj adapter of rank 3r: lora_A stacked, lora_B
    block-diagonal, alpha 3 alpha (alpha / r kept); B A at q's rows is q's own B A."""
    from jaxmem.peft.lora import LoraSpec
    from jaxmem.peft.export import adapter_config, adapter_tensors

    rng = np.random.default_rng(3)
    spec = LoraSpec(rank=2, alpha=4.0, targets=("q", "k", "v", "up"))
    c = fused
    shapes = {"q_proj": ((32,), (4, 12)), "k_proj": ((32,), (2, 12)), "v_proj": ((32,), (2, 12)),
              "up_proj": ((32,), (48,))}
    ad = {"layers": {"self_attn": {}, "mlp": {}}}
    for name, (ins, outs) in shapes.items():
        group = "mlp" if name == "up_proj" else "self_attn"
        ad["layers"][group][name] = {
            "lora_a": rng.standard_normal((3, *ins, 2)).astype(np.float32),
            "lora_b": rng.standard_normal((3, 2, *outs)).astype(np.float32)}
    t = adapter_tensors(ad, spec, c)
    mod = "base_model.model.model.layers.1.self_attn.qkv_proj"
    A, B = t[f"{mod}.lora_A.weight"], t[f"{mod}.lora_B.weight"]
    assert A.shape == (6, 32) and B.shape == (96, 6)
    delta = B @ A  # [Out, In], HF's layout
    for name, rows in (("q_proj", slice(0, 48)), ("k_proj", slice(48, 72)),
                       ("v_proj", slice(72, 96))):
        a, b = (ad["layers"]["self_attn"][name][k][1] for k in ("lora_a", "lora_b"))
        np.testing.assert_allclose(delta[rows], (a.reshape(32, 2) @ b.reshape(2, -1)).T,
                                   rtol=1e-6, atol=1e-6)
    gu = t["base_model.model.model.layers.0.mlp.gate_up_proj.lora_B.weight"]
    assert gu.shape == (96, 2) and not gu[:48].any()  # gate not targeted: zero rows
    cfg = adapter_config(spec, "", c)
    assert cfg["target_modules"] == ["gate_up_proj", "qkv_proj"]
    assert cfg["rank_pattern"] == {"qkv_proj": 6} and cfg["alpha_pattern"] == {"qkv_proj": 12.0}
