"""Mistral 7B v0.3 and Nemo 12B: the shared decoder with an explicit head dim (Nemo). Their
config.json sets no sliding window; one that does (Mistral 7B v0.1) is refused for now."""

from jaxmem.families.base import Family, refuse, register


def _fields(d: dict) -> dict:
    refuse(d, "sliding_window", lambda v: False, "sliding-window attention is not built yet")
    return {}


MISTRAL = register(Family("mistral", "MistralForCausalLM", fields=_fields,
                          hf_keys=lambda c: {"sliding_window": None}))
