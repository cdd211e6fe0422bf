"""jaxmem: train decoder language models (Llama, Qwen, Mistral, Gemma 3, OLMo 2, Phi-4-mini) in JAX/Flax with as
little memory as possible, and its memory savings as a library for any JAX model (docs/api.md).

The public modules, each imported on first use (so `import jaxmem` costs nothing, and
`jaxmem.optim.adamw_8bit` loads neither the trainer nor torch, transformers or matplotlib):

    jaxmem.optim    8-bit AdamW, bf16 stochastic rounding, dynamic loss scaling (optax-style)
    jaxmem.loss     fused_cross_entropy: the LM head + cross-entropy without [B, T, V] logits
    jaxmem.remat    remat policies by name for jax.checkpoint / nn.remat
    jaxmem.quant    NF4 / int8 quantization of a pytree of weights
    jaxmem.lora     LoRA-wrapped weights over a dense or quantized base; Linen / NNX adapters
    jaxmem.memory   analyze(fn, *args): XLA's memory plan of any jittable function

Public names (listed in docs/api.md, checked by tests/test_api.py) follow deprecation: one
release with a warning before a change. Every other module is internal and may change.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_SUBMODULES = ("loss", "lora", "memory", "optim", "quant", "remat")

__all__ = list(_SUBMODULES)


def __getattr__(name: str):
    if name in _SUBMODULES:
        # import_module also sets the attribute on this package, so this runs once per name
        return importlib.import_module(f"jaxmem.{name}")
    raise AttributeError(f"module 'jaxmem' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_SUBMODULES))
