"""What one block of the shared decoder (jaxmem.families.decoder) keeps for its backward, by
formula: a family's `residuals` (jaxmem.families.base.Family) unless it states its own. The
planner (jaxmem.memory.activations) asks the family; tests/test_planner.py holds this formula
to jax's saved residuals for every registered family and remat policy.

    tag_shapes(c, B, T)          elements of each tagged activation of one block
    decoder_residuals(c, B, T, compute_dtype, remat, attention)
                                 [(what, bytes, dtype)] one block keeps
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxmem.families.config import ModelConfig
from jaxmem.model.attention import effective_window, on_xla, window_chunk
from jaxmem.model.remat import RematPolicy

FP32 = 4
# the gated MLP's three [B, T, F] tensors kept without remat (the planner's eval working set,
# which frees them with the layer, leaves this entry out by its name)
GATED_MLP = "gated MLP [B,T,F] x3"


def tag_shapes(c: ModelConfig, B: int, T: int) -> dict[str, int]:
    """Elements of each tagged activation of one block (jaxmem.model.remat.TAGS); a norm's tag
    only where the block has that norm (`attn_norm`, `mlp_norm`: the pre-norms)."""
    D, F, N, K, H = (c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
                     c.resolved_head_dim)
    tags = {"block_input": B * T * D, "attn_norm": B * T * D, "query": B * T * N * H,
            "key": B * T * K * H, "value": B * T * K * H, "attn_context": B * T * N * H,
            "attn_out": B * T * D, "mlp_norm": B * T * D, "mlp_gate": B * T * F,
            "mlp_up": B * T * F, "mlp_hidden": B * T * F, "mlp_out": B * T * D}
    if c.norms.before_attention is None:
        del tags["attn_norm"]
    if c.norms.before_mlp is None:
        del tags["mlp_norm"]
    return tags


def _pv_output(c: ModelConfig, B: int, T: int) -> tuple[int, str]:
    """Elements of attention's PV output a layer keeps under `dots` on the XLA path, and what:
    [B, T, N, H]; a sliding-window layer's (jaxmem.model.window) is chunk-padded,
    [B, N, H, n Tq] for n = ceil(T / Tq) query chunks of Tq (`window_chunk`); where the stack
    mixes local and global layers each layer runs a cond of both, and keeps both."""
    N, H = c.num_heads, c.resolved_head_dim
    window = effective_window(c.sliding_window, T, T)
    local = set(c.local_layers) if window is not None else {False}
    out, what = 0, []
    if False in local:
        out += B * T * N * H
        what.append("[B,T,N,H]")
    if True in local:
        chunk = window_chunk((B, T, N, H), window)
        out += B * N * H * -(-T // chunk) * chunk
        what.append(f"windowed [B,N,H,{-(-T // chunk)}x{chunk}]")
    return out, " + ".join(what)


def selects_rope(c: ModelConfig) -> bool:
    """Whether each layer picks its RoPE tables by its kind at run time (a stack mixing local
    and global layers whose bases differ, Gemma 3: `jnp.where` on the scanned kind). Without
    remat each layer then keeps its chosen tables, [B, T, R/2] x2 fp32, and the two shared
    sets are kept by none (jaxmem.memory.activations.outside_residuals)."""
    return c.mixed_layers and c.rope_kwargs(local=True) != c.rope_kwargs()


def _norm_scales(c: ModelConfig) -> int:
    """Elements of a block's norm scales: its RMSNorms' [D] and the QK-norm's."""
    return len(c.norms.names) * c.hidden_size + (sum(c.qk_norm_widths) if c.qk_norm else 0)


