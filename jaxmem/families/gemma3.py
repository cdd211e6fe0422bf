"""Gemma 3 (1B, and the text stack of 4B, 12B, 27B): local sliding-window layers with a global
one every sixth (`layer_types`), separate local and global RoPE bases with linear scaling on
the global layers, QK-norm, norms before and after attention and the MLP, RMSNorm with (1 + w),
GeGLU with GELU-tanh, embeddings times sqrt(hidden), `query_pre_attn_scalar`, a tied head.

Gemma3ForCausalLM's config.json (model_type gemma3_text) is read as it is; a
Gemma3ForConditionalGeneration one (model_type gemma3: 4B, 12B, 27B) gives its `text_config`,
whose missing keys take Gemma3TextConfig's defaults, and the language model's tensors."""

from jaxmem.families.base import Family, refuse, register
from jaxmem.families.config import ModelConfig

# transformers' Gemma3TextConfig defaults: a checkpoint's text_config lists only what differs
TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "attention_bias": False, "attention_dropout": 0.0,
}
PATTERN = 6  # sliding_window_pattern: every sixth layer is global where layer_types is absent


def _gemma3(num_layers: int, **shape) -> ModelConfig:
    """Gemma 3's text decoder (config.json of google/gemma-3-*): five local layers of a
    1024-token window then a global one, linear RoPE scaling 8 on the global layers."""
    fields = dict(family="gemma3", vocab_size=262208, head_dim=256, max_position_embeddings=131072,
                  rope_theta=1000000.0, rope_local_theta=10000.0, rope_type="linear",
                  rope_factor=8.0, rms_norm_eps=1e-6, tie_embeddings=True, qk_norm=True,
                  norm_plus_one=True, norm_placement="sandwich", mlp_activation="gelu_tanh",
                  embed_scale=True, query_pre_attn_scalar=256, sliding_window=1024,
                  num_layers=num_layers, layer_types=tuple(
                      "full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                      for i in range(num_layers)))
    return ModelConfig(**{**fields, **shape})


PRESETS = {
    "gemma-3-1b": _gemma3(26, vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                          num_heads=4, num_kv_heads=1, max_position_embeddings=32768,
                          sliding_window=512, rope_type="default", rope_factor=1.0),
    "gemma-3-4b": _gemma3(34, hidden_size=2560, intermediate_size=10240, num_heads=8,
                          num_kv_heads=4),
    "gemma-3-12b": _gemma3(48, hidden_size=3840, intermediate_size=15360, num_heads=16,
                           num_kv_heads=8),
    "gemma-3-27b": _gemma3(62, hidden_size=5376, intermediate_size=21504, num_heads=32,
                           num_kv_heads=16, head_dim=128, query_pre_attn_scalar=168),
}


def _text_config(d: dict) -> dict:
    text = {**TEXT_DEFAULTS, **(d.get("text_config") or {}), "model_type": "gemma3_text"}
    return {k: v for k, v in text.items() if k != "vision_config"}


def _fields(d: dict) -> dict:
    d = {**TEXT_DEFAULTS, **d}
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        refuse(d, key, lambda v: False, "Gemma 3 sets no softcapping; Gemma 2's is not built")
    refuse(d, "use_bidirectional_attention", lambda v: v is False, "causal attention only")
    L = d["num_hidden_layers"]
    types = d.get("layer_types") or [
        "sliding_attention" if (i + 1) % d.get("sliding_window_pattern", PATTERN) else
        "full_attention" for i in range(L)]
    local = (d.get("rope_parameters") or {}).get("sliding_attention") or {}
    refuse(local, "rope_type", lambda v: v == "default", "the local layers' RoPE is unscaled")
    return {"qk_norm": True, "norm_plus_one": True, "norm_placement": "sandwich",
            "embed_scale": True,
            "query_pre_attn_scalar": int(d["query_pre_attn_scalar"]),
            "sliding_window": int(d["sliding_window"]), "layer_types": tuple(types),
            "rope_local_theta": float(local.get("rope_theta", d["rope_local_base_freq"]))}


def _hf_keys(c) -> dict:
    full = {"rope_type": c.rope_type, "rope_theta": c.rope_theta}
    if c.rope_type == "linear":
        full["factor"] = c.rope_factor
    return {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": c.query_pre_attn_scalar, "sliding_window": c.sliding_window,
            "layer_types": list(c.layer_types or ()), "rope_local_base_freq": c.rope_local_theta,
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "rope_parameters": {"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": c.rope_local_theta}},
            "rope_scaling": {"rope_type": "linear", "factor": c.rope_factor}
            if c.rope_type == "linear" else None}


GEMMA3 = register(Family("gemma3", "Gemma3ForCausalLM", fields=_fields, hf_keys=_hf_keys,
                         model_type="gemma3_text", text_config=_text_config, reads=("gemma3",),
                         prefixes=("model.", "model.language_model.", "language_model.model."),
                         presets=PRESETS))
