"""Causal attention: cuDNN's fused flash attention where it applies, XLA's everywhere else.

    causal_attention(q, k, v, mask, segment_ids, window)   the path `attention_path` picks for
                                                           these shapes, dtype and window
    attention_path(q, kv, dtype, .., window)      which path a call takes and, if not cuDNN, why
    masked_attention(q, k, v, mask)                no custom VJP, any [B, 1, T, S] mask: decoding
                                                   against a KV cache (jaxmem.generate)

Packed rows (`segment_ids` [B, T]: 0 = padding, 1, 2, ... = the k-th example of the row) attend
causally within their own segment only: mask = causal AND seg_q == seg_kv AND seg_kv != 0
(`layers.segment_mask`). `jax.nn.dot_product_attention` takes no segment ids (jax 0.10.2 and
0.11), so every path gets that mask as a dense boolean: the XLA path builds it inside the custom
VJP from the [B, T] ids (the residual is the ids, never [B, T, T]), the query-chunked path one
[B, 1, Tq, S] chunk at a time, and the cuDNN path as the `mask` that jax turns into a dense
bias (cuDNN's packed layout, q/kv offsets, exists only in a private jax module; not used).
On GPUs packed rows take jax's Pallas flash kernel with segment ids instead (jaxmem.model.flash:
no [T, T] buffer, measured), where queries and keys are as many; the dense-mask cuDNN call is
the fallback otherwise (never in a training step).

Sliding-window (local) layers (Gemma 3, Mistral's `sliding_window`): `window` = W, a static int,
adds q - W < k to the mask (W keys, the query's own included; transformers'
`kv_idx > q_idx - sliding_window`). Where the window runs:
    GPU, bf16/fp16, no padding mask, no segment ids   cuDNN, `local_window_size=(W - 1, 0)`
    everything else (CPU, fp32, padding, packed rows)  "xla-window": `window.windowed_attention`,
        query chunks of Tq over their Tq + W - 1 keys only, so forward and backward are
        linear in T
    context parallelism (jaxmem.model.context)         `indexed_attention` with the window in
        its mask (correct, but each chunk still reads all T keys)
A window of T or more keys is no window: the call is the full causal one, program and all.

`jax.nn.dot_product_attention(implementation=None)` always takes the XLA path (jax 0.10), so the
cuDNN kernel is asked for explicitly, on a GPU, for bf16/fp16 inputs with the causal mask only.
Whether cuDNN accepts the shapes (head dim, GPU generation, cuDNN version, window) is asked once
per shape, dtype and window with `jax.eval_shape` on `ShapeDtypeStruct`s: the same trace-time
checks the real call makes, without computing anything. The memory planner asks the same
function, so it plans for the path the step actually takes. A rejection is not silent:
`causal_attention` warns once per reason, naming cuDNN's message.

The XLA paths compute logits and softmax in fp32 and recompute them in the backward pass
(`xla_attention_recomputed`, `windowed_attention`); the cuDNN kernel recomputes them itself.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxmem import target
from jaxmem.model.context import context_attention, context_mesh
from jaxmem.model.indexed import attention_by_index
from jaxmem.model.flash import packed_flash_attention, pallas_unsupported
from jaxmem.einsum import cpu_lacks
from jaxmem.model.chunks import (  # noqa: F401 (chunk_probabilities: public here before)
    _chunk_attention, _from_chunks, _pad_rows, _query_chunks, _tied, chunk_probabilities)
from jaxmem.model.layers import segment_mask
from jaxmem.model.window import windowed_attention


def _xla_attention(q, k, v, mask, segment_ids=None):
    """XLA's attention: logits and softmax in fp32, the [B, N, T, S] probabilities materialized
    (in query chunks of [B, N, Tq, S] when they are large: `query_chunk`)."""
    chunk = query_chunk(q.shape, k.shape[1])
    if chunk < q.shape[1]:
        return _chunked_attention(q, k, v, mask, segment_ids, chunk)
    if segment_ids is not None:
        idx = jnp.arange(q.shape[1])  # [T]
        packed = segment_mask(segment_ids, segment_ids, idx, idx)  # [B, 1, T, T]
        mask = packed if mask is None else mask & packed
    if mask is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return jax.nn.dot_product_attention(q, k, v, mask=mask)


@jax.custom_vjp
def xla_attention_recomputed(q, k, v, mask, segment_ids=None):
    """`_xla_attention` whose backward recomputes the probabilities instead of keeping them.

    Flash attention (cuDNN, PyTorch's SDPA) keeps only its inputs and output for the backward;
    this does the same on the XLA path: the residuals are q, k, v and the mask, nothing
    [B, N, T, S]. Without it every remat policy but `full` keeps the fp32 probabilities (and
    logits or their compute-dtype copy) of every layer: 512 MiB per layer for llama-3.2-1b at
    seq 2048. The price is one more QK^T, softmax and PV per layer in the backward
    (docs/remat.md measures both).

    A custom_vjp, not `jax.checkpoint(..., policy=nothing_saveable)`: nested inside a block's
    remat, an inner checkpoint's policy is overridden by the outer one, and `dots` then saved
    QK^T again (measured with saved_residuals). The backward below only ever sees the
    residuals its forward returns, whatever the enclosing policy.
    """
    return _xla_attention(q, k, v, mask, segment_ids)


def _xla_attention_fwd(q, k, v, mask, segment_ids=None):
    return _xla_attention(q, k, v, mask, segment_ids), (q, k, v, mask, segment_ids)


def _xla_attention_bwd(res, d_ctx):
    q, k, v, mask, seg = res
    chunk = query_chunk(q.shape, k.shape[1])
    if chunk < q.shape[1]:
        return (*_chunked_attention_bwd(q, k, v, mask, seg, d_ctx, chunk), None, None)
    _, vjp = jax.vjp(lambda q, k, v: _xla_attention(q, k, v, mask, seg), q, k, v)
    return (*vjp(d_ctx), None, None)  # the mask is boolean, the ids integers: no cotangents


# Above this many bytes of fp32 probabilities [B, N, T, S], attention runs in query chunks of
# [B, N, Tq, S] (each row's softmax is over all its keys, so a chunk is exact, no online softmax):
# the forward and the recomputing backward then hold one chunk's probabilities, not all of them.
ATTENTION_CHUNK_BYTES = 256 * 2**20


def query_chunk(q_shape, kv_len: int) -> int:
    """Query positions per attention chunk for q [B, T, N, H] over kv_len keys (T: one chunk)."""
    B, T, N = q_shape[:3]
    return max(1, min(T, ATTENTION_CHUNK_BYTES // (B * N * kv_len * 4)))


def _chunk_mask(mask, seg, start, chunk, S):
    """The [B|1, 1, Tq, S] mask of the query rows start..start+Tq, built inside the scan body
    (a stacked mask is broadcast by dot_product_attention to [n, B, K, G, Tq, S]: measured 512 MiB
    at llama-3.2-1b, B=4, T=2048). Padded rows (past T) attend causally and are dropped.
    seg: segment ids [B, n * Tq] (zero-padded by `_pad_ids`) or None."""
    pos = start + jnp.arange(chunk)  # [Tq]
    if seg is None:
        m = (pos[:, None] >= jnp.arange(S))[None, None]  # [1, 1, Tq, S]
    else:
        seg_q = jax.lax.dynamic_slice_in_dim(seg, start, chunk, axis=1)  # [B, Tq]
        m = segment_mask(seg_q, seg[:, :S], pos, jnp.arange(S))  # [B, 1, Tq, S]
    if mask is None:
        return m
    rows = jax.lax.dynamic_slice_in_dim(mask, start, chunk, axis=2)  # mask padded: _pad_rows
    return m & rows  # [B, 1, Tq, S]


def _pad_ids(seg, chunk):
    """[B, T] -> [B, n * Tq], padded with 0 (padding: the padded rows are dropped)."""
    if seg is None:
        return None
    T = seg.shape[1]
    return jnp.pad(seg, [(0, 0), (0, -(-T // chunk) * chunk - T)])


def masked_attention(q, k, v, mask):
    """q [B, T, N, H] over k, v [B, S, K, H] with a boolean mask [B|1, 1, T, S] -> [B, T, N, H].

    No custom VJP and no chunks: for decoding against a KV cache (T is the prompt or 1), where
    nothing is differentiated."""
    if cpu_lacks(q.dtype):
        q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
    return _chunk_attention(q, k, v, mask)


def _chunked_attention(q, k, v, mask, seg, chunk):
    """`_xla_attention` one query chunk at a time (a scan): [B, N, Tq, S] probabilities at once."""
    qs, mask, seg = _query_chunks(q, chunk), _pad_rows(mask, chunk), _pad_ids(seg, chunk)
    starts = jnp.arange(qs.shape[0]) * chunk

    def body(_, c):
        qc, start = _tied(c)  # [B, Tq, N, H], []
        return None, _chunk_attention(qc, k, v, _chunk_mask(mask, seg, start, chunk, k.shape[1]))

    return _from_chunks(jax.lax.scan(body, None, (qs, starts))[1], q.shape[1])


def _chunked_attention_bwd(q, k, v, mask, seg, d_ctx, chunk):
    """(dq, dk, dv), recomputing one query chunk's probabilities at a time; dk, dv summed in fp32."""
    qs, ds, mask = _query_chunks(q, chunk), _query_chunks(d_ctx, chunk), _pad_rows(mask, chunk)
    seg = _pad_ids(seg, chunk)
    starts = jnp.arange(qs.shape[0]) * chunk

    def body(acc, c):
        qc, start, dc = _tied(c)
        mc = _chunk_mask(mask, seg, start, chunk, k.shape[1])
        _, vjp = jax.vjp(lambda qc, k, v: _chunk_attention(qc, k, v, mc), qc, k, v)
        dqc, dkc, dvc = vjp(dc)
        return (acc[0] + dkc.astype(jnp.float32), acc[1] + dvc.astype(jnp.float32)), dqc

    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    (dk, dv), dqs = jax.lax.scan(body, zeros, (qs, starts, ds))
    return _from_chunks(dqs, q.shape[1]), dk.astype(k.dtype), dv.astype(v.dtype)


xla_attention_recomputed.defvjp(_xla_attention_fwd, _xla_attention_bwd)


# ---- sliding-window (local) causal attention: query chunks over their window's keys only ----

def effective_window(window, T: int, S: int) -> int | None:
    """The window `causal_attention` applies for T queries over S keys: None for no window, or
    for one of T keys or more (then every causal key is inside it)."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1:
        raise ValueError(f"the attention window must be a positive static int (the keys a query "
                         f"sees, its own included), got {window!r}")
    if S != T:
        raise ValueError(f"a sliding window needs as many keys as queries, got T={T}, S={S}")
    return None if window >= T else int(window)


def window_chunk(q_shape, window: int) -> int:
    """Query positions per chunk of `window.windowed_attention` for q [B, T, N, H]: W (a chunk then
    reads 2W - 1 keys, twice the window's work, as dense causal attention does twice causal's),
    fewer where one chunk's fp32 probabilities [B, N, Tq, Tq + W - 1] would pass
    ATTENTION_CHUNK_BYTES, at most T."""
    B, T, N = q_shape[:3]
    area = ATTENTION_CHUNK_BYTES // (B * N * 4)  # Tq * (Tq + W - 1) at most
    fit = (math.isqrt((window - 1) ** 2 + 4 * area) - (window - 1)) // 2
    return max(1, min(T, window, fit))




def _cudnn_attention(q, k, v, mask=None, window=None):
    """cuDNN flash attention, causal (raises at trace time for what cuDNN does not support).

    mask: the packed rows' [B, 1, T, S] boolean mask or None; jax hands it to cuDNN as a dense
    bias added to the causal kernel's logits (bf16/fp16 [B, 1, T, S]: 8 MiB per row at T=2048).
    window: W or None. `local_window_size=(W - 1, 0)` is jax's XLA mask p - (W - 1) <= k <= p;
    for cuDNN jax passes `sliding_window_length` = W - 1 + 1, the kernel's keys (p - W, p]: the
    same W keys (jax 0.10.2, nn/functions.py and cudnn/fused_attention_stablehlo.py)."""
    local = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                        local_window_size=local, implementation="cudnn")


def on_xla(path: str) -> bool:
    """Whether `path` (an AttentionPath's) is the plain XLA path, whose backward recomputes the
    probabilities and keeps no softmax statistics: what the planner asks of a path."""
    return path == "xla"


def _on_gpu() -> bool:
    """Compiling for a GPU: JAX's backend, or a `--target` card (jaxmem.target)."""
    return target.platform() == "gpu"


@dataclass(frozen=True)
class AttentionPath:
    """The attention implementation a call takes.

    path: "cudnn", "pallas" (packed rows on a GPU, jaxmem.model.flash), "xla" or "xla-window"
        (`windowed_attention`: a sliding window off cuDNN).
    reason: why not cuDNN ("" when cuDNN is taken).
    rejected: cuDNN was tried for these shapes and raised (a fallback worth a warning), as
        opposed to not applying at all (CPU, fp32, a padding mask).
    """

    path: str
    reason: str = ""
    rejected: bool = False


def attention_path(q_shape, kv_shape, dtype, causal_only: bool = True,
                   segments: bool = False, window: int | None = None) -> AttentionPath:
    """The path `causal_attention` takes for q [B, T, N, H], k and v [B, S, K, H] in `dtype`.

    causal_only: no padding mask is given (the cuDNN path here handles the causal mask only).
    segments: the rows are packed (segment ids given): Pallas' flash kernel with segment ids
        (no [T, T] mask) where it applies, else cuDNN with the segment mask as a dense bias.
    window: the sliding window W (`effective_window`): cuDNN's window where cuDNN applies and
        no segment ids are given, else "xla-window".
    """
    window = effective_window(window, q_shape[1], kv_shape[1])
    xla = "xla" if window is None else "xla-window"
    dtype = jnp.dtype(dtype)
    if not causal_only:
        return AttentionPath(xla, "a padding mask is given (the cuDNN path is causal-only)")
    if not _on_gpu():
        return AttentionPath(xla, f"the backend is {target.platform()}, not gpu")
    if dtype not in (jnp.bfloat16, jnp.float16):
        return AttentionPath(xla, f"{dtype.name} inputs (cuDNN takes bf16/fp16)")
    if segments and window is not None:
        return AttentionPath(xla, "packed rows with a window (Pallas' kernel has no window, "
                                  "cuDNN's window no segment ids)")
    if segments and not pallas_unsupported(q_shape, kv_shape):
        return AttentionPath("pallas")
    return _cudnn_verdict(tuple(q_shape), tuple(kv_shape), dtype.name, segments, window)


@functools.lru_cache(maxsize=None)
def _cudnn_verdict(q_shape: tuple, kv_shape: tuple, dtype_name: str,
                   segments: bool = False, window: int | None = None) -> AttentionPath:
    """Ask cuDNN, once per shape, dtype and window, whether it takes these inputs (nothing is
    computed)."""
    q = jax.ShapeDtypeStruct(q_shape, jnp.dtype(dtype_name))  # [B, T, N, H]
    kv = jax.ShapeDtypeStruct(kv_shape, jnp.dtype(dtype_name))  # [B, S, K, H]
    mask = (jax.ShapeDtypeStruct((q_shape[0], 1, q_shape[1], kv_shape[1]), jnp.bool_),) \
        if segments else ()  # [B, 1, T, S]
    what = "packed " if segments else ""
    where = "" if window is None else f" with a window of {window}"
    try:
        if window is None:
            jax.eval_shape(_cudnn_attention, q, kv, kv, *mask)
        else:
            jax.eval_shape(functools.partial(_cudnn_attention, window=window), q, kv, kv)
    except Exception as e:  # unsupported head dim / GPU generation / cuDNN version / the bias
        first_line = (str(e).strip().splitlines() or [""])[0]
        return AttentionPath("xla" if window is None else "xla-window",
                             f"cuDNN rejected {what}{dtype_name} inputs{where}: "
                             f"{type(e).__name__}: {first_line}", rejected=True)
    return AttentionPath("cudnn")


_WARNED: set[str] = set()


def causal_attention(q, k, v, mask, segment_ids=None, window: int | None = None):
    """Causal attention of q [B, T, N, H] with k, v [B, S, K, H] (GQA natively) -> [B, T, N, H].

    mask: [B, 1, T, S] boolean (`layers.attention_mask`) or None for the causal mask only.
    segment_ids: [B, T] int (0 = padding) for packed rows, or None: a query attends only to
        keys of its own segment (`layers.segment_mask`), on every path.
    window: sliding-window (local) attention, a static int W: the query at p sees keys
        p - W < k <= p only (needs S == T); None (or W >= T): full causal attention.
    """
    window = effective_window(window, q.shape[1], k.shape[1])
    if cpu_lacks(q.dtype):
        q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
    mesh = context_mesh()
    if mesh is not None:  # the sequence split over `context` (jaxmem.model.context)
        if mask is not None:
            raise ValueError("context parallelism takes no attention padding mask "
                             "(right padding or segment ids only)")
        return context_attention(q, k, v, segment_ids, mesh, indexed_attention, window)
    choice = attention_path(q.shape, k.shape, q.dtype, causal_only=mask is None,
                            segments=segment_ids is not None, window=window)
    if choice.path == "pallas":
        return packed_flash_attention(q, k, v, segment_ids)
    if choice.path == "cudnn":
        if segment_ids is None and window is None:
            return _cudnn_attention(q, k, v)
        if segment_ids is None:
            return _cudnn_attention(q, k, v, window=window)
        idx = jnp.arange(q.shape[1])  # [T]
        return _cudnn_attention(q, k, v, segment_mask(segment_ids, segment_ids, idx, idx))
    if choice.rejected and choice.reason not in _WARNED:
        _WARNED.add(choice.reason)
        warnings.warn(f"attention falls back from cuDNN to XLA (first seen for q {q.shape}, "
                      f"k/v {k.shape}): {choice.reason}", stacklevel=2)
    if window is not None:
        return windowed_attention(q, k, v, mask, segment_ids, window,
                                  window_chunk(q.shape, window))
    return xla_attention_recomputed(q, k, v, mask, segment_ids)


def indexed_attention(q, k, v, q_idx, k_idx, q_seg=None, k_seg=None, window=None):
    """Causal attention by true sequence index, for a sequence split on the `context` mesh axis
    (jaxmem.model.context): `jaxmem.model.indexed.attention_by_index` in query chunks of
    `query_chunk`'s size, as the other XLA paths."""
    return attention_by_index(q, k, v, q_idx, k_idx, q_seg, k_seg, window,
                              query_chunk(q.shape, k.shape[1]))