def _kept_without_remat(c: ModelConfig, B: int, T: int, compute_dtype,
                        attention: str) -> list[tuple[str, int, str]]:
    """`decoder_residuals` under remat none (its docstring)."""
    cb, cd = jnp.dtype(compute_dtype).itemsize, jnp.dtype(compute_dtype).name
    tags = tag_shapes(c, B, T)
    BTD, F, p = B * T * c.hidden_size, c.intermediate_size, c.norms
    norms = len([n for n in (p.before_attention, p.before_mlp) if n]) + len(p.post_norms)
    out = [("attention, MLP inputs [B,T,D] x2", 2 * BTD * cb, cd),
           (f"norms' inputs [B,T,D] x{norms}", norms * BTD * cb, cd)]
    if c.qk_norm:  # the QK-norm keeps its inputs, q and k before it (jaxmem.model.lean)
        out += [("q, k before the QK-norm", (tags["query"] + tags["key"]) * cb, cd)]
    out += [("q, k, v after RoPE", (tags["query"] + tags["key"] + tags["value"]) * cb, cd),
            ("attention context [B,T,N,H]", tags["attn_context"] * cb, cd)]
    if not on_xla(attention):  # XLA: the probabilities are recomputed, nothing [B,N,T] kept
        out += [("softmax statistics [B,N,T] x2", 2 * B * c.num_heads * T * FP32, "float32")]
    out += [(GATED_MLP, 3 * B * T * F * cb, cd)]
    if c.norm_plus_one:  # (1 + w) of each norm's scale, fp32 (a few KiB a layer)
        out += [("norm scales (1 + w)", _norm_scales(c) * FP32, "float32")]
    if selects_rope(c):
        out += [("RoPE cos/sin of the layer's kind [B,T,R/2] x2",
                 2 * B * T * (c.rotary_dim // 2) * FP32, "float32")]
    return out


def decoder_residuals(c: ModelConfig, B: int, T: int, compute_dtype, remat: RematPolicy,
                      attention: str = "xla") -> list[tuple[str, int, str]]:
    """(what, bytes, dtype) of the residuals one decoder block keeps for its backward.

    none: the attention's and the MLP's inputs [B, T, D] (a pre-norm's output, or the residual
        stream where the block has none: OLMo 2), each norm's input [B, T, D] (its custom VJP
        recomputes the statistic, jaxmem.model.lean: a pre-norm's is the residual stream, a
        post-norm's o_proj's or down_proj's output); the QK-norm's inputs, q and k before it;
        q (after RoPE), k, v and the context [B, T, N, H]; on the XLA path nothing else (the
        probabilities are recomputed in the backward), cuDNN flash attention also two
        [B, N, T] softmax statistics; the gated MLP three [B, T, F] tensors (gate and up for
        its custom VJP, the product for down_proj); with (1 + w) norms (Gemma 3) each norm's
        fp32 scale; where the layer picks its RoPE tables by its kind (`selects_rope`), those.
    full: only the block input [B, T, D] (the scan carry).
    dots_no_batch: the block input, the q/k/v projections, the o_proj output (to rebuild the
        residual stream) and gate/up [B, T, F]; down_proj's output where the MLP's output is
        normed (Gemma 3, OLMo 2: the post-norm's input, a dot).
    dots: dots_no_batch plus, on the XLA path, attention's PV output (QK^T is recomputed with
        the probabilities: the custom VJP hides it from the policy), chunk-padded in a
        sliding-window layer (`_pv_output`).
    names:a,b / offload:a,b: the block input plus the tagged tensors the backward reads
        (`mlp_out` is only added to the residual stream, so it is never kept); offloaded
        tensors live in host memory and count zero here, the block input too when it is
        offloaded (tag `block_input`, in the default `offload`).
    """
    cb, cd = jnp.dtype(compute_dtype).itemsize, jnp.dtype(compute_dtype).name
    tags = tag_shapes(c, B, T)
    BTD, F = B * T * c.hidden_size, c.intermediate_size
    block_input = ("block input [B,T,D]", BTD * cb, cd)
    if remat.recomputes_all:
        return [block_input]
    if not remat.enabled:
        return _kept_without_remat(c, B, T, compute_dtype, attention)
    if remat.saves_dots:
        out = [block_input, ("o_proj output [B,T,D]", BTD * cb, cd),
               ("q, k, v projections", (tags["query"] + tags["key"] + tags["value"]) * cb, cd),
               ("gate, up [B,T,F] x2", 2 * B * T * F * cb, cd)]
        if remat.saves_batched_dots and on_xla(attention):
            pv, what = _pv_output(c, B, T)
            out += [(f"PV output {what}", pv * cb, cd)]
        if c.norms.after_mlp:  # the post-MLP norm's input is down_proj's output, a dot: kept
            out += [("down_proj output [B,T,D]", BTD * cb, cd)]
        return out
    # names / offload: the block input (unless offloaded) and the tags kept on the device
    # (an offloaded tag lives in host memory and counts zero here; a norm's tag the block has
    # no such norm for is never made)
    kept = [] if "block_input" in remat.offloaded_tags else [block_input]
    return kept + [(f"tag {t}", tags[t] * cb, cd) for t in remat.kept_tags
                   if t in tags and t not in ("mlp_out", "block_input")]
