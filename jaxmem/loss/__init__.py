"""Losses for language models that never hold [B, T, V] logits (public API: docs/api.md).

    fused_cross_entropy   the LM head + cross-entropy in chunks, for any [B, T, D] hidden states
    HeadLayout            which axis of the head is the vocabulary: "dv" [D, V] or "vd" [V, D]
    Reduction             "mean", or "sum" (the pair sum, count)

`chunked` is the kernel (internal: it may change); `fused` its checked public entry point.
"""

from jaxmem.loss.fused import HeadLayout, Reduction, fused_cross_entropy

__all__ = ["HeadLayout", "Reduction", "fused_cross_entropy"]
