"""Qwen3 dense (0.6B to 32B): an RMSNorm over the head dim on q and k before RoPE, an explicit
head dim, tied embeddings in the small sizes; no sliding window. Presets from config.json of
Qwen/Qwen3-*."""

from jaxmem.families.base import Family, full_attention_only, register, window_off
from jaxmem.families.config import ModelConfig

_QWEN3 = dict(family="qwen3", qk_norm=True, vocab_size=151936, head_dim=128, num_kv_heads=8,
              max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6)

PRESETS = {
    "qwen3-0.6b": ModelConfig(hidden_size=1024, intermediate_size=3072, num_layers=28,
                              num_heads=16, tie_embeddings=True, **_QWEN3),
    "qwen3-1.7b": ModelConfig(hidden_size=2048, intermediate_size=6144, num_layers=28,
                              num_heads=16, tie_embeddings=True, **_QWEN3),
    "qwen3-4b": ModelConfig(hidden_size=2560, intermediate_size=9728, num_layers=36,
                            num_heads=32, tie_embeddings=True, **_QWEN3),
    "qwen3-8b": ModelConfig(hidden_size=4096, intermediate_size=12288, num_layers=36,
                            num_heads=32, **_QWEN3),
    "qwen3-14b": ModelConfig(hidden_size=5120, intermediate_size=17408, num_layers=40,
                             num_heads=40, **_QWEN3),
    "qwen3-32b": ModelConfig(hidden_size=5120, intermediate_size=25600, num_layers=64,
                             num_heads=64, **_QWEN3),
}


def _fields(d: dict) -> dict:
    full_attention_only(d, "qwen3")
    return {"qk_norm": True}


QWEN3 = register(Family("qwen3", "Qwen3ForCausalLM", fields=_fields, hf_keys=window_off,
                        presets=PRESETS))
