"""Packed rows never attend across examples, and RoPE restarts per example (issue 20).

The exactness test: the loss and the gradients of a packed batch (`segment_ids`, `positions`)
equal those of each example run alone, summed over the same trained tokens, within 1e-5 in fp32,
on the one-shot XLA attention path, the query-chunked path (forced with a small threshold), the
fused loss, and under full remat. The attention test: a packed row's weights across segments are
exactly 0.

    python -m pytest -q tests/test_packing.py     # 8 passed
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.families.config import ModelConfig
from jaxmem.model import attention
from jaxmem.model.layers import segment_mask
from jaxmem.families.decoder import Decoder
from jaxmem.model.remat import RematPolicy
from jaxmem.train.loss import token_loss
from numerics import assert_reordered_fp32

CFG = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, max_position_embeddings=32)
T = 12
LENGTHS = (5, 7, 3)  # row 0: examples 1 and 2 (12 tokens), row 1: example 3 and 9 of padding


def examples():
    """Three examples: tokens [n + 1] and a loss mask [n] (the first target untrained, like a
    prompt's), from a fixed seed."""
    rng = np.random.default_rng(0)
    out = []
    for n in LENGTHS:
        toks = rng.integers(0, CFG.vocab_size, n + 1).astype(np.int32)
        mask = np.ones(n, np.int32)
        mask[0] = 0
        out.append((toks, mask))
    return out


def packed_batch():
    rows = [[0, 1], [2]]
    batch = {k: np.zeros((2, T), np.int32) for k in
             ("inputs", "targets", "mask", "segment_ids", "positions")}
    exs = examples()
    for r, idx in enumerate(rows):
        start = 0
        for seg, i in enumerate(idx, start=1):
            toks, mask = exs[i]
            n = len(mask)
            sl = slice(start, start + n)
            batch["inputs"][r, sl], batch["targets"][r, sl] = toks[:-1], toks[1:]
            batch["mask"][r, sl], batch["segment_ids"][r, sl] = mask, seg
            batch["positions"][r, sl] = np.arange(n)
            start += n
    return {k: jnp.asarray(v) for k, v in batch.items()}


@pytest.fixture(scope="module")
def params():
    return Decoder(CFG).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]


def loss_and_grads(model, params, batch, loss_chunk):
    """(sum of token losses, trained tokens, gradients of the sum)."""
    f = lambda p: token_loss(model, p, batch, loss_chunk=loss_chunk)  # noqa: E731
    (total, count), grads = jax.value_and_grad(f, has_aux=True)(params)
    return total, count, grads


def unpacked_reference(model, params, loss_chunk):
    """Each example alone ([1, n], no padding, positions 0..n-1), loss sums and grads summed."""
    total, count, grads = 0.0, 0.0, None
    for toks, mask in examples():
        b = {"inputs": jnp.asarray(toks[None, :-1]), "targets": jnp.asarray(toks[None, 1:]),
             "mask": jnp.asarray(mask[None])}
        t, c, g = loss_and_grads(model, params, b, loss_chunk)
        total, count = total + t, count + c
        grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    return total, count, grads


@pytest.fixture(scope="module")
def reference(params):
    """The examples one by one through the plain model and loss (computed once)."""
    with jax.default_matmul_precision("highest"):
        return unpacked_reference(Decoder(CFG), params, 0)


@pytest.mark.parametrize("path", ["xla", "chunked", "fused_loss", "full_remat"])
@pytest.mark.slow  # 14.1 s cold on 2 cores (default run kept under 5 min)
def test_packed_equals_each_example_alone(monkeypatch, params, reference, path):
    model = Decoder(CFG, RematPolicy("full") if path == "full_remat" else RematPolicy())
    loss_chunk = 5 if path == "fused_loss" else 0
    want = reference
    with jax.default_matmul_precision("highest"):
        if path == "chunked":  # 5 query rows per chunk: 3 chunks over T=12, the last padded
            monkeypatch.setattr(attention, "ATTENTION_CHUNK_BYTES", 2 * CFG.num_heads * T * 4 * 5)
            assert attention.query_chunk((2, T, CFG.num_heads), T) == 5
        got = jax.jit(lambda p, b: loss_and_grads(model, p, b, loss_chunk))(params,
                                                                           packed_batch())
    assert float(got[1]) == float(want[1]) == sum(LENGTHS) - len(LENGTHS)
    # one packed program vs one per example: another summation order (tests/numerics.py)
    assert_reordered_fp32((got[0], got[2]), (want[0], want[2]))


def test_without_segment_ids_examples_would_see_each_other(params):
    """Negative control: the same packed row without segment ids (causal only) gives another
    loss, so the test above can fail."""
    b = packed_batch()
    plain = {k: b[k] for k in ("inputs", "targets", "mask")}
    with jax.default_matmul_precision("highest"):
        packed = token_loss(Decoder(CFG), params, b, loss_chunk=0)[0]
        leaking = token_loss(Decoder(CFG), params, plain, loss_chunk=0)[0]
    assert abs(float(packed) - float(leaking)) > 1e-3


def test_token_loss_passes_segments_and_positions_to_the_model():
    """The packed keys reach Llama.__call__; without them the call is the old one (no kwargs)."""
    calls = []

    class Spy:
        config = CFG

        def apply(self, variables, tokens, **kw):
            calls.append(sorted(kw))
            return jnp.zeros(tokens.shape + (CFG.vocab_size,))

    b = packed_batch()
    token_loss(Spy(), {}, b, loss_chunk=0)
    token_loss(Spy(), {}, {k: b[k] for k in ("inputs", "targets", "mask")}, loss_chunk=0)
    assert calls == [["padding_mask", "positions", "segment_ids"], ["padding_mask"]]


@pytest.mark.parametrize("chunked", [False, True])
def test_attention_weights_across_segments_are_exactly_zero(monkeypatch, chunked):
    B, N, K, H = 2, 4, 2, 8
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(1), 3)
    q = jax.random.normal(kq, (B, T, N, H))
    k = jax.random.normal(kk, (B, T, K, H))
    v = jax.random.normal(kv, (B, T, K, H))
    seg = packed_batch()["segment_ids"]  # [B, T]
    idx = jnp.arange(T)
    mask = segment_mask(seg, seg, idx, idx)  # [B, 1, T, T]
    probs = np.asarray(attention.chunk_probabilities(q, k, mask))  # [B, K, G, T, S]
    other = np.asarray(seg[:, :, None] != seg[:, None, :])[:, None, None]  # [B, 1, 1, T, S]
    real_q = np.asarray(seg != 0)[:, None, None, :, None]
    assert np.all(probs[np.broadcast_to(other & real_q, probs.shape)] == 0.0)
    assert np.all(probs[np.broadcast_to(~np.asarray(mask)[:, :, None], probs.shape)] == 0.0)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)
    # Through causal_attention (one-shot jax.nn path, or query chunks): changing the values of
    # every other segment by 1e6 leaves each real query's output bitwise unchanged.
    if chunked:
        monkeypatch.setattr(attention, "ATTENTION_CHUNK_BYTES", B * N * T * 4 * 5)
    f = jax.jit(lambda v: attention.causal_attention(q, k, v, None, seg))
    base = np.asarray(f(v))
    for s in (1, 2):
        bumped = np.asarray(f(jnp.where((seg == s)[:, :, None, None], v + 1e6, v)))
        keep = np.asarray((seg != s) & (seg != 0))  # [B, T]
        np.testing.assert_array_equal(bumped[keep], base[keep])
        assert np.abs(bumped[np.asarray(seg == s)] - base[np.asarray(seg == s)]).max() > 1e3
