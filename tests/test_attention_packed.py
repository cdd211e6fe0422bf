"""Packed rows (segment ids) without a [T, T] mask: the GPU path (jax's Pallas flash kernel,
jaxmem.model.flash, run here in Pallas' interpreter) equals the dense masked reference and never
attends across documents; the CPU path (XLA in query chunks) stays linear in T with segment ids.
The H100 compile of the same claims: tests/test_gpu_target.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.model import attention, flash
from jaxmem.model.layers import segment_mask
from numerics import assert_reordered_fp32

B, T, N, K, H = 2, 128, 4, 2, 16


def inputs():
    kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(3), 4)
    q = jax.random.normal(kq, (B, T, N, H))
    k = jax.random.normal(kk, (B, T, K, H))
    v = jax.random.normal(kv, (B, T, K, H))
    d = jax.random.normal(kd, (B, T, N, H))
    # row 0: three documents (50, 40, 38 tokens); row 1: two (70, 30), then 28 of padding
    seg = np.zeros((B, T), np.int32)
    seg[0, :50], seg[0, 50:90], seg[0, 90:] = 1, 2, 3
    seg[1, :70], seg[1, 70:100] = 1, 2
    return q, k, v, d, jnp.asarray(seg)


def dense_reference(q, k, v, seg):
    """The [B, 1, T, T] segment mask, materialized: what the paths must equal."""
    idx = jnp.arange(T)
    return attention._chunk_attention(q, k, v, segment_mask(seg, seg, idx, idx))


def _loss(fn, d, real):
    """sum(out * d) over real (non-padding) queries: padding outputs are masked out of the loss."""
    return lambda q, k, v: jnp.sum(jnp.where(real[:, :, None, None], fn(q, k, v) * d, 0.0))


@pytest.mark.parametrize("path", ["pallas", "xla_chunked"])
def test_packed_output_and_gradients_equal_the_dense_masked_reference(monkeypatch, path):
    q, k, v, d, seg = inputs()
    real = seg != 0
    if path == "pallas":
        assert flash.pallas_unsupported(q.shape, k.shape) == ""
        fn = lambda q, k, v: flash.packed_flash_attention(q, k, v, seg, interpret=True)  # noqa
    else:  # 16 query rows per chunk: 8 chunks, the [B, 1, Tq, S] mask built per chunk
        monkeypatch.setattr(attention, "ATTENTION_CHUNK_BYTES", B * N * T * 4 * 16)
        assert attention.query_chunk((B, T, N), T) == 16
        fn = lambda q, k, v: attention.causal_attention(q, k, v, None, seg)  # noqa
    ref = lambda q, k, v: dense_reference(q, k, v, seg)  # noqa
    with jax.default_matmul_precision("highest"):
        got_out, want_out = fn(q, k, v), ref(q, k, v)
        got = jax.grad(_loss(fn, d, real), argnums=(0, 1, 2))(q, k, v)
        want = jax.grad(_loss(ref, d, real), argnums=(0, 1, 2))(q, k, v)
    keep = np.asarray(real)
    # another summation order (online softmax in blocks): tests/numerics.py's fp32 policy
    assert_reordered_fp32((np.asarray(got_out)[keep], got), (np.asarray(want_out)[keep], want))


def test_pallas_packed_rows_never_attend_across_documents():
    """Adding 1e6 to the keys' values of one document leaves every other real query's output
    bitwise unchanged, and changes that document's own outputs."""
    q, k, v, _, seg = inputs()
    f = jax.jit(lambda v: flash.packed_flash_attention(q, k, v, seg, interpret=True))
    base = np.asarray(f(v))
    for s in (1, 2, 3):
        bumped = np.asarray(f(jnp.where((seg == s)[:, :, None, None], v + 1e6, v)))
        keep = np.asarray((seg != s) & (seg != 0))
        np.testing.assert_array_equal(bumped[keep], base[keep])
        assert np.abs(bumped[np.asarray(seg == s)] - base[np.asarray(seg == s)]).max() > 1e3


def test_pallas_pads_a_length_off_its_block_with_padding_segments():
    """T=100 (not a multiple of the kernel's 128-row block): padded with segment 0, rows dropped."""
    q, k, v, d, seg = (a[:, :100] for a in inputs())
    real = seg != 0
    assert flash.pallas_unsupported(q.shape, k.shape) == ""
    fn = lambda q, k, v: flash.packed_flash_attention(q, k, v, seg, interpret=True)  # noqa
    idx = jnp.arange(100)
    ref = lambda q, k, v: attention._chunk_attention(  # noqa
        q, k, v, segment_mask(seg, seg, idx, idx))
    with jax.default_matmul_precision("highest"):
        got = jax.grad(_loss(fn, d, real), argnums=(0, 1, 2))(q, k, v)
        want = jax.grad(_loss(ref, d, real), argnums=(0, 1, 2))(q, k, v)
        out = fn(q, k, v)
    assert out.shape == q.shape
    assert_reordered_fp32((np.asarray(out)[np.asarray(real)], got),
                          (np.asarray(ref(q, k, v))[np.asarray(real)], want))
    assert "as many keys" in flash.pallas_unsupported((1, 100, 4, 16), (1, 128, 2, 16))


@pytest.mark.parametrize("packed", [False, True])
def test_cpu_chunked_attention_step_memory_is_linear_in_t(monkeypatch, packed):
    """forward + backward of causal_attention with a fixed chunk budget: XLA's temp at 2T is
    about 2x that at T (a [T, T] buffer would make it 4x)."""
    monkeypatch.setattr(attention, "ATTENTION_CHUNK_BYTES", 2**20)  # 1 MiB of probabilities

    def temp(t):
        q = jax.ShapeDtypeStruct((1, t, N, H), jnp.float32)
        kv = jax.ShapeDtypeStruct((1, t, K, H), jnp.float32)
        seg = jax.ShapeDtypeStruct((1, t), jnp.int32) if packed else None
        loss = lambda q, k, v, s: attention.causal_attention(q, k, v, None, s).sum()  # noqa
        c = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg).compile()
        return c.memory_analysis().temp_size_in_bytes

    small, big = temp(8192), temp(16384)
    assert big <= 2.2 * small, (small, big)
