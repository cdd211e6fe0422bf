"""Query chunks of the XLA attention paths (jaxmem.model.attention, jaxmem.model.window).

    _query_chunks(q, Tq) / _from_chunks(a, T)   [B, T, ...] <-> [n, B, Tq, ...]
    _pad_rows(mask, Tq)                         a padding mask's rows padded to n * Tq
    _chunk_attention(q, k, v, mask)             one chunk's attention, fp32 logits and softmax
    chunk_probabilities(q, k, mask)             its fp32 probabilities
    _tied(c)                                    a scan step's slices behind one barrier
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _query_chunks(q, chunk):
    """q [B, T, N, H] -> [n, B, Tq, N, H] (zero-padded rows at the end)."""
    B, T = q.shape[:2]
    n = -(-T // chunk)
    q = jnp.pad(q, [(0, 0), (0, n * chunk - T), (0, 0), (0, 0)])
    return jnp.moveaxis(q.reshape(B, n, chunk, *q.shape[2:]), 1, 0)


def _pad_rows(mask, chunk):
    """[B, 1, T, S] -> [B, 1, n * Tq, S], padded rows True (they attend; they are dropped)."""
    if mask is None:
        return None
    T = mask.shape[2]
    pad = -(-T // chunk) * chunk - T
    return jnp.pad(mask, [(0, 0), (0, 0), (0, pad), (0, 0)], constant_values=True)


def _chunk_attention(q, k, v, mask):
    """Grouped-query attention of q [B, Tq, N, H] over k, v [B, S, K, H] with a boolean mask
    [B|1, 1, Tq, S], computed as jax.nn.dot_product_attention's XLA path does (fp32 logits and
    softmax, probabilities cast to v's dtype), with the mask applied as it is: passed to
    dot_product_attention it was broadcast to [B, K, G, Tq, S] and jax kept that per chunk
    (measured: a 512 MiB boolean stack at llama-3.2-1b, B=4, T=2048; why, below)."""
    B, Tq, N, H = q.shape
    probs = chunk_probabilities(q, k, mask).astype(v.dtype)  # [B, K, G, Tq, S]
    return jnp.einsum("BKGTS,BSKH->BTKGH", probs, v).reshape(B, Tq, N, H)


def chunk_probabilities(q, k, mask):
    """fp32 attention probabilities [B, K, G, Tq, S] of q [B, Tq, N, H] over k [B, S, K, H]."""
    B, Tq, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, Tq, K, N // K, H)  # [B, Tq, K, G, H]
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32)
    # An additive bias, not jnp.where: under the block's remat jax kept where's boolean
    # [B, K, G, Tq, S] for every chunk (measured: 512 MiB stacked); an add keeps nothing.
    # exp(-1e30 - max) is exactly 0 in fp32, so a masked key's weight is exactly 0.
    bias = jnp.where(mask, 0.0, -1e30).astype(jnp.float32)[:, :, None]  # [B|1, 1, 1, Tq, S]
    logits = logits * H ** -0.5 + bias
    return jax.nn.softmax(logits, axis=-1)  # [B, K, G, Tq, S]


def _from_chunks(a, T):
    """[n, B, Tq, ...] -> [B, T, ...]."""
    n, B, chunk = a.shape[:3]
    return jnp.moveaxis(a, 0, 1).reshape(B, n * chunk, *a.shape[3:])[:, :T]


def _tied(chunk):
    """A scan step's slices behind one optimization barrier, so that the chunk's mask is
    computed from the query chunk's own step: without it the H100 compiler precomputed every
    chunk's fp32 bias into one stacked [n, B, 1, 1, Tq, S] buffer ([T, T] in all: 1 GiB of a
    1.03 GiB temp at T=32,768, tiny model, context=8; seen in the buffer assignment)."""
    return jax.lax.optimization_barrier(chunk)

