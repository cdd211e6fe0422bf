"""Sliding-window (local) causal attention (`causal_attention(..., window=W)`): the query at p sees
keys p - W < k <= p. The windowed XLA path equals a dense reference built from that definition
(fp32: outputs within 1e-6, gradients within 1e-5) for windows below, at and above the query
chunk, T off the chunk, GQA, a padding mask and packed rows; window=None is today's call, bit for
bit; the windowed forward + backward's compiled temp is linear in T; context parallelism's
indexed attention takes the same window."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.model import attention
from jaxmem.model.context import slot_index
from jaxmem.model.layers import attention_mask
from jaxmem.model.window import windowed_attention

N, K, H = 4, 2, 8


def inputs(B, T, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (jax.random.normal(ks[0], (B, T, N, H)), jax.random.normal(ks[1], (B, T, K, H)),
            jax.random.normal(ks[2], (B, T, K, H)), jax.random.normal(ks[3], (B, T, N, H)))


def packed_ids(B, T):
    """[B, T]: row 0 three documents and padding, row 1 two documents, no padding."""
    a, b = T // 3, T // 2
    rows = [[1] * a + [2] * (b - a) + [3] * (T - b - 3) + [0] * 3, [1] * (T - a) + [2] * a]
    return jnp.asarray(rows[:B], jnp.int32)


def reference(q, k, v, window, mask=None, seg=None):
    """Softmax over a full [T, T] mask built from the definition: causal, p - k < W, the padding
    mask, and for packed rows the same segment with no padding key (a query always sees itself)."""
    T = q.shape[1]
    p, s = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    m = ((p >= s) & (p - s < window))[None, None]  # [1, 1, T, T]
    if seg is not None:
        same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)  # [B, T, T]
        m = m & (same | (p == s)[None])[:, None]
    if mask is not None:
        m = m & mask
    G = N // K
    kr, vr = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)  # [B, T, N, H]
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, kr, precision="highest") * H ** -0.5
    probs = jax.nn.softmax(jnp.where(m, logits, -jnp.inf), axis=-1)  # [B, N, T, T]
    return jnp.einsum("BNTS,BSNH->BTNH", probs, vr, precision="highest")


def value_and_grads(fn, q, k, v, d):
    """fn's output and the gradients of sum(out * d) in q, k, v."""
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(d)


def check(q, k, v, d, window, mask=None, seg=None):
    with jax.default_matmul_precision("highest"):
        got = jax.jit(lambda q, k, v, d: value_and_grads(
            lambda q, k, v: attention.causal_attention(q, k, v, mask, seg, window=window),
            q, k, v, d))(q, k, v, d)
        want = value_and_grads(lambda q, k, v: reference(q, k, v, window, mask, seg), q, k, v, d)
    np.testing.assert_allclose(got[0], want[0], atol=1e-6, rtol=1e-6)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T,window,chunk", [
    (48, 6, 16),    # W < chunk (chunk forced above W), T a multiple of the chunk
    (50, 6, 16),    # W < chunk, the last chunk padded
    (48, 20, 8),    # W > chunk (ATTENTION_CHUNK_BYTES), T a multiple of the chunk
    (45, 20, 8),    # W > chunk, the last chunk padded
    (40, 8, 8),     # W == chunk (the default pick where the budget allows)
    (37, 11, 11),   # W == chunk, T off the chunk
])
def test_window_equals_the_dense_reference(monkeypatch, T, window, chunk):
    """GQA (N=4 over K=2) and B=2 in every case; the chunk size is forced through the budget or,
    above W (which `window_chunk` never picks), by replacing `window_chunk`."""
    B = 2
    if chunk > window:
        monkeypatch.setattr(attention, "window_chunk", lambda shape, w: chunk)
    else:
        budget = B * N * 4 * chunk * (chunk + window - 1)  # [B, N, Tq, Tq + W - 1] fp32
        monkeypatch.setattr(attention, "ATTENTION_CHUNK_BYTES", budget)
    assert attention.window_chunk((B, T, N, H), window) == chunk
    check(*inputs(B, T), window)


def test_window_with_a_padding_mask(monkeypatch):
    B, T, W = 2, 29, 7
    monkeypatch.setattr(attention, "ATTENTION_CHUNK_BYTES", B * N * 4 * 5 * (5 + W - 1))  # Tq=5
    assert attention.window_chunk((B, T, N, H), W) == 5
    mask = attention_mask(jnp.arange(T)[None] < jnp.array([[T], [17]]), T)  # row 1: 12 pad keys
    check(*inputs(B, T, seed=1), W, mask=mask)


@pytest.mark.parametrize("chunk", [6, 32])
def test_window_within_packed_segments(monkeypatch, chunk):
    """Documents shorter and longer than the window; a chunk below and above it."""
    B, T, W = 2, 50, 9
    monkeypatch.setattr(attention, "window_chunk", lambda shape, w: chunk)
    check(*inputs(B, T, seed=2), W, seg=packed_ids(B, T))


def test_window_of_t_or_more_is_full_causal_attention():
    """W >= T: the reference equals full causal attention, and the call is the full causal one
    (the same program: bitwise)."""
    q, k, v, d = inputs(2, 24, seed=3)
    check(q, k, v, d, 24)
    check(q, k, v, d, 100)
    full = jax.jit(lambda q, k, v: attention.causal_attention(q, k, v, None))(q, k, v)
    for w in (24, 100):
        got = jax.jit(lambda q, k, v: attention.causal_attention(q, k, v, None, window=w))(q, k, v)
        np.testing.assert_array_equal(got, full)
    assert attention.attention_path(q.shape, k.shape, "float32", window=24).path == "xla"


