"""Llama (1 to 3.3): the shared decoder with no variation point set. Its presets carry the
published shapes; `tiny` and `small` are Llama-shaped models of the byte-level vocabulary."""

from jaxmem.families.base import Family, register
from jaxmem.families.config import ModelConfig

_LLAMA3_VOCAB = 128256
# Llama 3.2's RoPE scaling, from its config.json `rope_scaling`; Llama 3.1 (8B, 70B, 405B) has
# the same with factor 8.
_LLAMA3_ROPE = dict(rope_type="llama3", rope_factor=32.0, rope_low_freq_factor=1.0,
                    rope_high_freq_factor=4.0, rope_original_max_position_embeddings=8192)
_LLAMA31 = dict(vocab_size=_LLAMA3_VOCAB, num_kv_heads=8, max_position_embeddings=131072,
                rope_theta=500000.0, **{**_LLAMA3_ROPE, "rope_factor": 8.0})

PRESETS = {
    # CPU smoke model: trains on the built-in corpus in a few minutes on 2 cores.
    "tiny": ModelConfig(),
    # ~25M parameters with the byte-level vocabulary.
    "small": ModelConfig(hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
                         num_kv_heads=4, max_position_embeddings=2048),
    "llama-3.2-1b": ModelConfig(vocab_size=_LLAMA3_VOCAB, hidden_size=2048, intermediate_size=8192,
                                num_layers=16, num_heads=32, num_kv_heads=8,
                                max_position_embeddings=131072, rope_theta=500000.0,
                                tie_embeddings=True, **_LLAMA3_ROPE),
    "llama-3.2-3b": ModelConfig(vocab_size=_LLAMA3_VOCAB, hidden_size=3072, intermediate_size=8192,
                                num_layers=28, num_heads=24, num_kv_heads=8, head_dim=128,
                                max_position_embeddings=131072, rope_theta=500000.0,
                                tie_embeddings=True, **_LLAMA3_ROPE),
    "llama-3-8b": ModelConfig(vocab_size=_LLAMA3_VOCAB, hidden_size=4096, intermediate_size=14336,
                              num_layers=32, num_heads=32, num_kv_heads=8,
                              max_position_embeddings=8192, rope_theta=500000.0),
    # Llama 3.1: 131k positions with llama3 RoPE (factor 8); for planning and --init-from checks.
    "llama-3.1-8b": ModelConfig(hidden_size=4096, intermediate_size=14336, num_layers=32,
                                num_heads=32, **_LLAMA31),
    "llama-3.1-70b": ModelConfig(hidden_size=8192, intermediate_size=28672, num_layers=80,
                                 num_heads=64, **_LLAMA31),
    "llama-3.1-405b": ModelConfig(hidden_size=16384, intermediate_size=53248, num_layers=126,
                                  num_heads=128, **_LLAMA31),
    "llama-2-7b": ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                              num_layers=32, num_heads=32, num_kv_heads=32,
                              max_position_embeddings=4096, rope_theta=10000.0),
}

LLAMA = register(Family("llama", "LlamaForCausalLM", fields=lambda d: {},
                        hf_keys=lambda c: {"mlp_bias": False, "pretraining_tp": 1},
                        presets=PRESETS))
