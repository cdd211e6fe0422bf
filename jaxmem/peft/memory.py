"""What LoRA and a quantized base change in the memory of a train step (for jaxmem.memory).

    trainable_params(c, spec)            adapter parameters: sum over targets of L * R * (In + Out)
    base_components(c, spec, dtype)      the frozen base's bytes: int8 / NF4 projections (codes +
                                         scales, counted as quant.bits_per_param counts them),
                                         embedding and LM head in the compute dtype, norms fp32
    lora_saved_per_layer(c, spec, B, T)  what each adapter keeps for its backward: x A [B, T, R]
                                         (and the dropout mask of x when dropout > 0)
    dequant_transient(c, spec, dtype)    one layer's projections dequantized at once (the
                                         custom VJP frees them after each use; XLA may overlap
                                         the seven of a layer, so a layer is the bound)
    adapter_backward_transient(c, spec, B, T, dtype)
                                         what the adapters' backward adds to a layer's
                                         backward: [B, T, Out] buffers per target (see there)

With LoRA the gradients, Adam's moments, the master copy and the update buffer are the adapters'
alone; the base is an argument of the step that is never differentiated, stored once in its
final dtype (so amp modes keep no extra compute copy of it). Activations saved for the backward
are those of full fine-tuning: dx through every frozen projection needs the same inputs (plus
x A per adapter; equal to jax's saved residuals, tests/test_peft_memory.py). What a LoRA step has
beyond full fine-tuning's backward is transient: the adapters' output gradients.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxmem.config.model import ModelConfig
from jaxmem.config.lora import TARGETS
from jaxmem.peft.base import weight_axes
from jaxmem.quant import DQ_BLOCK


def _in_out(c: ModelConfig) -> dict[str, tuple[int, int]]:
    return {name: (math.prod(shape[:n_in]), math.prod(shape[n_in:]))
            for name, (_, shape, n_in) in weight_axes(c).items()}


def trainable_params(c: ModelConfig, spec: "LoraSpec") -> int:
    io = _in_out(c)
    return sum(c.num_layers * spec.rank * (io[t][0] + io[t][1]) for t in spec.targets)


def quantized_bytes(In: int, Out: int, kind: str, block: int, double_quant: bool) -> float:
    """Bytes of one layer's In x Out weight stored by jaxmem.quant."""
    block = block or In
    n_scales = In // block * Out
    codes = In * Out * (0.5 if kind == "nf4" else 1)
    if double_quant:
        scales = n_scales + math.ceil(n_scales / DQ_BLOCK) * 4 + 4
    else:
        scales = n_scales * 4
    return codes + scales


def base_components(c: ModelConfig, spec: "LoraSpec", dtype) -> list[tuple[str, int, str]]:
    """(what, bytes, dtype) of the frozen base as the train step holds it."""
    cb, cd = jnp.dtype(dtype).itemsize, jnp.dtype(dtype).name
    io = _in_out(c)
    proj = sum(i * o for i, o in io.values()) * c.num_layers
    if spec.quantize == "none":
        out = [("frozen base: projections", proj * cb, cd)]
    else:
        q = sum(quantized_bytes(i, o, spec.quantize, spec.block, spec.double_quant)
                for i, o in io.values()) * c.num_layers
        out = [(f"frozen base: proj. {spec.quantize}" + ("+dq" if spec.double_quant else ""),
                int(q), "uint8+float32" if spec.quantize == "nf4" else "int8+float32")]
    embed = c.vocab_size * c.hidden_size * (1 if c.tie_embeddings else 2)
    norms = (2 * c.num_layers + 1) * c.hidden_size
    return out + [("frozen base: embed + head", embed * cb, cd),
                  ("frozen base: norms", norms * 4, "float32")]


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

    A LoRA step keeps exactly full fine-tuning's residuals plus x A (jax's saved_residuals agrees
    to the byte on the test toy), but its backward is not full fine-tuning's: dy feeds dx = dy W^T
    and, per adapter, the scaled gradient s dy feeds dB = (x A)^T (s dy) and d(x A) = (s dy) B^T.
    XLA materializes s dy [B, T, Out] (measured: with alpha == rank, s == 1, the multiply is
    dropped and one [B, T, F] per MLP target goes away) and one more [B, T, Out] buffer per target
    (not traced to its op; likely a relayout for dB's dot, which contracts over B*T), and
    keeps them live through the layer's backward next to the recomputed activations. Measured on
    the toy of tests/test_peft_memory.py (CPU, fp32, remat none, r 8, alpha 16): the LoRA step's
    compiled temp grows 7.5 MB per extra 256 tokens where full fine-tuning's grows 4.2 MB, with
    the [B, T, F] targets gate and up adding 2 x [B, T, F] each (targets one at a time; down
    adds about 3 x [B, T, F], its input being F wide, attention targets less than one [B, T, D]).
    2 x Out per target is the simple fit: with it the toy's LoRA analytic / compiled ratio (0.84;
    0.86, 0.90, 0.89 at 2x the batch, the layers, the sequence) tracks full fine-tuning's (0.84;
    0.81, 0.91, 0.86), where it was 0.66 without it.
    """
    io = _in_out(c)
    per_target = 2 if spec.scale != 1 else 1
    return per_target * sum(B * T * io[t][1] for t in spec.targets) * jnp.dtype(dtype).itemsize


def targets_text(spec: "LoraSpec") -> str:
    return ",".join(TARGETS[t][1] for t in spec.targets)