def test_windowed_path_of_w_at_least_t_equals_the_reference(monkeypatch):
    """`windowed_attention` itself (not routed to full causal) with W = T - 1 and W > T."""
    B, T = 2, 21
    q, k, v, d = inputs(B, T, seed=4)
    for w in (T - 1, T + 5):
        with jax.default_matmul_precision("highest"):
            got = jax.jit(lambda q, k, v: value_and_grads(
                lambda q, k, v: windowed_attention(q, k, v, None, None, w, 8),
                q, k, v, d))(q, k, v)
            want = value_and_grads(lambda q, k, v: reference(q, k, v, w), q, k, v, d)
        np.testing.assert_allclose(got[0], want[0], atol=1e-6, rtol=1e-6)
        for g, x in zip(got[1], want[1]):
            np.testing.assert_allclose(g, x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T,padded,packed", [(16, False, False), (13, True, False),
                                             (20, False, True)])
def test_no_window_is_todays_call_bit_for_bit(T, padded, packed):
    """window=None: output and gradients equal the XLA path as it was (xla_attention_recomputed,
    what a CPU call took before the window existed), both jitted."""
    B = 2
    q, k, v, d = inputs(B, T, seed=5)
    mask = attention_mask(jnp.arange(T)[None] < jnp.array([[T], [T - 4]]), T) if padded else None
    seg = packed_ids(B, T) if packed else None
    run = lambda f: jax.jit(lambda q, k, v: value_and_grads(f, q, k, v, d))(q, k, v)  # noqa
    new = run(lambda q, k, v: attention.causal_attention(q, k, v, mask, seg, window=None))
    old = run(lambda q, k, v: attention.xla_attention_recomputed(q, k, v, mask, seg))
    jax.tree.map(np.testing.assert_array_equal, new, old)


def test_bad_windows_are_refused_by_name():
    q, k, v, _ = inputs(1, 8)
    for w in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="positive static int"):
            attention.causal_attention(q, k, v, None, window=w)
    with pytest.raises(ValueError, match="as many keys as queries"):
        attention.attention_path((1, 8, N, H), (1, 12, K, H), "float32", window=4)


def test_paths_with_a_window_on_a_simulated_gpu(monkeypatch):
    """cuDNN with its window for bf16 causal-only rows; the windowed XLA path for packed rows,
    a padding mask or fp32; the verdict cache keys on the window."""
    attention._cudnn_verdict.cache_clear()
    monkeypatch.setattr(attention, "_on_gpu", lambda: True)
    asked = []

    def cudnn(q, k, v, mask=None, window=None):
        asked.append(window)
        return jnp.zeros_like(q)

    monkeypatch.setattr(attention, "_cudnn_attention", cudnn)
    try:
        path = lambda **kw: attention.attention_path((1, 64, N, H), (1, 64, K, H),  # noqa
                                                     kw.pop("dtype", "bfloat16"), **kw)
        assert path(window=16) == attention.AttentionPath("cudnn")
        assert path() == attention.AttentionPath("cudnn")
        path(window=16)
        assert asked == [16, None]  # one verdict per window
        assert path(window=16, segments=True).path == "xla-window"
        assert path(window=16, causal_only=False).path == "xla-window"
        assert path(window=16, dtype="float32").path == "xla-window"
        assert path(window=64).path == "cudnn" and asked[-1] is None  # W >= T: no window
    finally:
        attention._cudnn_verdict.cache_clear()


@pytest.mark.parametrize("packed", [False, True])
def test_indexed_attention_takes_the_window(packed):
    """Context parallelism's attention on the balanced layout (slots permuted, masked by true
    index) with a window equals the dense reference with its rows permuted."""
    B, T, W = 2, 32, 5
    q, k, v, _ = inputs(B, T, seed=6)
    seg = packed_ids(B, T) if packed else None
    idx = slot_index(T, 2)
    perm = lambda x: jnp.take(x, idx, axis=1)  # noqa: E731
    s = None if seg is None else perm(seg)
    i = jnp.asarray(idx)
    with jax.default_matmul_precision("highest"):
        got = attention.indexed_attention(perm(q), perm(k), perm(v), i, i, s, s, W)
        want = perm(reference(q, k, v, W, seg=seg))
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
        g_got = jax.grad(lambda q: jnp.sum(jnp.sin(attention.indexed_attention(
            q, perm(k), perm(v), i, i, s, s, W))))(perm(q))
        g_want = perm(jax.grad(lambda q: jnp.sum(jnp.sin(reference(q, k, v, W, seg=seg))))(q))
    np.testing.assert_allclose(g_got, g_want, atol=1e-5, rtol=1e-5)


def test_windowed_attention_temp_is_linear_in_t():
    """jit(grad) of the windowed attention at T = 8W and 2T: XLA:CPU's temp at 2T at most 2.2x
    that at T (full causal attention, one chunk, would hold [T, T] probabilities: 4x)."""
    B, W = 1, 64

    def temp(t):
        q = jax.ShapeDtypeStruct((B, t, N, H), jnp.float32)
        kv = jax.ShapeDtypeStruct((B, t, K, H), jnp.float32)
        loss = lambda q, k, v: attention.causal_attention(q, k, v, None, window=W).sum()  # noqa
        assert attention.window_chunk(q.shape, W) == W  # 8 and 16 chunks
        c = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
        return c.memory_analysis().temp_size_in_bytes

    small, big = temp(8 * W), temp(16 * W)
    assert big <= 2.2 * small, f"temp {small} B at T={8 * W}, {big} B at T={16 * W}"
    print(f"windowed attention temp: {small} B at T={8 * W}, {big} B at T={16 * W}")
