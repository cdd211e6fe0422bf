"""The fused LM head + cross-entropy (jaxmem.loss.chunked) equals the unfused loss.

fp32, value and gradients w.r.t. the hidden states, the head and (through the whole model) every
parameter, within tests/numerics.py's policy for two summation orders: vocab not divisible by
the chunk, a sequence not divisible by the chunk, padding, tied and untied heads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.families import get_preset
from jaxmem.families.decoder import Decoder
from jaxmem.families.params import init_params
from jaxmem.einsum import logits_einsum
from jaxmem.loss.chunked import chunked_cross_entropy as fused_cross_entropy, resolve_loss_chunk
from jaxmem.train.loss import cross_entropy, synthetic_batch, token_loss

from numerics import assert_reordered_fp32, model_terms


@pytest.mark.parametrize("layout", ["DV", "VD"])
@pytest.mark.parametrize("chunk", [1, 5, 16, 40])
@pytest.mark.slow  # 3.5 s cold on 2 cores (default run kept under 5 min)
def test_fused_equals_unfused_head_and_hidden(chunk, layout):
    """Direct: value, d(hidden), d(head); V=37 and T=16 not divisible by most chunks; padding."""
    B, T, D, V = 3, 16, 8, 37
    kx, kw, kt = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (B, T, D), jnp.float32)
    w = jax.random.normal(kw, (D, V), jnp.float32)
    targets = jax.random.randint(kt, (B, T), 0, V)
    weights = (jnp.arange(T)[None] < jnp.array([[16], [11], [3]])).astype(jnp.int32)  # padding

    def unfused(x, w):
        total, n = cross_entropy(logits_einsum("BTD,DV->BTV", x, w), targets, weights)
        return total / n

    def fused(x, w):  # "VD": the head passed as [V, D], as the tied embedding is
        total, n = fused_cross_entropy(x, w if layout == "DV" else w.T, targets, weights, chunk,
                                       layout=layout)
        return total / n

    v0, g0 = jax.value_and_grad(unfused, argnums=(0, 1))(x, w)
    v1, g1 = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(x, w)
    # the head's reduction (D) and the loss's (V, then the B x T mean) in another order
    assert_reordered_fp32((v1, g1), (v0, g0), terms=D + V + B * T)
    # padded positions get no gradient
    assert np.all(np.asarray(g1[0])[2, 3:] == 0)


@pytest.mark.parametrize("tied", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_fused_equals_unfused_whole_model(tied):
    """Through the whole model: loss and the gradient of every parameter, with padding."""
    cfg = dataclasses.replace(get_preset("tiny", num_layers=2), tie_embeddings=tied)
    model = Decoder(cfg)
    params = init_params(cfg, jax.random.PRNGKey(1))
    batch = synthetic_batch(jax.random.PRNGKey(2), 2, 24, cfg.vocab_size, pad_fraction=0.25)

    def loss(p, chunk):
        total, n = token_loss(model, p, batch, loss_chunk=chunk)
        return total / n

    # both jitted: an eager reference compiles each op of the model's backward alone (measured
    # 22 s of CPU with a cold compilation cache, most of this test's time)
    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    v0, g0 = grad(params, 0)
    v1, g1 = grad(params, 7)  # 24 = 3 x 7 + 3
    assert_reordered_fp32((v1, g1), (v0, g0), terms=model_terms(cfg, 24, loss=True, backward=True))
    assert ("lm_head" in params) == (not tied)


def test_fused_keeps_no_logits():
    """No [B, T, V]-sized residual is kept for the backward (jax's saved residuals)."""
    from jaxmem.xla.residuals import available, saved_residual_bytes
    if not available():
        pytest.skip("this jax has no saved_residuals")
    B, T, D, V = 2, 32, 8, 301
    x = jnp.zeros((B, T, D)); w = jnp.zeros((D, V))
    t = jnp.zeros((B, T), jnp.int32); m = jnp.ones((B, T), jnp.int32)
    res = saved_residual_bytes(lambda x, w: fused_cross_entropy(x, w, t, m, 8)[0], x, w)
    assert res.bytes < B * T * V * 4 / 4, res  # x (once) and the logsumexp [B, T]
    unfused = saved_residual_bytes(
        lambda x, w: cross_entropy(logits_einsum("BTD,DV->BTV", x, w), t, m)[0], x, w)
    assert unfused.bytes >= B * T * V * 4


def test_resolve_loss_chunk_rule():
    c = get_preset("llama-3.2-1b")
    assert resolve_loss_chunk(0, 4, 2048, c) == 0
    assert resolve_loss_chunk(100, 4, 64, c) == 64
    # auto: chunks of <= 256 MiB fp32 logits
    assert resolve_loss_chunk(None, 4, 2048, c) == 2**28 // (4 * c.vocab_size * 4)
    narrow = dataclasses.replace(c, vocab_size=c.hidden_size)  # head no wider than its input
    assert resolve_loss_chunk(None, 4, 2048, narrow) == 0
    tiny = get_preset("tiny")
    assert resolve_loss_chunk(None, 2, 64, tiny) == 64  # V=259 > D=128: one chunk


@pytest.mark.parametrize("vocab, limit_tokens, path", [
    pytest.param(37, 20, "sequence", marks=pytest.mark.slow), (40, 10, "vocab")])
@pytest.mark.slow  # 3.1 s cold on 2 cores (default run kept under 5 min)
def test_both_backward_paths(monkeypatch, vocab, limit_tokens, path):
    """The backward over vocabulary slices (V=40: 4 slices of 10) and over sequence chunks with
    a summed d(head) (V=37 is prime: no slice fits, `vocab_chunk` gives 0) both equal autodiff."""
    from jaxmem.loss import chunked as fused_loss
    B, T, D = 2, 12, 8
    monkeypatch.setattr(fused_loss, "AUTO_CHUNK_BYTES", B * T * 4 * limit_tokens)
    assert (fused_loss.vocab_chunk(vocab, B * T) > 0) == (path == "vocab")
    kx, kw, kt = jax.random.split(jax.random.PRNGKey(5), 3)
    x = jax.random.normal(kx, (B, T, D))
    w = jax.random.normal(kw, (D, vocab))
    targets = jax.random.randint(kt, (B, T), 0, vocab)
    weights = jnp.ones((B, T), jnp.int32).at[1, 7:].set(0)

    def unfused(x, w):
        return cross_entropy(logits_einsum("BTD,DV->BTV", x, w), targets, weights)[0]

    g0 = jax.grad(unfused, argnums=(0, 1))(x, w)
    g1 = jax.jit(jax.grad(lambda x, w: fused_cross_entropy(x, w, targets, weights, 5)[0],
                          argnums=(0, 1)))(x, w)
    assert_reordered_fp32(g1, g0, terms=D + vocab + B * T)
    g2 = jax.jit(jax.grad(lambda x, w: fused_cross_entropy(x, w.T, targets, weights, 5,
                                                           layout="VD")[0], argnums=(0, 1)))(x, w)
    assert_reordered_fp32(g2, g0, terms=D + vocab + B * T)


def test_loss_chunk_flag_validation():
    from jaxmem.errors import ConfigError
    from jaxmem.config.run import RunConfig
    from jaxmem.train.run import build_step_config
    assert build_step_config(RunConfig().replace({"remat.loss_chunk": 0}))[1].loss_chunk == 0
    assert build_step_config(RunConfig())[1].loss_chunk is None  # auto
    with pytest.raises(ConfigError, match="--loss-chunk"):
        RunConfig().replace({"remat.loss_chunk": -3})


@pytest.mark.slow  # two compiles of an 8192-token-vocabulary step: 11 s of CPU cold
@pytest.mark.parametrize("tied", [True, False])
def test_memory_model_and_compiled_step_know_the_fused_loss(monkeypatch, tied):
    """A big-vocabulary toy step with 1 MiB chunks (16 sequence positions, 1024-token vocabulary
    slices): XLA's compiled temp and the analytic peak both fall with the fused loss, and the
    analytic model names its residuals. (With one chunk and one slice, as the auto rule picks
    for this small step, the compiled temp was 14% higher: measured 34.2 vs 30.0 MB untied.)"""
    from jaxmem.memory import StepSpec, analytic_breakdown, compile_step
    from jaxmem.loss import chunked as fused_loss
    monkeypatch.setattr(fused_loss, "AUTO_CHUNK_BYTES", 2**20)
    from jaxmem.model.remat import RematPolicy
    from jaxmem.model.precision import get_precision
    cfg = dataclasses.replace(get_preset("tiny", num_layers=1, vocab_size=8192),
                              tie_embeddings=tied)
    specs = {c: StepSpec.of(cfg, get_precision("fp32"), RematPolicy.parse("full"), 2, 128,
                            attention="xla", loss_chunk=c) for c in (0, None)}
    temp = {c: compile_step(s)["temp_bytes"] for c, s in specs.items()}
    a = {c: analytic_breakdown(s) for c, s in specs.items()}
    logits = 2 * 128 * 8192 * 4
    assert temp[None] < temp[0] - logits, temp  # at least one [B, T, V] fp32 buffer less
    assert a[None]["total_bytes"] < a[0]["total_bytes"] - logits
    assert a[None]["transients"]["loss_chunk"] == 16
    names = [r["name"] for r in a[None]["saved_activations"]["outside_layers"]]
    assert any("logsumexp" in n for n in names) and not any("exp(logits" in n for n in names)
