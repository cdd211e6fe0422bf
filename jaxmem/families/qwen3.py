"""Qwen3 dense (0.6B to 32B): an RMSNorm over the head dim on q and k before RoPE, an explicit
head dim, tied embeddings in the small sizes; no sliding window."""

from jaxmem.families.base import Family, full_attention_only, register, window_off


def _fields(d: dict) -> dict:
    full_attention_only(d, "qwen3")
    return {"qk_norm": True}


QWEN3 = register(Family("qwen3", "Qwen3ForCausalLM", fields=_fields, hf_keys=window_off))
