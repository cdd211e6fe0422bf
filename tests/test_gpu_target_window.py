"""Sliding-window attention on the H100's compiler (jaxmem.target, deviceless): causal-only bf16
rows take cuDNN's kernel with its window (the forward and backward custom calls carry
sliding_window_length = W); packed rows take the windowed XLA path, whose forward + backward
temp is linear in T and holds no [T, T] buffer."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jaxmem import target
from jaxmem.model import attention

pytestmark = pytest.mark.gpu_target

N, K, H, W = 32, 8, 128, 512  # llama-3.1-8b's heads, a Gemma-like window


@pytest.fixture(scope="module")
def h100():
    with target.compiling_for("h100") as t:
        yield t


def compile_windowed(t: int, packed: bool = False):
    q = jax.ShapeDtypeStruct((1, t, N, H), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, t, K, H), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, t), jnp.int32) if packed else None
    loss = lambda q, k, v, s: attention.causal_attention(  # noqa: E731
        q, k, v, None, s, window=W).astype(jnp.float32).sum()
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg).compile()


def square(hlo: str, t: int) -> list[str]:
    """Array types in the HLO with two axes of length t: a [T, T] buffer."""
    return sorted({a for a in re.findall(r"\b\w+\[[\d,]+\]", hlo)
                   if a.split("[")[1].rstrip("]").split(",").count(str(t)) >= 2})


def test_window_takes_cudnn_with_its_sliding_window(h100):
    t = 4096
    assert attention.attention_path((1, t, N, H), (1, t, K, H), "bfloat16",
                                    window=W).path == "cudnn"
    hlo = compile_windowed(t).as_text()
    calls = re.findall(r'custom_call_target="(__cudnn\$fmha\w+)"', hlo)
    assert sorted(calls) == ["__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"]
    assert re.findall(r'sliding_window_length\W+(\d+)', hlo) == [str(W)] * 2


def test_packed_window_takes_the_windowed_xla_path_linear_in_t(h100):
    assert attention.attention_path((1, 4096, N, H), (1, 4096, K, H), "bfloat16", segments=True,
                                    window=W).path == "xla-window"
    small, big = (compile_windowed(t, packed=True) for t in (4096, 8192))
    hlo = big.as_text()
    assert "__cudnn$fmha" not in hlo and square(hlo, 8192) == []
    a, b = (c.memory_analysis().temp_size_in_bytes for c in (small, big))
    assert b <= 2.2 * a, f"temp {a} B at T=4096, {b} B at T=8192"
