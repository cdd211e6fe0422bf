"""experiments.fp8_diag: the fp8 train step's GEMMs on CPU, and the GPU-only parsing on texts.

The GPU half of the diagnosis (cuBLASLt fp8 calls in the optimized HLO, device kernels in a
profile) cannot run here; its parsers are checked on hand-written texts in the formats XLA's GPU
backend and jax.profiler write, so a GPU session gets numbers, not a crash.
"""

import gzip
import json

import pytest

from experiments.fp8_diag import driver as fp8_diag
from experiments.fp8_diag.driver import lower_step
from experiments.fp8_diag.hlo import fp8_dots, gemms, parse_hlo, top_kernels

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


STEP_HLO = r"""HloModule jit_train_step, is_scheduled=true

%max (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %m = f32[] maximum(%a, %b)
}

%fused_amax (param_0: bf16[64,128]) -> f32[] {
  %param_0 = bf16[64,128]{1,0} parameter(0)
  %abs.1 = bf16[64,128]{1,0} abs(%param_0)
  %convert.2 = f32[64,128]{1,0} convert(%abs.1)
  %zero = f32[] constant(0)
  ROOT %reduce.1 = f32[] reduce(%convert.2, %zero), dimensions={0,1}, to_apply=%max
}

%fused_quantize (param_0.1: bf16[64,128], param_1.1: f32[]) -> f8e4m3fn[64,128] {
  %param_0.1 = bf16[64,128]{1,0} parameter(0)
  %param_1.1 = f32[] parameter(1)
  %c = f32[64,128]{1,0} convert(%param_0.1)
  %b = f32[64,128]{1,0} broadcast(%param_1.1), dimensions={}
  %d = f32[64,128]{1,0} divide(%c, %b)
  ROOT %q = f8e4m3fn[64,128]{1,0} convert(%d)
}

%fused_dus (param_0.2: bf16[4,64,128], param_1.2: bf16[64,128], param_2.2: s32[]) -> bf16[4,64,128] {
  %param_0.2 = bf16[4,64,128]{2,1,0} parameter(0)
  %param_1.2 = bf16[64,128]{1,0} parameter(1)
  %neg = bf16[64,128]{1,0} negate(%param_1.2)
  %upd = bf16[1,64,128]{2,1,0} bitcast(%neg)
  %param_2.2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = bf16[4,64,128]{2,1,0} dynamic-update-slice(%param_0.2, %upd, %param_2.2, %z, %z)
}

%fused_ds (param_0.3: bf16[4,64,128], param_1.3: s32[]) -> bf16[64,128] {
  %param_0.3 = bf16[4,64,128]{2,1,0} parameter(0)
  %param_1.3 = s32[] parameter(1)
  %z.1 = s32[] constant(0)
  %ds = bf16[1,64,128]{2,1,0} dynamic-slice(%param_0.3, %param_1.3, %z.1, %z.1), dynamic_slice_sizes={1,64,128}
  ROOT %bc = bf16[64,128]{1,0} bitcast(%ds)
}

%gemm_fusion_dot_computation (parameter_0: bf16[64,128], parameter_1: bf16[32,128]) -> bf16[64,32] {
  %parameter_0 = bf16[64,128]{1,0} parameter(0)
  %parameter_1 = bf16[32,128]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,32]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%body (p: (s32[], bf16[4,64,128], bf16[64,128], f8e4m3fn[32,128])) -> (s32[], bf16[4,64,128], bf16[64,128], f8e4m3fn[32,128]) {
  %p = (s32[], bf16[4,64,128]{2,1,0}, bf16[64,128]{1,0}, f8e4m3fn[32,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %stack = bf16[4,64,128]{2,1,0} get-tuple-element(%p), index=1
  %x = bf16[64,128]{1,0} get-tuple-element(%p), index=2
  %w = f8e4m3fn[32,128]{1,0} get-tuple-element(%p), index=3
  %amax = f32[] fusion(%x), kind=kInput, calls=%fused_amax
  %xq = f8e4m3fn[64,128]{1,0} fusion(%x, %amax), kind=kLoop, calls=%fused_quantize
  %one = f32[] constant(1)
  %y = (bf16[64,32]{1,0}, s8[1024]{0}) custom-call(%xq, %w, %one, %one), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %new = bf16[4,64,128]{2,1,0} fusion(%stack, %x, %i), kind=kLoop, calls=%fused_dus
  %old = bf16[64,128]{1,0} fusion(%stack, %i), kind=kLoop, calls=%fused_ds
  %i1 = s32[] add(%i, %i)
  ROOT %t = (s32[], bf16[4,64,128]{2,1,0}, bf16[64,128]{1,0}, f8e4m3fn[32,128]{1,0}) tuple(%i1, %new, %old, %w)
}

%cond (pc: (s32[], bf16[4,64,128], bf16[64,128], f8e4m3fn[32,128])) -> pred[] {
  %pc = (s32[], bf16[4,64,128]{2,1,0}, bf16[64,128]{1,0}, f8e4m3fn[32,128]{1,0}) parameter(0)
  %ic = s32[] get-tuple-element(%pc), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%ic, %n), direction=LT
}

ENTRY %main (a: bf16[4,64,128], b: bf16[64,128], c: f8e4m3fn[32,128], d: bf16[32,128]) -> bf16[64,32] {
  %a = bf16[4,64,128]{2,1,0} parameter(0)
  %b = bf16[64,128]{1,0} parameter(1)
  %c = f8e4m3fn[32,128]{1,0} parameter(2)
  %d = bf16[32,128]{1,0} parameter(3)
  %zero.i = s32[] constant(0)
  %init = (s32[], bf16[4,64,128]{2,1,0}, bf16[64,128]{1,0}, f8e4m3fn[32,128]{1,0}) tuple(%zero.i, %a, %b, %c)
  %loop = (s32[], bf16[4,64,128]{2,1,0}, bf16[64,128]{1,0}, f8e4m3fn[32,128]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"},"known_init_step":{"init":"0","step":"1"}}
  %out = bf16[64,128]{1,0} get-tuple-element(%loop), index=2
  ROOT %g = bf16[64,32]{1,0} fusion(%out, %d), kind=kCustom, calls=%gemm_fusion_dot_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
}
"""


