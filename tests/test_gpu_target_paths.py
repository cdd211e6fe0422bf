"""The target decides the code path as the GPU does: jaxmem's traced program for `--target` equals
the one a run on the card traces.

What jaxmem chooses by backend (cuDNN attention or XLA's, the fp8 GEMM form, bf16 vs fp32
upcasts) is visible in the *lowered* program, before XLA optimizes it: the custom calls (cuDNN's
fused attention) and the operand dtypes of every dot_general. `traced_paths` reads both. The
`gpu` test compares a program lowered on the real GPU with the same program lowered in a child
process for the matching deviceless card (`--target`); the `gpu_target` test checks, on every
CI run, that the target's lowering takes the GPU's paths at all (cuDNN attention, bf16 dots,
f8 dots under fp8), so the comparison has something to compare. The optimized programs are not
compared: the real GPU autotunes GEMM backends (Triton or cuBLAS) and the deviceless compile
does not.
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys

import pytest

from testenv import ROOT, subprocess_env

_CALL = re.compile(r"custom_call @([\w$.]+)")
_DOT = re.compile(r"stablehlo\.dot_general [^\n]*?: \(tensor<(?:[\d?]+x)*(\w+)>, "
                  r"tensor<(?:[\d?]+x)*(\w+)>\)")
_F8 = re.compile(r"tensor<(?:[\d?]+x)*(f8\w+)>")
MODES = ("amp-bf16", "fp8")


def traced_paths(mode: str) -> dict:
    """{"custom_calls": {target: n}, "dots": {"lhs x rhs": n}, "f8": {dtype: n}} of the small
    2-layer train step of precision `mode` (T = 384, remat full), lowered for the current backend
    or target. jaxmem's fp8 traces quantize (a convert to f8) -> scaled dot, which XLA's GPU
    compiler rewrites into one f8 GEMM: so fp8 shows as f8 types, not as f8 dots."""
    from jaxmem.config.run import RunConfig
    from jaxmem.memory.spec import StepSpec
    from jaxmem.train.run import abstract_step_args
    from jaxmem.train.step import jit_train_step
    cfg = RunConfig().replace({"model.preset": "small", "model.num_layers": 2,
                               "precision.mode": mode, "remat.policy": "full",
                               "data.batch_size": 2, "data.seq_len": 384})
    step_cfg, loss_scale = StepSpec.from_run_config(cfg).step_config()
    text = jit_train_step(step_cfg).lower(*abstract_step_args(step_cfg, loss_scale, 2, 384,
                                                              1)).as_text()
    return {"custom_calls": dict(collections.Counter(_CALL.findall(text))),
            "dots": dict(collections.Counter(f"{a} x {b}" for a, b in _DOT.findall(text))),
            "f8": dict(collections.Counter(_F8.findall(text)))}


def target_paths(card: str) -> dict:
    """`traced_paths` for every mode, lowered for a deviceless `card` in a child process (the
    target needs JAX on the CPU platform from its start)."""
    code = ("import json, sys; sys.path.insert(0, 'tests'); from jaxmem import target; "
            "target.prepare(); import test_gpu_target_paths as t\n"
            f"with target.compiling_for({card!r}):\n"
            f"    print(json.dumps({{m: t.traced_paths(m) for m in {MODES!r}}}))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env=subprocess_env(cpu=True), timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.gpu_target
def test_the_target_traces_the_gpus_paths():
    paths = target_paths("h100")
    amp, fp8 = paths["amp-bf16"], paths["fp8"]
    assert amp["custom_calls"].get("__cudnn$fmhaSoftmax", 0) >= 1, amp
    # no fp32 upcast of a bf16 operand on a GPU (the CPU path's "f32 x bf16"); the fp32 dots
    # are the loss's
    assert amp["dots"].get("bf16 x bf16", 0) >= 28, amp["dots"]
    assert all(k in ("bf16 x bf16", "f32 x f32") for k in amp["dots"]), amp["dots"]
    assert not amp["f8"] and set(fp8["f8"]) == {"f8E4M3FN", "f8E5M2"}, fp8["f8"]


@pytest.mark.gpu
def test_the_gpu_traces_what_its_target_traced():
    import jax
    from jaxmem.target._cards import CARDS
    kind = jax.devices()[0].device_kind
    card = next((n for n, c in CARDS.items() if c.device_name == kind), None)
    if card is None:
        pytest.skip(f"no jaxmem.target card for this GPU ({kind!r})")
    on_gpu = {m: traced_paths(m) for m in MODES}
    assert on_gpu == target_paths(card)
