"""Qwen2 and Qwen2.5 dense (0.5B to 72B): biases on the q, k and v projections, tied embeddings
in the small sizes; no sliding window."""

from jaxmem.families.base import Family, full_attention_only, register, window_off


def _fields(d: dict) -> dict:
    full_attention_only(d, "qwen2")
    return {"qkv_bias": True}


QWEN2 = register(Family("qwen2", "Qwen2ForCausalLM", fields=_fields, hf_keys=window_off))
