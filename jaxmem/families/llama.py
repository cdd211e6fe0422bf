"""Llama (1 to 3.3): the shared decoder with no variation point set."""

from jaxmem.families.base import Family, register

LLAMA = register(Family("llama", "LlamaForCausalLM", fields=lambda d: {},
                        hf_keys=lambda c: {"mlp_bias": False, "pretraining_tp": 1}))
