"""What LoRA and a quantized base change in the memory of a train step (for jaxmem.memory).

    lora_saved_per_layer(c, spec, B, T)  what each adapter keeps for its backward: x A [B, T, R]
                                         (and the dropout mask of x when dropout > 0)
    dequant_transient(c, spec, dtype)    one layer's projections dequantized at once (the
                                         custom VJP frees them after each use; XLA may overlap
                                         the seven of a layer, so a layer is the bound)
    adapter_backward_transient(c, spec, B, T, dtype)
                                         the adapters' output gradients in a layer's backward

The gradients, moments, master copy and update are the adapters' alone; the base is an argument
never differentiated, stored once in its final dtype (no amp compute copy of it). The saved
activations are full fine-tuning's plus x A per adapter (equal to jax's saved residuals,
tests/test_peft_memory.py); the rest is transient (docs/finetune.md).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxmem.families.config import ModelConfig
from jaxmem.peft.base import weight_axes


def _in_out(c: ModelConfig) -> dict[str, tuple[int, int]]:
    return {name: (math.prod(shape[:n_in]), math.prod(shape[n_in:]))
            for name, (_, shape, n_in) in weight_axes(c).items()}


def lora_saved_per_layer(c: ModelConfig, spec: "LoraSpec", B: int, T: int,
                         dtype) -> list[tuple[str, int, str]]:
    cb, cd = jnp.dtype(dtype).itemsize, jnp.dtype(dtype).name
    out = [(f"LoRA x A [B,T,R] x{len(spec.targets)}", len(spec.targets) * B * T * spec.rank * cb,
            cd)]
    if spec.dropout > 0:
        io = _in_out(c)
        out.append(("LoRA dropout masks [B,T,in]", sum(B * T * io[t][0] for t in spec.targets),
                    "bool"))
    return out


def dequant_transient(c: ModelConfig, spec: "LoraSpec", dtype) -> int:
    if spec.quantize == "none":
        return 0
    return sum(i * o for i, o in _in_out(c).values()) * jnp.dtype(dtype).itemsize


def adapter_backward_transient(c: ModelConfig, spec: "LoraSpec", B: int, T: int, dtype) -> int:
    """Bytes the adapters' backward adds to one layer's backward: per target, [B, T, Out] twice.

    Per adapter the scaled gradient s dy feeds dB = (x A)^T (s dy) and d(x A) = (s dy) B^T: XLA
    materializes s dy [B, T, Out] (with alpha == rank, s == 1, the multiply is dropped) and one
    more [B, T, Out] buffer per target (not traced to its op; likely a relayout for dB's dot),
    live through the layer's backward. Measured on the toy of tests/test_peft_memory.py (CPU,
    fp32, remat none, r 8, alpha 16): targets one at a time, gate and up add 2 x [B, T, F] each,
    down about 3 x [B, T, F], attention targets less than one [B, T, D]. 2 x Out per target is
    the simple fit: with it the toy's LoRA analytic / compiled ratio (0.84; 0.86, 0.90, 0.89 at
    2x the batch, the layers, the sequence) tracks full fine-tuning's (0.84; 0.81, 0.91, 0.86),
    where it was 0.66 without it (docs/finetune.md).
    """
    io = _in_out(c)
    per_target = 2 if spec.scale != 1 else 1
    return per_target * sum(B * T * io[t][1] for t in spec.targets) * jnp.dtype(dtype).itemsize

