"""Sliding-window attention on the H100's compiler (jaxmem.target, deviceless): causal-only bf16
rows take cuDNN's kernel with its window (the forward and backward custom calls carry
sliding_window_length = W); packed rows take the windowed XLA path, whose forward + backward
temp is linear in T and holds no [T, T] buffer."""

from __future__ import annotations

import re

import pytest

from jaxmem.model import attention

from test_gpu_target_packed import H, K, N, compile_attention, h100, square  # noqa: F401

pytestmark = pytest.mark.gpu_target

W = 512  # a Gemma-like window over llama-3.1-8b's heads


def compile_windowed(t: int, packed: bool = False):
    return compile_attention(t, packed, window=W)


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


GEMMA3 = {"model.family": "gemma3", "model.qk_norm": True, "model.norm_plus_one": True,
          "model.norm_placement": "sandwich", "model.mlp_activation": "gelu_tanh",
          "model.embed_scale": True, "model.query_pre_attn_scalar": 64,
          "model.sliding_window": 128, "model.rope_local_theta": 10000.0,
          "model.tie_embeddings": True, "model.num_layers": 2,
          "model.layer_types": ("sliding_attention", "full_attention")}


def gemma3_step(remat: str) -> dict:
    """The step of test_gpu_target.py's offload test (4 layers, 4 x 1024) on Gemma 3's layers."""
    from jaxmem.config.run import RunConfig
    from jaxmem.memory.compiled import compile_step
    from jaxmem.memory.spec import StepSpec
    cfg = RunConfig().replace({"model.preset": "small", "model.vocab_size": 32_000,
                               "precision.mode": "amp-bf16", "remat.policy": remat,
                               "remat.loss_chunk": 0, "data.batch_size": 4, "data.seq_len": 1024,
                               **GEMMA3, "model.num_layers": 4, "model.layer_types":
                               ("sliding_attention",) * 3 + ("full_attention",)})
    return compile_step(StepSpec.from_run_config(cfg))


def test_gemma3_step_runs_local_layers_on_cudnns_window(h100):
    """A Gemma 3 train step (a local and a global layer in one scan, a cond between their
    attentions) in the H100 program: cuDNN's kernel with the window (128) for the local
    layer, without one for the global layer, forward and backward."""
    from jaxmem.config.run import RunConfig
    from jaxmem.memory.spec import StepSpec
    from jaxmem.train.run import compile_run_step
    cfg = RunConfig().replace({"model.preset": "small", "model.vocab_size": 32_000,
                               "precision.mode": "amp-bf16", "remat.policy": "full",
                               "data.batch_size": 2, "data.seq_len": 1024, **GEMMA3})
    sp = StepSpec.from_run_config(cfg)
    step_cfg, loss_scale = sp.step_config()
    hlo = compile_run_step(step_cfg, loss_scale, 2, 1024, 1).as_text()
    calls = [ln for ln in hlo.splitlines() if "__cudnn$fmha" in ln and "custom-call(" in ln]
    windows = [m for ln in calls for m in re.findall(r'sliding_window_length\W+(\d+)', ln)]
    assert set(windows) == {"128", "0"}, windows  # the local layer's and the global one's


def test_gemma3_step_offloads_its_residuals_with_remat_offload(h100):
    """--remat offload on the Gemma 3 step: the saved residuals go to host memory and the
    device peak is below remat full's."""
    off, full = gemma3_step("offload"), gemma3_step("full")
    assert off["host_bytes"] > 0 and full["host_bytes"] == 0
    assert off["peak_bytes"] < full["peak_bytes"], (off["peak_bytes"], full["peak_bytes"])
