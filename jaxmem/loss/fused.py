"""`fused_cross_entropy`: the LM head and the cross-entropy in one call, for any model.

The kernel is jaxmem.loss.chunked (a custom VJP over sequence chunks, no [B, T, V] array in the
forward or the backward); this module is its public face: it checks the arguments, says which
axis of the head is the vocabulary (never guessed from the shape), picks the chunk and reduces.

The forward scans sequence chunks keeping only the logsumexp [B, T]; the backward (a custom VJP)
recomputes the logits a slice at a time, at the price of the head matmul once more.

References: Liger Kernel, `LigerFusedLinearCrossEntropyLoss` (Hsu et al. 2024,
arXiv:2410.10989); Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models"
(arXiv:2411.09009).
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from jaxmem.loss.chunked import AUTO_CHUNK_BYTES, chunked_cross_entropy
from jaxmem.einsum import logits_einsum


class HeadLayout(str, enum.Enum):
    """Which axis of the head is the vocabulary.

    DV: head [D, V], what `hidden @ head` multiplies (an untied LM head, a Linen `Dense` kernel).
    VD: head [V, D], the tied input embedding itself (`hidden @ head.T`); passing it as it is
        avoids a transposed copy of the head.
    """

    DV = "dv"
    VD = "vd"


class Reduction(str, enum.Enum):
    """What `fused_cross_entropy` returns.

    MEAN: sum(loss * weights) / sum(weights), fp32 [] (0 when every weight is 0).
    SUM: the pair (sum(loss * weights), sum(weights)), fp32 [] each: for losses averaged over
        several micro-batches or devices, divide the summed sums by the summed counts.
    """

    MEAN = "mean"
    SUM = "sum"


def _choice(enum_cls, value, arg: str):
    try:
        return enum_cls(value.lower() if isinstance(value, str) else value)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in enum_cls)
        raise ValueError(f"fused_cross_entropy: {arg} must be one of {valid}, got {value!r}") \
            from None


def _batch_shape(hidden, targets, weights) -> tuple[int, int, int]:
    """(B, T, D) of `hidden` [B, T, D], checked against targets and weights [B, T]."""
    if hidden.ndim != 3:
        raise ValueError(f"fused_cross_entropy: hidden must be [B, T, D], got shape "
                         f"{tuple(hidden.shape)}")
    B, T, D = hidden.shape
    if tuple(targets.shape) != (B, T):
        raise ValueError(f"fused_cross_entropy: targets must be [B, T] = {(B, T)}, got shape "
                         f"{tuple(targets.shape)}")
    if weights is not None and tuple(weights.shape) != (B, T):
        raise ValueError(f"fused_cross_entropy: weights must be [B, T] = {(B, T)}, got shape "
                         f"{tuple(weights.shape)}")
    return B, T, D


def _vocab_size(head, layout: HeadLayout, D: int) -> int:
    """V of the head: an array [D, V] / [V, D] by `layout`, or (DV) a weight object with
    `project` and a `shape` standing for a [D, V] array."""
    if isinstance(head, jax.Array) or hasattr(head, "ndim"):
        d_axis = 0 if layout is HeadLayout.DV else 1
        if head.ndim != 2 or head.shape[d_axis] != D:
            want = "[D, V]" if layout is HeadLayout.DV else "[V, D]"
            raise ValueError(f"fused_cross_entropy: head must be {want} with D = {D} "
                             f"(head_layout={layout.value!r}), got shape {tuple(head.shape)}")
        return head.shape[1 - d_axis]
    if layout is HeadLayout.DV and hasattr(head, "project") and hasattr(head, "shape"):
        return int(head.shape[-1])
    raise ValueError(f"fused_cross_entropy: head must be an array (or, with head_layout="
                     f"'dv', a weight object with project()), got {type(head).__name__}")


def _chunk_size(chunk: int | None, B: int, T: int, V: int) -> int:
    """The sequence chunk: as given (at most T), or the most positions whose fp32 logits
    [B, chunk, V] fit in AUTO_CHUNK_BYTES."""
    if chunk is None:
        chunk = max(1, min(T, AUTO_CHUNK_BYTES // (B * V * 4)))
    elif int(chunk) <= 0:
        raise ValueError(f"fused_cross_entropy: chunk must be positive, got {chunk}")
    return min(int(chunk), T)


def fused_cross_entropy(hidden: jax.Array, head, targets: jax.Array,
                        weights: jax.Array | None = None, chunk: int | None = None, *,
                        head_layout: HeadLayout | str = HeadLayout.DV,
                        reduction: Reduction | str = Reduction.MEAN, einsum=logits_einsum):
    """Cross-entropy of `hidden @ head` against `targets`, without ever holding the logits.

    Equal in value and gradients (w.r.t. `hidden` and `head`) to

        logits = jnp.einsum("BTD,DV->BTV", hidden, head)                 # [B, T, V]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # [B, T]
        mean = jnp.sum(loss * weights) / jnp.sum(weights)

    (fp32, highest matmul precision: within 1e-5), while the largest logits-shaped buffer is one
    chunk [B, chunk, V] forward and one [B, T, Vc] vocabulary slice (or [B, chunk, V]) backward.

    Args:
      hidden: [B, T, D] float (fp32, bf16 or fp16): the final hidden states (after the final
        norm). Logits are accumulated and reduced in fp32 whatever its dtype.
      head: the LM head, [D, V] with `head_layout="dv"` or [V, D] with `head_layout="vd"`, in any
        float dtype; or, with "dv", a jaxmem weight object with a `project` method (an NF4 /
        int8 `QuantizedWeight`, jaxmem.quant).
      targets: [B, T] int: the next-token ids, in [0, V).
      weights: [B, T] float or int, or None (every position weighs 1): the loss mask, 0 for
        padding. Fractional weights weigh each position's loss.
      chunk: sequence positions per chunk, or None: the most positions whose fp32 logits
        [B, chunk, V] fit in 256 MiB (jaxmem.loss.chunked.AUTO_CHUNK_BYTES). T need not be a
        multiple: the last chunk is padded with zero-weight positions.
      head_layout: `HeadLayout` or its string; stated, never guessed (D may equal V).
      reduction: `Reduction` or its string: "mean" (default) or "sum" (the pair sum, count).
      einsum: how to multiply, `einsum(subscripts, x, w)`; the default accumulates in fp32.

    Returns:
      "mean": fp32 [] the weighted mean token loss. "sum": (fp32 [] the weighted sum of token
      losses, fp32 [] the sum of the weights).

    Raises:
      ValueError naming the argument: a mismatched shape, chunk <= 0, an unknown head_layout or
      reduction.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem
      >>> h = jax.random.normal(jax.random.key(0), (2, 8, 16))          # [B, T, D]
      >>> emb = jax.random.normal(jax.random.key(1), (50, 16))          # tied [V, D]
      >>> t = jax.random.randint(jax.random.key(2), (2, 8), 0, 50)      # [B, T]
      >>> loss = jaxmem.loss.fused_cross_entropy(h, emb, t, chunk=4, head_layout="vd")
      >>> loss.shape, loss.dtype
      ((), dtype('float32'))
    """
    layout = _choice(HeadLayout, head_layout, "head_layout")
    how = _choice(Reduction, reduction, "reduction")
    B, T, D = _batch_shape(hidden, targets, weights)
    chunk = _chunk_size(chunk, B, T, _vocab_size(head, layout, D))
    if weights is None:
        weights = jnp.ones((B, T), jnp.float32)
    total, count = chunked_cross_entropy(hidden, head, targets, weights, chunk, einsum,
                                         layout.value.upper())
    if how is Reduction.SUM:
        return total, count
    # a batch of padding only gives 0, not 0/0 (whose NaN would reach the gradients too)
    return jnp.where(count > 0, total / jnp.where(count > 0, count, 1.0), 0.0)
