"""Attention by true sequence index, for a sequence split on the `context` mesh axis
(jaxmem.model.context): under context parallelism a device's query rows and the gathered keys sit
in permuted slots, so the causal mask (and a packed row's segments, a sliding window) comes from
each row's true index, not its slot. Query-chunked like jaxmem.model.attention's XLA path (one
chunk of fp32 probabilities at a time, memory linear in the keys), with a backward that
recomputes the probabilities chunk by chunk."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmem.model.chunks import _chunk_attention, _from_chunks, _query_chunks, _tied
from jaxmem.model.layers import segment_mask


def _index_chunk_mask(q_idx, k_idx, q_seg, k_seg, window=None):
    """[B|1, 1, Tq, S] mask from the rows' true sequence indices (not their slots: under context
    parallelism the slots are permuted), with `layers.segment_mask`'s semantics for packed rows
    and, given a window W, q_idx - k_idx < W."""
    if q_seg is None:
        m = (q_idx[:, None] >= k_idx[None, :])[None, None]  # [1, 1, Tq, S]
    else:
        m = segment_mask(q_seg, k_seg, q_idx, k_idx)  # [B, 1, Tq, S]
    if window is None:
        return m
    return m & (q_idx[:, None] - k_idx[None, :] < window)[None, None]


def _indexed_chunks(q, q_idx, q_seg, chunk):
    """q [B, T, N, H], q_idx [T], q_seg [B, T] | None -> per-chunk stacks (zero-padded)."""
    T = q.shape[1]
    pad = -(-T // chunk) * chunk - T
    idx = jnp.pad(q_idx, (0, pad), constant_values=-1).reshape(-1, chunk)  # [n, Tq]
    seg = None if q_seg is None else jnp.moveaxis(
        jnp.pad(q_seg, [(0, 0), (0, pad)]).reshape(q_seg.shape[0], -1, chunk), 1, 0)  # [n, B, Tq]
    return _query_chunks(q, chunk), idx, seg


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def attention_by_index(q, k, v, q_idx, k_idx, q_seg, k_seg, window, chunk):
    """Causal attention of q [B, T, N, H] over k, v [B, S, K, H] where row t of q sits at true
    sequence index q_idx[t] and key s at k_idx[s] (int [T], [S]); packed rows: q_seg [B, T],
    k_seg [B, S] (0 = padding; None: unpacked). In query chunks of `chunk` rows (one
    [B, N, Tq, S] chunk of fp32 probabilities at a time, memory linear in S; the caller,
    jaxmem.model.attention.indexed_attention, sizes it); the backward recomputes the
    probabilities chunk by chunk (the residuals are the inputs only).
    window: a static W or None; a window only masks here, each chunk still reads all S keys
    (memory linear in S, work quadratic, unlike `windowed_attention`)."""
    return _indexed_fwd(q, k, v, q_idx, k_idx, q_seg, k_seg, window, chunk)[0]


def _indexed_fwd(q, k, v, q_idx, k_idx, q_seg, k_seg, window, chunk):
    qs, idx, seg = _indexed_chunks(q, q_idx, q_seg, chunk)

    def body(_, c):
        qc, ic, sc = _tied(c)
        return None, _chunk_attention(qc, k, v, _index_chunk_mask(ic, k_idx, sc, k_seg, window))

    out = _from_chunks(jax.lax.scan(body, None, (qs, idx, seg))[1], q.shape[1])
    return out, (q, k, v, q_idx, k_idx, q_seg, k_seg)


def _indexed_bwd(window, chunk, res, d_ctx):
    q, k, v, q_idx, k_idx, q_seg, k_seg = res
    qs, idx, seg = _indexed_chunks(q, q_idx, q_seg, chunk)
    ds = _query_chunks(d_ctx, chunk)

    def body(acc, c):
        qc, ic, sc, dc = _tied(c)
        mc = _index_chunk_mask(ic, k_idx, sc, k_seg, window)
        _, vjp = jax.vjp(lambda qc, k, v: _chunk_attention(qc, k, v, mc), qc, k, v)
        dqc, dkc, dvc = vjp(dc)
        return (acc[0] + dkc.astype(jnp.float32), acc[1] + dvc.astype(jnp.float32)), dqc

    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    (dk, dv), dqs = jax.lax.scan(body, zeros, (qs, idx, seg, ds))
    return (_from_chunks(dqs, q.shape[1]), dk.astype(k.dtype), dv.astype(v.dtype),
            None, None, None, None)


attention_by_index.defvjp(_indexed_fwd, _indexed_bwd)
