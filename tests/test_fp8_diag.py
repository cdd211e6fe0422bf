"""experiments.fp8_diag: the fp8 train step's GEMMs on CPU, and the GPU-only parsing on texts.

The GPU half of the diagnosis (cuBLASLt fp8 calls in the optimized HLO, device kernels in a
profile) cannot run here; its parsers are checked on hand-written texts in the formats XLA's GPU
backend and jax.profiler write, so a GPU session gets numbers, not a crash.
"""

import gzip
import json

import pytest

from experiments import fp8_diag
from experiments.fp8_diag import lower_step
from experiments.fp8_hlo import fp8_dots, gemms, parse_hlo, top_kernels

MODEL_SUBSCRIPTS = {"BTD,DNH->BTNH", "BTD,DKH->BTKH", "BTNH,NHD->BTD", "BTD,DF->BTF",
                    "BTF,FD->BTD"}


@pytest.fixture(scope="module")
def tiny_fp8_step():
    """The tiny fp8 train step (remat full, 1 x 32), lowered for shapes only (no compile)."""
    _, _, lowered, traced = lower_step("tiny", "fp8", "full", 1, 32)
    return lowered, traced


def test_train_step_fp8_gemms_are_2d_dequantized_dots(tiny_fp8_step):
    """Every fp8 GEMM of the step (forward, remat recompute, dx, dw) is a plain 2-D dot with
    the contracting axis minor on both operands, and each operand is exactly
    multiply(convert(f8), broadcast(scale)): the pattern XLA's gemm rewriter replaces."""
    lowered, traced = tiny_fp8_step
    assert set(traced) == MODEL_SUBSCRIPTS
    # 7 projections a block; Flax's scan traces the block's body twice.
    assert sum(traced.values()) == 14 and traced["BTD,DKH->BTKH"] == 4
    comps = parse_hlo(lowered.as_text(dialect="hlo"))
    # Forward 7, remat recompute 6 (the block's last product, down_proj, only feeds the residual
    # add, which the backward does not need), backward 2 x 7: one scanned block's program text.
    assert fp8_dots(comps) == {"fp8_dots": 27, "fp8_dots_2d": 27}
    checked = 0
    for c in comps.values():
        instrs = c["instrs"]
        for dot in instrs.values():
            if dot["op"] != "dot":
                continue
            sides = [instrs[o] for o in dot["operands"]]
            if not all(s["op"] == "multiply" for s in sides):
                continue  # attention / LM head (bf16, f32)
            for side in sides:
                ops = sorted(instrs[o]["op"] for o in side["operands"])
                assert ops == ["broadcast", "convert"], ops
                convert = next(instrs[o] for o in side["operands"] if instrs[o]["op"] == "convert")
                assert instrs[convert["operands"][0]]["type"].startswith(("f8e4m3fn", "f8e5m2"))
                broadcast = next(instrs[o] for o in side["operands"]
                                 if instrs[o]["op"] == "broadcast")
                assert instrs[broadcast["operands"][0]]["type"].startswith("bf16[]")  # a scalar
            assert "lhs_batch_dims" not in dot["attrs"]
            assert "lhs_contracting_dims={1}" in dot["attrs"]
            assert "rhs_contracting_dims={1}" in dot["attrs"]
            assert dot["type"].startswith("bf16[")  # the GEMM writes bf16 itself
            checked += 1
    assert checked == 27


GPU_HLO = r"""HloModule jit_train_step, is_scheduled=true

%fused_dequant (param_0.1: f8e4m3fn[64,128]) -> bf16[64,128] {
  %param_0.1 = f8e4m3fn[64,128]{1,0} parameter(0)
  %convert.1 = bf16[64,128]{1,0} convert(%param_0.1)
  %constant.1 = bf16[] constant(0.5)
  %broadcast.1 = bf16[64,128]{1,0} broadcast(%constant.1), dimensions={}
  ROOT %multiply.1 = bf16[64,128]{1,0} multiply(%convert.1, %broadcast.1)
}

%gemm_fusion_dot.3_computation (param_0.3: f8e5m2[64,32], param_1.3: bf16[128,32]) -> bf16[64,128] {
  %param_0.3 = f8e5m2[64,32]{1,0} parameter(0)
  %convert.3 = bf16[64,32]{1,0} convert(%param_0.3)
  %param_1.3 = bf16[128,32]{1,0} parameter(1)
  ROOT %dot.3 = bf16[64,128]{1,0} dot(%convert.3, %param_1.3), lhs_contracting_dims={1}, rhs_contracting_dims={1}, metadata={op_name="jit(train_step)/transpose(jvp(Llama))/mlp/Projection_2/dot_general"}
}

%fused_plain (param_0.2: bf16[64,128]) -> bf16[64,128] {
  %param_0.2 = bf16[64,128]{1,0} parameter(0)
  ROOT %negate.2 = bf16[64,128]{1,0} negate(%param_0.2)
}

ENTRY %main (p0: f8e4m3fn[64,128], p1: f8e4m3fn[32,128], p2: f32[], p3: f32[], p4: bf16[64,128], p5: f8e5m2[64,32], p6: bf16[128,32]) -> bf16[64,32] {
  %p0 = f8e4m3fn[64,128]{1,0} parameter(0)
  %p1 = f8e4m3fn[32,128]{1,0} parameter(1)
  %p2 = f32[] parameter(2)
  %p3 = f32[] parameter(3)
  %p4 = bf16[64,128]{1,0} parameter(4)
  %p5 = f8e5m2[64,32]{1,0} parameter(5)
  %p6 = bf16[128,32]{1,0} parameter(6)
  %cublas-lt-matmul.1 = (bf16[64,32]{1,0}, s8[33554432]{0}) custom-call(%p0, %p1, %p2, %p3), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0}}
  %fusion.1 = bf16[64,128]{1,0} fusion(%p0), kind=kLoop, calls=%fused_dequant
  %cublas-lt-matmul.2 = (bf16[64,64]{1,0}, s8[4194304]{0}) custom-call(%fusion.1, %fusion.1), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(train_step)/jvp(Llama)/self_attn/Projection_0/dot_general"}
  %fusion.2 = bf16[64,128]{1,0} fusion(%p4), kind=kLoop, calls=%fused_plain
  %cublas-gemm.3 = (bf16[64,64]{1,0}, s8[4194304]{0}) custom-call(%fusion.2, %fusion.2), custom_call_target="__cublas$gemm"
  %gemm_fusion_dot.3 = bf16[64,128]{1,0} fusion(%p5, %p6), kind=kCustom, calls=%gemm_fusion_dot.3_computation
  ROOT %gte.1 = bf16[64,32]{1,0} get-tuple-element(%cublas-lt-matmul.1), index=0
}
"""


