"""The activations a train step saves for its backward, by formula (jaxmem.memory.analytic's
model of them): per decoder layer under each remat policy (`layer_residuals`), outside the
layers (`outside_residuals`: RoPE tables, embedding output, the loss's) and the MLP backward's
working set (`mlp_backward`, at the tile or slab the step's footprint states). Sizes are in bytes; each
entry is (name, bytes, dtype)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxmem import target
from jaxmem.families.config import ModelConfig
from jaxmem.memory.spec import StepSpec
from jaxmem.model.attention import on_xla, query_chunk
from jaxmem.model.remat import RematPolicy

FP32 = 4


def _nbytes(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def _dname(dtype) -> str:
    return jnp.dtype(dtype).name


# --- activations saved for the backward, per layer --------------------------------------------

def tag_shapes(c: ModelConfig, B: int, T: int) -> dict[str, int]:
    """Elements of each tagged activation of one block (jaxmem.model.remat.TAGS)."""
    D, F, N, K, H = (c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
                     c.resolved_head_dim)
    return {"block_input": B * T * D, "attn_norm": B * T * D, "query": B * T * N * H,
            "key": B * T * K * H,
            "value": B * T * K * H, "attn_context": B * T * N * H, "attn_out": B * T * D,
            "mlp_norm": B * T * D, "mlp_gate": B * T * F, "mlp_up": B * T * F,
            "mlp_hidden": B * T * F, "mlp_out": B * T * D}


def layer_residuals(c: ModelConfig, B: int, T: int, compute_dtype, remat: RematPolicy,
                    attention: str = "xla") -> list[tuple[str, int, str]]:
    """(what, bytes, dtype) of the residuals one decoder block keeps for its backward.

    Read off jaxmem.model.DecoderBlock (and checked against jax's saved residuals in the tests):

    none: each RMSNorm keeps its input [B, T, D] (its custom VJP recomputes the statistic,
        jaxmem.model.lean), and its output [B, T, D] in the compute dtype feeds the next matmul;
        attention keeps q (after RoPE), k, v and the context [B, T, N, H]; on the XLA path
        nothing else (the probabilities are recomputed in the backward), cuDNN flash attention
        also two [B, N, T] softmax statistics;
        the SwiGLU MLP keeps three [B, T, F] tensors (gate and up for its custom VJP, the
        product for down_proj; autodiff kept six).
    full: only the block input [B, T, D] (the scan carry).
    dots_no_batch: the block input, the q/k/v projections, the o_proj output (to rebuild the
        residual stream) and gate/up [B, T, F].
    dots: dots_no_batch plus, on the XLA path, attention's PV output (QK^T is recomputed with
        the probabilities: the custom VJP hides it from the policy).
    sandwich norms (Gemma 3's norms after attention and after the MLP): under none both keep
        their inputs [B, T, D]; under dots / dots_no_batch the post-MLP norm's input, down_proj's
        output (the o_proj output is kept already); nothing more under full or names. With
        (1 + w) norms (Gemma 3) each norm's fp32 scale too, under none.
    names:a,b / offload:a,b: the block input plus the tagged tensors the backward reads
        (`mlp_out` is only added to the residual stream, so it is never kept); offloaded
        tensors live in host memory and count zero here, the block input too when it is
        offloaded (tag `block_input`, in the default `offload`).
    """
    D, F, N = c.hidden_size, c.intermediate_size, c.num_heads
    cb, cd = _nbytes(compute_dtype), _dname(compute_dtype)
    tags = tag_shapes(c, B, T)
    BTD, BNT = B * T * D, B * N * T
    block_input = ("block input [B,T,D]", BTD * cb, cd)
    if remat.recomputes_all:
        return [block_input]
    if not remat.enabled:
        out = []
        for norm in ("attn_norm", "mlp_norm"):
            out += [(f"{norm}: input [B,T,D]", BTD * cb, cd),
                    (f"{norm}: output [B,T,D]", BTD * cb, cd)]
        if c.qk_norm:  # the QK-norm keeps its inputs, q and k before it (jaxmem.model.lean)
            out += [("q, k before the QK-norm", (tags["query"] + tags["key"]) * cb, cd)]
        out += [("q, k, v after RoPE", (tags["query"] + tags["key"] + tags["value"]) * cb, cd),
                ("attention context [B,T,N,H]", tags["attn_context"] * cb, cd)]
        if not on_xla(attention):  # XLA: the probabilities are recomputed, nothing [B,N,T] kept
            out += [("softmax statistics [B,N,T] x2", 2 * BNT * FP32, "float32")]
        out += [("SwiGLU [B,T,F] x3", 3 * B * T * F * cb, cd)]
        if c.norms.post_norms:  # the post-norms (Gemma 3) keep their inputs: o_proj's, down_proj's
            out += [("post-norms: inputs [B,T,D] x2", 2 * BTD * cb, cd)]
        if c.norm_plus_one:  # (1 + w) of each norm's scale, fp32 (a few KiB a layer)
            norms = len(c.norms.names) * D + (2 * c.resolved_head_dim if c.qk_norm else 0)
            out += [("norm scales (1 + w)", norms * FP32, "float32")]
        return out
    if remat.saves_dots:
        out = [block_input, ("o_proj output [B,T,D]", BTD * cb, cd),
               ("q, k, v projections", (tags["query"] + tags["key"] + tags["value"]) * cb, cd),
               ("gate, up [B,T,F] x2", 2 * B * T * F * cb, cd)]
        if remat.saves_batched_dots and on_xla(attention):
            out += [("PV output [B,T,N,H]", tags["attn_context"] * cb, cd)]
        if c.norms.after_mlp:  # the post-MLP norm's input is down_proj's output, a dot: kept
            out += [("down_proj output [B,T,D]", BTD * cb, cd)]
        return out
    # names / offload: the block input (unless offloaded) and the tags kept on the device
    # (an offloaded tag lives in host memory and counts zero here)
    kept = [] if "block_input" in remat.offloaded_tags else [block_input]
    return kept + [(f"tag {t}", tags[t] * cb, cd) for t in remat.kept_tags
                   if t not in ("mlp_out", "block_input")]


def offloaded_residuals(c: ModelConfig, B: int, T: int, compute_dtype,
                        remat: RematPolicy) -> int:
    """Bytes per layer an `offload` policy keeps in pinned host memory: the block input where
    offloaded, and each offloaded tag the backward reads (0 for any other policy)."""
    tags, cb = tag_shapes(c, B, T), _nbytes(compute_dtype)
    off = remat.offloaded_tags
    return (B * T * c.hidden_size * cb if "block_input" in off else 0) + sum(
        tags[t] * cb for t in off if t not in ("mlp_out", "block_input"))


def outside_residuals(c: ModelConfig, B: int, T: int, compute_dtype, remat: RematPolicy,
                      attention: str = "xla", loss_chunk: int = 0) -> list[tuple[str, int, str]]:
    """Residuals kept outside the layer stack: RoPE tables, final norm, loss (no padding mask);
    loss_chunk: the fused loss's resolved chunk (jaxmem.loss.chunked; 0: unfused logits)."""
    D, H, V = c.hidden_size, c.resolved_head_dim, c.vocab_size
    cb, cd = _nbytes(compute_dtype), _dname(compute_dtype)
    out = [("RoPE cos/sin [B,T,H/2] x2", 2 * B * T * (H // 2) * FP32, "float32"),
           ("final norm: input [B,T,D]", B * T * D * cb, cd),
           ("final norm: output [B,T,D]", B * T * D * cb, cd)]
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
    norm's input and output, q, k, v and the context."""
    tags = tag_shapes(c, B, T)
    names = ("block_input", "attn_norm", "query", "key", "value", "attn_context")
    return sum(tags[t] for t in names) * _nbytes(compute_dtype)
