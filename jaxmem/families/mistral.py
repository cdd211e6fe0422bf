"""Mistral 7B v0.3 and Nemo 12B: the shared decoder with an explicit head dim (Nemo). Their
config.json sets no sliding window; where one does (Mistral 7B v0.1: 4096), every layer is a
sliding-window layer."""

from jaxmem.families.base import Family, register
from jaxmem.families.config import ModelConfig

_MISTRAL = dict(family="mistral", num_kv_heads=8, rope_theta=1000000.0, num_heads=32)

PRESETS = {
    "mistral-7b-v0.3": ModelConfig(vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                                   num_layers=32, max_position_embeddings=32768, **_MISTRAL),
    "mistral-nemo-12b": ModelConfig(vocab_size=131072, hidden_size=5120,
                                    intermediate_size=14336, num_layers=40, head_dim=128,
                                    max_position_embeddings=1024000, **_MISTRAL),
}


def _fields(d: dict) -> dict:
    return {"sliding_window": d.get("sliding_window")}


MISTRAL = register(Family("mistral", "MistralForCausalLM", fields=_fields,
                          hf_keys=lambda c: {"sliding_window": c.sliding_window},
                          presets=PRESETS))