def test_step_table_sums_bytes_and_weights_loops():
    """The table of a hand-written module: a loop of 3 trips with an amax, a quantize, an fp8
    cuBLASLt GEMM, an in-place dynamic-update-slice and a dynamic-slice of a stacked buffer,
    then a bf16 Triton GEMM fusion outside the loop."""
    from experiments.fp8_diag.table import fusion_bytes, roofline_ms, step_table, type_bytes
    assert type_bytes("(bf16[64,32]{1,0}, f32[])") == 64 * 32 * 2 + 4
    assert type_bytes("f8e4m3fn[32,128]{1,0}") == 32 * 128
    t = step_table(STEP_HLO)
    assert t["unknown_trip_counts"] == []
    flop = 2 * 64 * 32 * 128 / 1e9
    assert t["gemms"] == {"cublasLt f8": {"count": 3, "gflop": round(3 * flop, 3)},
                          "triton bf16": {"count": 1, "gflop": round(flop, 3)}}
    x, stack = 64 * 128 * 2, 4 * 64 * 128 * 2
    amax = x + 4  # reads x, writes the scalar
    quantize = x + 4 + 64 * 128  # reads x and the scale, writes 1 byte an element
    dus = x + 4 + x  # in place: the buffer is not read; reads the update, writes one slice
    ds = x + 4 + x  # reads one slice of the stack, writes it
    assert t["fusions"] == {"count": 12, "bytes": 3 * (amax + quantize + dus + ds)}
    assert t["scaling"] == {"amax": {"count": 3, "bytes": 3 * amax},
                            "quantize": {"count": 3, "bytes": 3 * quantize}}
    # the body's add (3 trips) and the condition's compare (4 evaluations): 4 B ints, 1 B pred
    assert t["other_ops"] == {"count": 7, "bytes": 3 * 12 + 4 * 9}
    from experiments.fp8_diag.hlo import parse_hlo
    comps = parse_hlo(STEP_HLO)
    assert fusion_bytes(comps, "body", comps["body"]["instrs"]["new"]) == dus
    assert stack > dus  # the whole stack would have been counted without the in-place rule
    e = roofline_ms(t, {"f8": 2000.0, "bf16": 1000.0}, 1e12)
    assert e["gemm_ms"] == round((3 * flop / 2000 + flop / 1000) * 1e9 / 1e12 * 1e3, 3)
    assert e["non_gemm_ms"] == round((t["fusions"]["bytes"] + t["other_ops"]["bytes"]) / 1e9, 3)


def test_target_without_the_gpu_compiler_exits_2_with_one_line(monkeypatch, capsys):
    from jaxmem import target

    def missing():
        raise target.TargetError("--target needs XLA's GPU compiler, which is not installed: "
                                 "pip install x")
    monkeypatch.setattr(target, "check_installed", missing)
    with pytest.raises(SystemExit) as e:
        fp8_diag.main(["--target", "h100"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("fp8_diag: error: --target needs XLA's GPU compiler, which is not "
                       "installed: pip install x")
