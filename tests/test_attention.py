"""Which attention path runs, and that a cuDNN rejection falls back to XLA with one warning.

A GPU is simulated on CPU by monkeypatching `attention._on_gpu` and the cuDNN call itself.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.families.config import ModelConfig
from jaxmem.model import attention as attn
from jaxmem.families.decoder import Decoder
from jaxmem.families.params import init_params
from jaxmem.model.precision import cast_params, get_precision
from jaxmem.model.remat import RematPolicy

B, T, N, K, H = 2, 8, 4, 2, 16


def qkv(dtype=jnp.bfloat16):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    return (jax.random.normal(keys[0], (B, T, N, H)).astype(dtype),
            jax.random.normal(keys[1], (B, T, K, H)).astype(dtype),
            jax.random.normal(keys[2], (B, T, K, H)).astype(dtype))


@pytest.fixture
def fresh(monkeypatch):
    """Empty the per-shape verdict cache and the warned-reasons set before and after."""
    attn._cudnn_verdict.cache_clear()
    monkeypatch.setattr(attn, "_WARNED", set())
    yield monkeypatch
    attn._cudnn_verdict.cache_clear()


@pytest.mark.cpu_only(reason="on a GPU, bf16/fp16 inputs take cuDNN")
def test_cpu_takes_xla_and_says_why():
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        choice = attn.attention_path((B, T, N, H), (B, T, K, H), dtype)
        assert choice.path == "xla" and not choice.rejected
        assert "backend is cpu" in choice.reason


def test_rules_on_a_simulated_gpu(fresh):
    fresh.setattr(attn, "_on_gpu", lambda: True)
    calls = []

    def accepting(q, k, v):
        calls.append(q.shape)
        return jnp.zeros_like(q)

    fresh.setattr(attn, "_cudnn_attention", accepting)
    path = lambda dtype, causal=True: attn.attention_path((B, T, N, H), (B, T, K, H), dtype,  # noqa
                                                          causal_only=causal)
    assert path(jnp.float32) == attn.AttentionPath("xla", "float32 inputs (cuDNN takes bf16/fp16)")
    assert path(jnp.bfloat16, causal=False).path == "xla"
    assert path(jnp.bfloat16) == attn.AttentionPath("cudnn") == path(jnp.float16)
    path(jnp.bfloat16)
    assert calls == [(B, T, N, H)] * 2  # asked once per (shapes, dtype): bf16 and fp16


def test_cudnn_rejection_falls_back_to_xla_with_one_warning(fresh):
    fresh.setattr(attn, "_on_gpu", lambda: True)

    def rejecting(q, k, v):
        raise RuntimeError("cuDNN does not support head dim 16 here\n(more detail on line two)")

    fresh.setattr(attn, "_cudnn_attention", rejecting)
    q, k, v = qkv()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [attn.causal_attention(q, k, v, None) for _ in range(3)]
        jax.jit(attn.causal_attention, static_argnums=3)(q, k, v, None)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "falls back from cuDNN to XLA" in messages[0]
    assert "RuntimeError: cuDNN does not support head dim 16 here" in messages[0]
    assert "line two" not in messages[0]
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    for out in outs:
        np.testing.assert_array_equal(out, want)
    choice = attn.attention_path(q.shape, k.shape, q.dtype)
    assert choice.path == "xla" and choice.rejected


def test_planner_plans_for_the_path_taken(fresh):
    from jaxmem.memory.spec import StepSpec

    cfg = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=64)
    spec = StepSpec.of(cfg, get_precision("amp-bf16"), RematPolicy(), batch_size=2, seq_len=16)
    fresh.setattr(attn, "_on_gpu", lambda: False)  # a CPU, on a GPU machine too
    assert spec.attention_path == "xla"
    fresh.setattr(attn, "_on_gpu", lambda: True)
    fresh.setattr(attn, "_cudnn_attention", lambda q, k, v: q)
    assert spec.attention_path == "cudnn"
    assert StepSpec.of(cfg, get_precision("fp32"), RematPolicy(), 2, 16).attention_path == "xla"
    attn._cudnn_verdict.cache_clear()

    def rejecting(q, k, v):
        raise ValueError("unsupported")

    fresh.setattr(attn, "_cudnn_attention", rejecting)
    assert spec.attention_path == "xla"


@pytest.mark.slow  # 4.2 s cold on 2 cores (default run kept under 5 min)
def test_model_logits_on_the_fallback_equal_the_cpu_path(fresh):
    """The whole model through a rejected cuDNN call: same logits as the plain CPU run."""
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=16)
    params = cast_params(init_params(cfg, jax.random.PRNGKey(0)), jnp.bfloat16)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 8), 0, cfg.vocab_size)
    fresh.setattr(attn, "_on_gpu", lambda: False)  # the XLA path, on a GPU machine too
    want = Decoder(cfg).apply({"params": params}, tokens)
    fresh.setattr(attn, "_on_gpu", lambda: True)

    def rejecting(q, k, v):
        raise NotImplementedError("no cuDNN on this machine")

    fresh.setattr(attn, "_cudnn_attention", rejecting)
    with pytest.warns(UserWarning, match="no cuDNN on this machine"):
        got = Decoder(cfg).apply({"params": params}, tokens)
    np.testing.assert_array_equal(got, want)


def test_packed_rows_on_a_simulated_gpu_take_the_pallas_kernel(fresh):
    """Packed rows on a GPU: jax's Pallas flash kernel with the [B, T] ids (jaxmem.model.flash),
    no [B, 1, T, S] mask; unpacked rows still cuDNN."""
    fresh.setattr(attn, "_on_gpu", lambda: True)
    seen = []
    fresh.setattr(attn, "packed_flash_attention",
                  lambda q, k, v, seg: seen.append(seg.shape) or jnp.zeros_like(q))
    q, k, v = qkv()
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1, 1]], jnp.int32)
    assert attn.attention_path(q.shape, k.shape, q.dtype, segments=True).path == "pallas"
    attn.causal_attention(q, k, v, None, seg)
    assert seen == [(B, T)]


def test_packed_rows_without_pallas_give_cudnn_the_segment_mask(fresh):
    """Where the Pallas path does not apply: cuDNN is asked (once) with the [B, 1, T, S] segment
    mask and gets it in the call; where it rejects the mask, the XLA path runs the same segment
    mask, with one warning."""
    from jaxmem.model.layers import segment_mask

    fresh.setattr(attn, "_on_gpu", lambda: True)
    fresh.setattr(attn, "pallas_unsupported", lambda q_shape, kv_shape: "not here")
    seen = []

    def accepting(q, k, v, mask=None):
        seen.append(None if mask is None else (mask.shape, mask.dtype))
        return jnp.zeros_like(q)

    fresh.setattr(attn, "_cudnn_attention", accepting)
    q, k, v = qkv()
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1, 1]], jnp.int32)
    assert attn.attention_path(q.shape, k.shape, q.dtype, segments=True).path == "cudnn"
    attn.causal_attention(q, k, v, None, seg)
    assert seen == [((B, 1, T, T), jnp.bool_)] * 2  # the verdict's probe, then the call

    def rejecting(q, k, v, mask=None):
        if mask is not None:
            raise ValueError("bias not supported here")
        return jnp.zeros_like(q)

    attn._cudnn_verdict.cache_clear()
    fresh.setattr(attn, "_cudnn_attention", rejecting)
    with pytest.warns(UserWarning, match="cuDNN rejected packed bfloat16 inputs: ValueError: bias"):
        got = attn.causal_attention(q, k, v, None, seg)
    idx = jnp.arange(T)
    want = jax.nn.dot_product_attention(q, k, v, mask=segment_mask(seg, seg, idx, idx),
                                        implementation="xla")
    np.testing.assert_array_equal(got, want)
    assert attn.attention_path(q.shape, k.shape, q.dtype).path == "cudnn"  # unpacked: still cuDNN
