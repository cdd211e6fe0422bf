"""Sliding-window (local) causal attention off cuDNN, memory linear in T (the "xla-window" path).

    windowed_attention(q, k, v, mask, segment_ids, window, chunk)

jaxmem.model.attention.causal_attention takes it for a window W where cuDNN does not apply (CPU,
fp32, a padding mask, packed rows) and picks the chunk (`attention.window_chunk`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmem.model.chunks import _chunk_attention, _from_chunks, _pad_rows, _query_chunks, _tied
from jaxmem.model.layers import segment_mask


def _window_keys(a, window, chunk, value=0, axis=1):
    """Key axis T of `a` -> W - 1 + n * Tq: W - 1 slots in front (the first chunk's window
    reaches before position 0) and the last chunk's padding at the end."""
    T = a.shape[axis]
    pad = [(0, 0)] * a.ndim
    pad[axis] = (window - 1, -(-T // chunk) * chunk - T)
    return jnp.pad(a, pad, constant_values=value)


def _window_chunk_mask(mask, seg, start, chunk, window):
    """[B|1, 1, Tq, Tq + W - 1] mask of query rows start..start+Tq-1 over keys
    start-W+1..start+Tq-1: causal AND inside the window AND not before position 0, AND the
    packed rows' `segment_mask`, AND the padding mask's entries there.

    mask: [B, 1, n * Tq, T] (rows padded: `_pad_rows`) or None; seg: [B, W - 1 + n * Tq]
    (`_window_keys`) or None. Padded rows (past T) are dropped by the caller."""
    span = chunk + window - 1
    q_pos = start + jnp.arange(chunk)  # [Tq]
    k_pos = start - (window - 1) + jnp.arange(span)  # [Tq + W - 1]
    d = q_pos[:, None] - k_pos[None, :]  # [Tq, Tq + W - 1]
    m = ((d >= 0) & (d < window) & (k_pos >= 0)[None, :])[None, None]  # [1, 1, Tq, Tq + W - 1]
    if seg is not None:
        seg_q = jax.lax.dynamic_slice_in_dim(seg, start + window - 1, chunk, axis=1)  # [B, Tq]
        seg_k = jax.lax.dynamic_slice_in_dim(seg, start, span, axis=1)  # [B, Tq + W - 1]
        m = m & segment_mask(seg_q, seg_k, q_pos, k_pos)  # [B, 1, Tq, Tq + W - 1]
    if mask is not None:
        rows = jax.lax.dynamic_slice_in_dim(mask, start, chunk, axis=2)  # [B, 1, Tq, T]
        rows = _window_keys(rows, window, chunk, True, axis=3)  # [B, 1, Tq, W - 1 + n * Tq]
        m = m & jax.lax.dynamic_slice_in_dim(rows, start, span, axis=3)
    return m


def _window_parts(q, k, v, mask, seg, window, chunk):
    """The scans' inputs: query chunks [n, B, Tq, N, H], their starts [n], k, v and ids with
    `_window_keys`' slots, the padding mask's rows padded to n * Tq."""
    qs = _query_chunks(q, chunk)
    starts = jnp.arange(qs.shape[0]) * chunk
    seg = None if seg is None else _window_keys(seg, window, chunk)
    return (qs, starts, _window_keys(k, window, chunk), _window_keys(v, window, chunk),
            _pad_rows(mask, chunk), seg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def windowed_attention(q, k, v, mask, segment_ids, window, chunk):
    """Causal attention of q [B, T, N, H] over k, v [B, T, K, H] where a query at position p
    sees keys p - W < k <= p only (window = W, a static int), within `mask` ([B, 1, T, T] or
    None) and its segment (`segment_ids` [B, T] or None) -> [B, T, N, H].

    Query chunk [s, s + Tq) (Tq = chunk, static) attends to keys [s - W + 1, s + Tq) only, sliced
    from k, v padded in front by W - 1: fp32 probabilities [B, N, Tq, Tq + W - 1] at a time,
    so forward and backward are linear in T. The backward recomputes them chunk by chunk from
    the residuals q, k, v, mask and ids (as `xla_attention_recomputed`)."""
    return _windowed_fwd(q, k, v, mask, segment_ids, window, chunk)[0]


def _windowed_fwd(q, k, v, mask, segment_ids, window, chunk):
    span = chunk + window - 1
    qs, starts, kp, vp, mp, sp = _window_parts(q, k, v, mask, segment_ids, window, chunk)

    def body(_, c):
        qc, start = _tied(c)  # [B, Tq, N, H], []
        kc = jax.lax.dynamic_slice_in_dim(kp, start, span, axis=1)  # [B, Tq + W - 1, K, H]
        vc = jax.lax.dynamic_slice_in_dim(vp, start, span, axis=1)
        return None, _chunk_attention(qc, kc, vc, _window_chunk_mask(mp, sp, start, chunk, window))

    out = _from_chunks(jax.lax.scan(body, None, (qs, starts))[1], q.shape[1])
    return out, (q, k, v, mask, segment_ids)


def _windowed_bwd(window, chunk, res, d_ctx):
    """(dq, dk, dv): one chunk's probabilities recomputed at a time; dk, dv summed in fp32 into
    the padded key slots the chunk read."""
    q, k, v, mask, seg = res
    span = chunk + window - 1
    qs, starts, kp, vp, mp, sp = _window_parts(q, k, v, mask, seg, window, chunk)
    ds = _query_chunks(d_ctx, chunk)

    def add(acc, start, d):
        here = jax.lax.dynamic_slice_in_dim(acc, start, span, axis=1)
        return jax.lax.dynamic_update_slice_in_dim(acc, here + d.astype(jnp.float32), start, 1)

    def body(acc, c):
        qc, start, dc = _tied(c)
        kc = jax.lax.dynamic_slice_in_dim(kp, start, span, axis=1)  # [B, Tq + W - 1, K, H]
        vc = jax.lax.dynamic_slice_in_dim(vp, start, span, axis=1)
        mc = _window_chunk_mask(mp, sp, start, chunk, window)
        _, vjp = jax.vjp(lambda qc, kc, vc: _chunk_attention(qc, kc, vc, mc), qc, kc, vc)
        dqc, dkc, dvc = vjp(dc)
        return (add(acc[0], start, dkc), add(acc[1], start, dvc)), dqc

    zeros = (jnp.zeros(kp.shape, jnp.float32), jnp.zeros(vp.shape, jnp.float32))
    (dk, dv), dqs = jax.lax.scan(body, zeros, (qs, starts, ds))
    T = q.shape[1]
    dk, dv = (d[:, window - 1:window - 1 + T] for d in (dk, dv))  # [B, T, K, H]
    return _from_chunks(dqs, T), dk.astype(k.dtype), dv.astype(v.dtype), None, None



windowed_attention.defvjp(_windowed_fwd, _windowed_bwd)
