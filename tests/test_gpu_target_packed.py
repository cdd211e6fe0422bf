"""Packed rows on the H100's compiler (jaxmem.target, deviceless): jax's Pallas flash kernel with
segment ids (jaxmem.model.flash) instead of cuDNN with a dense [B, 1, T, T] mask. The optimized
HLO holds no [T, T] buffer, and the attention's forward + backward temp is linear in T."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jaxmem import target
from jaxmem.model import attention

pytestmark = pytest.mark.gpu_target

N, K, H = 32, 8, 128  # llama-3.1-8b's heads


@pytest.fixture(scope="module")
def h100():
    with target.compiling_for("h100") as t:
        yield t


def compile_attention(t: int, packed: bool = True, window: int | None = None):
    """jit(grad) of the attention of one [1, t] row (packed: with segment ids; window: a
    sliding window, tests/test_gpu_target_window.py), compiled for the target."""
    q = jax.ShapeDtypeStruct((1, t, N, H), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, t, K, H), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, t), jnp.int32) if packed else None
    loss = lambda q, k, v, s: attention.causal_attention(  # noqa: E731
        q, k, v, None, s, window=window).astype(jnp.float32).sum()
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg).compile()


def square(hlo: str, t: int) -> list[str]:
    """Array types in the HLO with two axes of length t: a [T, T] buffer."""
    return sorted({a for a in re.findall(r"\b\w+\[[\d,]+\]", hlo)
                   if a.split("[")[1].rstrip("]").split(",").count(str(t)) >= 2})


def test_packed_rows_take_the_pallas_kernel_and_hold_no_t_by_t_buffer(h100):
    t = 8192
    assert attention.attention_path((1, t, N, H), (1, t, K, H), "bfloat16",
                                    segments=True).path == "pallas"
    assert attention.attention_path((1, t, N, H), (1, t, K, H), "bfloat16").path == "cudnn"
    assert attention.attention_path((1, 8000, N, H), (1, 8000, K, H), "bfloat16",
                                    segments=True).path == "pallas"  # padded to 8064
    hlo = compile_attention(t).as_text()
    assert "__gpu$xla.gpu.triton" in hlo  # the Pallas kernels (forward, backward)
    assert "__cudnn$fmha" not in hlo
    assert square(hlo, t) == []


def test_packed_attention_temp_is_linear_in_t(h100):
    small, big = (compile_attention(t).memory_analysis().temp_size_in_bytes for t in (8192, 16384))
    assert big <= 2.2 * small, (small, big)


def test_packed_amp_bf16_train_step_holds_no_t_by_t_buffer(h100):
    """The whole train step (2 layers of width 512, remat full) on a packed batch at T=4096."""
    from jaxmem.config.run import RunConfig
    from jaxmem.memory.spec import StepSpec
    from jaxmem.train.run import compile_run_step
    t = 4096
    cfg = RunConfig().replace({
        "model.preset": "small", "model.num_layers": 2, "model.vocab_size": 3000,
        "model.max_position_embeddings": t,
        "precision.mode": "amp-bf16", "remat.policy": "full", "remat.loss_chunk": 512,
        "data.batch_size": 1, "data.seq_len": t})
    sp = StepSpec.from_run_config(cfg)
    step_cfg, loss_scale = sp.step_config()
    hlo = compile_run_step(step_cfg, loss_scale, 1, t, packed=True).as_text()
    assert "__gpu$xla.gpu.triton" in hlo and "__cudnn$fmha" not in hlo
    assert square(hlo, t) == []
