"""The activations a train step saves for its backward, by formula (jaxmem.memory.analytic's
model of them): per decoder layer under each remat policy (`layer_residuals`: what the model's
family states, jaxmem.families.residuals), outside the
layers (`outside_residuals`: RoPE tables, embedding output, the loss's) and the MLP backward's
working set (`mlp_backward`, at the tile or slab the step's footprint states). Sizes are in bytes; each
entry is (name, bytes, dtype)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxmem import families, target
from jaxmem.families.config import ModelConfig
from jaxmem.families.residuals import selects_rope, tag_shapes
from jaxmem.memory.spec import StepSpec
from jaxmem.model.attention import query_chunk
from jaxmem.model.remat import RematPolicy

FP32 = 4


def _nbytes(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def _dname(dtype) -> str:
    return jnp.dtype(dtype).name


# --- activations saved for the backward, per layer --------------------------------------------

def layer_residuals(c: ModelConfig, B: int, T: int, compute_dtype, remat: RematPolicy,
                    attention: str = "xla") -> list[tuple[str, int, str]]:
    """(what, bytes, dtype) of the residuals one decoder block keeps for its backward, as its
    family states them (`Family.block_residuals`: the shared decoder's formula,
    jaxmem.families.residuals, unless the family states its own)."""
    return families.get(c.family).block_residuals(c, B, T, compute_dtype, remat, attention)


def offloaded_residuals(c: ModelConfig, B: int, T: int, compute_dtype,
                        remat: RematPolicy) -> int:
    """Bytes per layer an `offload` policy keeps in pinned host memory: the block input where
    offloaded, and each offloaded tag the backward reads (0 for any other policy)."""
    tags, cb = tag_shapes(c, B, T), _nbytes(compute_dtype)
    off = remat.offloaded_tags
    return (B * T * c.hidden_size * cb if "block_input" in off else 0) + sum(
        tags[t] * cb for t in off if t in tags and t not in ("mlp_out", "block_input"))


def outside_residuals(c: ModelConfig, B: int, T: int, compute_dtype, remat: RematPolicy,
                      attention: str = "xla", loss_chunk: int = 0) -> list[tuple[str, int, str]]:
    """Residuals kept outside the layer stack: RoPE tables, final norm, loss (no padding mask);
    loss_chunk: the fused loss's resolved chunk (jaxmem.loss.chunked; 0: unfused logits)."""
    D, V = c.hidden_size, c.vocab_size
    cb, cd = _nbytes(compute_dtype), _dname(compute_dtype)
    rope = 2 * B * T * (c.rotary_dim // 2) * FP32  # R: the rotary dims (all H but Phi-3's)
    out = [("final norm: input [B,T,D]", B * T * D * cb, cd),
           ("final norm: output [B,T,D]", B * T * D * cb, cd)]
    if not (selects_rope(c) and not remat.enabled):  # else each layer keeps its own tables
        # the tables the layers read: the local layers' own where layer_context makes them
        # (Gemma 3's base; Mistral's all-local stack reads only those)
        kinds = set(c.local_layers)
        own = any(kinds) and c.rope_kwargs(local=True) != c.rope_kwargs()
        sets = len(kinds) if own else 1
        out += [(f"RoPE cos/sin [B,T,R/2] x{2 * sets}", sets * rope, "float32")]
    if c.norm_plus_one:  # Gemma 3: its (1 + w) scale, fp32
        out += [("final norm: scale (1 + w)", D * FP32, "float32")]
    if loss_chunk:
        padded = -(-T // loss_chunk) * loss_chunk
        out += [("fused loss: logsumexp [B,T] fp32", B * padded * FP32, "float32"),
                ("fused loss: weights [B,T] fp32, embedding gather indices [B,T] int32",
                 2 * B * T * 4, "mixed")]
    else:
        out += [("loss: exp(logits - max) [B,T,V] fp32", B * T * V * FP32, "float32"),
                ("loss: weights, max, targets [B,T]", 4 * B * T * FP32 + B * T, "mixed")]
    return out


def mlp_backward_buffers(saved: bool) -> int:
    """[B, T, F] buffers the MLP's backward holds besides its 3 recomputed activations (gate, up,
    their product), read off each compiler's buffer report (docs/memory.md). A GPU: 3 (the
    elementwise products fuse into the kernel that writes d(gate) and d(up) from d(product)),
    whether or not the policy saved gate and up. XLA:CPU: 6 where they are recomputed (d of the
    product, gate and up, and the SwiGLU backward's sigmoid / silu products, jaxmem.model.lean),
    none where they are `saved`."""
    if target.fuses_elementwise():
        return 3
    return 0 if saved else 6


def mlp_backward(spec: StepSpec) -> int:
    """Bytes of the MLP backward's working set beyond the recomputed residuals:
    mlp_backward_buffers [B, T, F] (tiled: 3 more [B, Tc, F], the tile's recomputed
    activations, and the 3 full-length ones are not materialized, so they are taken back out of
    the recomputed set)."""
    c, B, T = spec.model, spec.rows, spec.seq_len
    F, cb = c.intermediate_size, _nbytes(spec.precision.compute_dtype)
    r = spec.remat
    recomputed = not r.saves_dots and not {"mlp_gate", "mlp_up"} <= {*r.kept_tags,
                                                                      *r.offloaded_tags}
    buffers = mlp_backward_buffers(saved=not recomputed)
    if not recomputed:  # gate and up saved or offloaded (none, dots*, the default offload)
        return buffers * B * T * F * cb
    tile = spec.footprint.mlp_tile  # the step's own rules (jaxmem.train.footprint)
    if tile:
        # tiled only where no policy saves an MLP tag: the 3 are in the recomputed set
        return (3 + buffers) * B * tile * F * cb - 3 * B * T * F * cb
    w = spec.footprint.mlp_slab
    if w:  # in-backward slabs: one slab's [B, T, w] each, the 3 recomputed ones too
        return buffers * B * T * w * cb - 3 * B * T * (F - w) * cb
    return buffers * B * T * F * cb


def attention_backward(c: ModelConfig, B: int, T: int, compute_dtype) -> int:
    """Bytes XLA attention's backward holds for one query chunk (jaxmem.model.attention), per
    [B, N, Tq, T] element, read off each compiler's buffer report (docs/memory.md): XLA:CPU
    keeps the recomputed probabilities, two gradients of them and a compute-dtype copy (4
    buffers in fp32); a GPU three fp32 buffers, the compute-dtype copy where it is a cast, and
    the causal mask it broadcasts over the heads (one byte)."""
    cb = _nbytes(compute_dtype)
    per = 3 * FP32 + ((cb if cb < FP32 else 0) + 1 if target.fuses_elementwise() else cb)
    N = c.num_heads
    return B * N * query_chunk((B, T, N), T) * T * per


def attention_half(c: ModelConfig, B: int, T: int, compute_dtype) -> int:
    """Bytes of what attention's backward reads of one block's activations: the attention
    norm's input and output (the block input alone where it has no pre-norm), q, k, v and the
    context."""
    tags = tag_shapes(c, B, T)
    names = ("block_input", "attn_norm", "query", "key", "value", "attn_context")
    return sum(tags.get(t, 0) for t in names) * _nbytes(compute_dtype)