def test_gemms_of_an_optimized_gpu_module():
    found = gemms(parse_hlo(GPU_HLO))
    assert found["f8_gemm_custom_calls"] == 1
    rows = {(r["op"], r["fp8_intended"]): r for r in found["non_fp8_dots"]}
    assert set(rows) == {("__cublas$lt$matmul", True), ("__cublas$gemm", False), ("dot", False)}
    missed = rows[("__cublas$lt$matmul", True)]  # an fp8 dot the rewriter left as a bf16 GEMM
    assert missed["result"] == "bf16[64,64]" and missed["operands"] == ["bf16[64,128]"] * 2
    assert missed["where"] == "Projection_0/dot_general" and missed["count"] == 1
    # One operand dequantized fp8, the other bf16: a plain GEMM, not an fp8 one left behind.
    assert rows[("dot", False)]["where"] == "Projection_2/dot_general"


def test_top_kernels_from_a_device_trace(tmp_path):
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "tid": 1, "name": "PjitFunction(train_step)", "ts": 0, "dur": 9e6},
        {"ph": "X", "pid": 7, "tid": 2, "name": "sm90_xmma_gemm_e4m3e4m3", "ts": 0, "dur": 3000},
        {"ph": "X", "pid": 7, "tid": 2, "name": "loop_convert_fusion", "ts": 5, "dur": 500},
        {"ph": "X", "pid": 7, "tid": 2, "name": "sm90_xmma_gemm_e4m3e4m3", "ts": 9, "dur": 1000},
    ]
    run = tmp_path / "plugins" / "profile" / "2026_11_23"
    run.mkdir(parents=True)
    with gzip.open(run / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    rows, source, kinds = top_kernels(str(tmp_path), steps=2)
    assert source == "device kernels"
    assert rows == [["sm90_xmma_gemm_e4m3e4m3", 2.0], ["loop_convert_fusion", 0.25]]
    assert kinds == {"fp8 gemm": 2.0, "other": 0.25}
    assert top_kernels(str(tmp_path / "none"), steps=1)[0] is None


@pytest.mark.parametrize("argv, message", [
    (["--preset", "nope"], "--preset: invalid choice: 'nope'"),
    (["--batch-size", "0"], "--batch-size: expected a positive integer, got '0'"),
    (["--baseline", "fp9"], "--baseline: unknown precision 'fp9'"),
    (["--remat", "most"], "--remat:"),
])
def test_bad_flags_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        fp8_diag.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("fp8_diag: error: ") and message in err


@pytest.mark.slow
def test_cli_json_on_cpu(capsys):
    """The whole diagnosis at tiny size (compiles and runs the step: ~30 s on 2 busy cores)."""
    assert fp8_diag.main(["--json", "--baseline", "none", "--steps", "1", "--profile-steps", "1",
                          "--batch-size", "1", "--seq-len", "32"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["backend"] == "cpu" and report["fp8_einsums_traced"] == 14
    assert report["fp8_dots_lowered"] == report["fp8_dots_lowered_2d"] == 27
    assert report["f8_gemm_custom_calls"] is None
    assert "CUDA GPUs" in report["f8_gemm_custom_calls_reason"]
    assert report["step_ms"] > 0 and report["tokens_per_s"] > 0
    assert report["f8_converts_optimized"] > 0
    dots = sum(d["count"] for d in report["non_fp8_dots"])
    assert dots >= 27  # on CPU every dot stays a plain dot
    assert report["top_kernels"] and all(ms >= 0 for _, ms in report["top_kernels"])
    assert sum(report["kernel_ms_by_kind"].values()) >= report["top_kernels"][0][1]
