"""Query-chunked XLA attention (jaxmem.model.attention.query_chunk) equals the one-shot path:
outputs and q/k/v gradients in fp32, causal-only and with a padding mask, T not divisible by
the chunk, grouped-query heads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxmem.model import attention
from jaxmem.model.layers import attention_mask
from numerics import assert_reordered_fp32


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.slow  # 2.9 s cold on 2 cores (default run kept under 5 min)
def test_chunked_attention_equals_unchunked(monkeypatch, padded):
    B, T, N, K, H = 2, 13, 4, 2, 8
    kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(kq, (B, T, N, H))
    k = jax.random.normal(kk, (B, T, K, H))
    v = jax.random.normal(kv, (B, T, K, H))
    d = jax.random.normal(kd, (B, T, N, H))
    mask = attention_mask(jnp.arange(T)[None] < jnp.array([[13], [9]]), T) if padded else None

    def run(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: attention.xla_attention_recomputed(q, k, v, mask),
                           q, k, v)
        return out, vjp(d)

    ref = run(q, k, v)
    # 5 query rows per chunk: 3 chunks, the last padded
    monkeypatch.setattr(attention, "ATTENTION_CHUNK_BYTES", B * N * T * 4 * 5)
    assert attention.query_chunk(q.shape, T) == 5
    got = jax.jit(run)(q, k, v)
    assert_reordered_fp32(got, ref)  # chunked (jitted) vs whole (eager): tests/numerics.py
