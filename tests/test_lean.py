"""Lean backward passes (jaxmem.model.lean): the same values and gradients as autodiff of the
plain expressions, fewer saved residuals, and remat `names:` policies still meaning their tags."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.families import get_preset
from jaxmem.xla.residuals import available, saved_residual_bytes
from jaxmem.model.lean import rms_norm, rope, swiglu
from jaxmem.families.decoder import Decoder
from jaxmem.families.params import init_params
from jaxmem.model.remat import RematPolicy
from jaxmem.model.layers import rope_tables
from jaxmem.train.loss import synthetic_batch, token_loss
from numerics import assert_reordered_fp32


def _plain_rms(x, scale, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale).astype(x.dtype)


def _plain_rope(x, cos, sin):
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _check(f, plain, *args, argnums):
    y, vjp = jax.vjp(f, *args)
    y0, vjp0 = jax.vjp(plain, *args)
    d = jax.random.normal(jax.random.PRNGKey(9), y.shape)
    # the lean op and plain autodiff: two programs, another summation order (tests/numerics.py)
    assert_reordered_fp32(y, y0)
    got, ref = vjp(d), vjp0(d)
    assert_reordered_fp32([got[i] for i in argnums], [ref[i] for i in argnums])


@pytest.mark.slow  # 3.2 s cold on 2 cores (default run kept under 5 min)
def test_lean_ops_match_autodiff_fp32():
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    g, u = jax.random.normal(k[0], (2, 5, 12)) * 3, jax.random.normal(k[1], (2, 5, 12))
    _check(swiglu, lambda g, u: jax.nn.silu(g) * u, g, u, argnums=(0, 1))
    x, scale = jax.random.normal(k[2], (2, 5, 16)) * 2, 1 + jax.random.normal(k[3], (16,))
    _check(lambda x, s: rms_norm(x, s, 1e-5), lambda x, s: _plain_rms(x, s, 1e-5), x, scale,
           argnums=(0, 1))
    cos, sin = rope_tables(jnp.broadcast_to(jnp.arange(5), (2, 5)), 8, 10000.0)
    q = jax.random.normal(k[0], (2, 5, 3, 8))
    _check(lambda q: rope(q, cos, sin), lambda q: _plain_rope(q, cos, sin), q, argnums=(0,))


def _saved(remat: str):
    cfg = dataclasses.replace(get_preset("tiny", num_layers=2))
    model = Decoder(cfg, RematPolicy.parse(remat))
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    batch = synthetic_batch(jax.random.PRNGKey(0), 2, 16, cfg.vocab_size)
    return cfg, saved_residual_bytes(lambda p: token_loss(model, p, batch)[0], params)


@pytest.mark.skipif(not available(), reason="this jax has no saved_residuals")
def test_names_policies_keep_their_tags():
    """names:mlp_gate,mlp_up keeps exactly gate and up per layer on top of `full`."""
    cfg, full = _saved("full")
    _, gate_up = _saved("names:mlp_gate,mlp_up")
    B, T, F, L = 2, 16, cfg.intermediate_size, cfg.num_layers
    assert gate_up.bytes - full.bytes == L * 2 * B * T * F * 4
    _, hidden = _saved("names:mlp_hidden")
    assert hidden.bytes - full.bytes == L * B * T * F * 4


@pytest.mark.skipif(not available(), reason="this jax has no saved_residuals")
def test_swiglu_keeps_three_ffn_tensors_without_remat():
    """remat none: gate, up and the product (down_proj's input) per layer, not six."""
    cfg, none = _saved("none")
    B, T, D, F, L = 2, 16, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    _, with_names = _saved("names:mlp_gate,mlp_up,mlp_hidden")
    # `none` keeps at most the three FFN tensors plus the non-FFN residuals of the whole model
    assert none.bytes <= with_names.bytes + L * 8 * B * T * max(D, F) * 4
    assert none.bytes < L * 6 * B * T * F * 4 + L * 8 * B * T * D * 4


@pytest.mark.slow  # two gradient compiles: 13 s of CPU cold
def test_tiled_mlp_and_chunked_attention_under_full_remat(monkeypatch):
    """`full` remat with the MLP tiled and attention in query chunks (limits lowered so the tiny
    model takes both paths; 3 tiles of 7 for T=20, the last padded): the loss and every
    parameter's gradient equal the untiled `none` step in fp32."""
    from jaxmem.model import attention, tiled
    cfg = get_preset("tiny", num_layers=2)
    params = init_params(cfg, jax.random.PRNGKey(3))
    batch = synthetic_batch(jax.random.PRNGKey(4), 2, 20, cfg.vocab_size, pad_fraction=0.2)

    def grads(remat):
        model = Decoder(cfg, RematPolicy.parse(remat))
        return jax.jit(jax.value_and_grad(
            lambda p: token_loss(model, p, batch, loss_chunk=None)[0]))(params)

    v0, g0 = grads("none")
    monkeypatch.setattr(tiled, "TILE_BYTES", 2 * 7 * cfg.intermediate_size * 4)
    monkeypatch.setattr(tiled, "TILE_MIN_TOKENS_PER_WIDTH", 0)  # tiny: tiled anyway
    monkeypatch.setattr(attention, "ATTENTION_CHUNK_BYTES", 2 * cfg.num_heads * 20 * 4 * 7)
    assert tiled.mlp_tile(2, 20, cfg.intermediate_size) == 7
    v1, g1 = grads("full")
    assert_reordered_fp32((v1, g1), (v0, g0))  # tiled and chunked: another order


def test_full_untiled_keeps_the_mlp_whole(monkeypatch):
    """`--remat full+untiled` where `full` would tile (limits lowered so the tiny model tiles):
    the step's footprint and jaxpr have no MLP tiles, and the loss and gradients are bitwise
    those of `full` where tiling does not pay (the same untiled program)."""
    from jaxmem.model import tiled
    from jaxmem.model.precision import get_precision
    from jaxmem.config.run import OptimConfig
    from jaxmem.train import footprint, make_step_config
    cfg = get_preset("tiny", num_layers=2)
    params = init_params(cfg, jax.random.PRNGKey(3))
    batch = synthetic_batch(jax.random.PRNGKey(4), 2, 20, cfg.vocab_size, pad_fraction=0.2)

    def step(remat):
        model = Decoder(cfg, RematPolicy.parse(remat))
        f = jax.value_and_grad(lambda p: token_loss(model, p, batch, loss_chunk=None)[0])
        return f, jax.jit(f)(params)

    def mlp_tile(remat):
        step_cfg, _ = make_step_config(cfg, get_precision("fp32"), RematPolicy.parse(remat),
                                       OptimConfig(), 20)
        return footprint(step_cfg, 2, 20).mlp_tile

    monkeypatch.setattr(tiled, "TILE_BYTES", 2 * 7 * cfg.intermediate_size * 4)
    monkeypatch.setattr(tiled, "TILE_MIN_TOKENS_PER_WIDTH", 0)  # tiny: tiled anyway
    assert (mlp_tile("full"), mlp_tile("full+untiled")) == (7, 0)
    tiled_fn, _ = step("full")
    untiled_fn, got = step("full+untiled")
    scans = lambda f: str(jax.make_jaxpr(f)(params)).count("custom_vjp_call")  # noqa: E731
    assert scans(untiled_fn) < scans(tiled_fn)  # the tiled MLP's custom VJP is gone
    monkeypatch.setattr(tiled, "TILE_MIN_TOKENS_PER_WIDTH", 10**9)  # full: untiled too
    _, want = step("full")
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), got, want))
