"""Qwen2 and Qwen2.5 dense (0.5B to 72B): biases on the q, k and v projections, tied embeddings
in the small sizes; no sliding window. Presets from config.json of Qwen/Qwen2.5-*."""

from jaxmem.families.base import Family, full_attention_only, register, window_off
from jaxmem.families.config import ModelConfig

_QWEN2 = dict(family="qwen2", qkv_bias=True, vocab_size=151936, max_position_embeddings=32768,
              rope_theta=1000000.0, rms_norm_eps=1e-6)
_QWEN2_BIG = dict(_QWEN2, vocab_size=152064, max_position_embeddings=131072)

PRESETS = {
    "qwen2.5-0.5b": ModelConfig(hidden_size=896, intermediate_size=4864, num_layers=24,
                                num_heads=14, num_kv_heads=2, tie_embeddings=True, **_QWEN2),
    "qwen2.5-1.5b": ModelConfig(hidden_size=1536, intermediate_size=8960, num_layers=28,
                                num_heads=12, num_kv_heads=2, tie_embeddings=True, **_QWEN2),
    "qwen2.5-3b": ModelConfig(hidden_size=2048, intermediate_size=11008, num_layers=36,
                              num_heads=16, num_kv_heads=2, tie_embeddings=True, **_QWEN2),
    "qwen2.5-7b": ModelConfig(hidden_size=3584, intermediate_size=18944, num_layers=28,
                              num_heads=28, num_kv_heads=4, **_QWEN2_BIG),
    "qwen2.5-14b": ModelConfig(hidden_size=5120, intermediate_size=13824, num_layers=48,
                               num_heads=40, num_kv_heads=8, **_QWEN2_BIG),
    "qwen2.5-32b": ModelConfig(hidden_size=5120, intermediate_size=27648, num_layers=64,
                               num_heads=40, num_kv_heads=8, **_QWEN2_BIG),
    "qwen2.5-72b": ModelConfig(hidden_size=8192, intermediate_size=29568, num_layers=80,
                               num_heads=64, num_kv_heads=8, **_QWEN2_BIG),
}


def _fields(d: dict) -> dict:
    full_attention_only(d, "qwen2")
    return {"qkv_bias": True}


QWEN2 = register(Family("qwen2", "Qwen2ForCausalLM", fields=_fields, hf_keys=window_off,
                        presets=PRESETS))
