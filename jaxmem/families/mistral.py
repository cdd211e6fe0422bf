"""Mistral 7B v0.3 and Nemo 12B: the shared decoder with an explicit head dim (Nemo). Their
config.json sets no sliding window; where one does (Mistral 7B v0.1: 4096), every layer is a
sliding-window layer."""

from jaxmem.families.base import Family, register


def _fields(d: dict) -> dict:
    return {"sliding_window": d.get("sliding_window")}


MISTRAL = register(Family("mistral", "MistralForCausalLM", fields=_fields,
                          hf_keys=lambda c: {"sliding_window": c.sliding_window}))
