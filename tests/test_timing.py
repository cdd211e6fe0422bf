"""jaxmem.xla.timing: a program's time from its scheduled HLO text. Hand-written modules with
round numbers, so each figure is checked exactly: a GEMM's FLOPs and waves, an in-place
dynamic-update-slice's bytes, cuDNN attention's FLOPs, loop trip counts (XLA's and read from the
condition), and an async copy hidden by the compute scheduled under it, or not."""

import pytest

from jaxmem.xla.timing import Efficiency, Machine, step_time, trip_count
from jaxmem.xla.hlo import parse_hlo

# 1 PFLOP/s, 1 TB/s of HBM, a 10 GB/s host link, 4 SMs; every efficiency 1 and no launch cost,
# so a kernel's time is its FLOPs or bytes over the peak.
M = Machine("test", 1e15, 2e15, 1e12, 10e9, 100e9, 4)
E = Efficiency(gemm=1.0, attention=1.0, memory=1.0, launch_s=0.0, link=1.0, interconnect=1.0)


def module(body: str, extra: str = "") -> str:
    return f"HloModule m, is_scheduled=true\n\n{extra}\nENTRY %main () -> f32[] {{\n{body}\n}}\n"


GEMM = """
%gemm (p0: bf16[1024,512], p1: bf16[512,2048]) -> f32[1024,2048] {
  %p0 = bf16[1024,512]{1,0} parameter(0)
  %p1 = bf16[512,2048]{1,0} parameter(1)
  ROOT %d = f32[1024,2048]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_a_gemm_costs_its_flops_over_the_waves():
    """2 M N K FLOPs; 8 x 16 = 128 output tiles fill 32 waves of 4 SMs exactly. (HBM at 100
    TB/s: the 11.5 MB it moves take less than its FLOPs; at `M`'s 1 TB/s it is memory-bound.)"""
    text = module("""  %a = bf16[1024,512]{1,0} parameter(0)
  %b = bf16[512,2048]{1,0} parameter(1)
  ROOT %g = f32[1024,2048]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm""", GEMM)
    fast = Machine("fast", 1e15, 0, 1e14, 10e9, 0, 4)
    t = step_time(text, fast, E)
    (k,) = t.kernels
    assert k.klass == "gemm" and k.flops == 2 * 1024 * 2048 * 512
    assert k.bytes == 1024 * 512 * 2 + 512 * 2048 * 2 + 1024 * 2048 * 4
    assert t.seconds == pytest.approx(k.flops / 1e15)
    assert step_time(text, M, E).seconds == pytest.approx(k.bytes / 1e12)
    # 3 SMs: 128 tiles take 43 waves of 3, the last one 2/3 full
    t3 = step_time(text, Machine("t3", 1e15, 0, 1e14, 10e9, 0, 3), E)
    assert t3.seconds == pytest.approx(k.flops / 1e15 * (43 * 3) / 128)


@pytest.mark.parametrize("dtype, rate", [("bf16", 1.0), ("f32", 0.5), ("f8e4m3fn", 2.0)])
def test_a_gemm_runs_at_its_operands_rate(dtype, rate):
    """The same GEMM with bf16 operands at the bf16 peak, with f32 operands on TF32 tensor
    cores at half of it (jax's default f32 matmul precision on a GPU: the fused loss's
    backward head GEMMs ran so until jaxmem.loss.chunked._head_grads), with f8 at the fp8
    peak (`fast` has 2 PFLOP/s of it)."""
    gemm = GEMM.replace("bf16[", f"{dtype}[")
    text = module(f"""  %a = {dtype}[1024,512]{{1,0}} parameter(0)
  %b = {dtype}[512,2048]{{1,0}} parameter(1)
  ROOT %g = f32[1024,2048]{{1,0}} fusion(%a, %b), kind=kCustom, calls=%gemm""", gemm)
    fast = Machine("fast", 1e15, 2e15, 1e14, 10e9, 0, 4)
    (k,) = step_time(text, fast, E).kernels
    assert k.seconds == pytest.approx(2 * 1024 * 2048 * 512 / (1e15 * rate))


# a layer scan's in-place write of one [1, 1024] f32 row into its [64, 1024] stack
ROW_INTO_STACK = """
%dus (p0: f32[64,1024], p1: f32[1,1024], p2: s32[]) -> f32[64,1024] {
  %p0 = f32[64,1024]{1,0} parameter(0)
  %p1 = f32[1,1024]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %u = f32[64,1024]{1,0} dynamic-update-slice(%p0, %p1, %p2, %z)
}
"""


def test_in_place_update_counts_the_update_not_the_buffer():
    """A layer scan's write of one [1, 1024] f32 row into its [64, 1024] stack: the row is read
    and written (8 KiB), never the 256 KiB stack."""
    text = module("""  %s = f32[64,1024]{1,0} parameter(0)
  %r = f32[1,1024]{1,0} parameter(1)
  %i = s32[] parameter(2)
  ROOT %w = f32[64,1024]{1,0} fusion(%s, %r, %i), kind=kLoop, calls=%dus""", ROW_INTO_STACK)
    (k,) = step_time(text, M, E).kernels
    assert k.bytes == 4096 + 4 + 4096  # the row read, the index, the row written


def test_an_update_that_reads_the_slice_it_overwrites_is_in_place():
    """The in-backward step's 8-bit update of one piece of a device-resident [L, ...] stack: the
    fusion reads the old codes of its piece (a dynamic-slice of the stack) and writes the new ones
    at the same indices. XLA updates it in place: the piece read and written, not the stack read
    whole and written whole (on the 8B in-backward step at 1x2048, 1.9 s of 2.55 s predicted
    before, three [32, 14336, 4096] u8 stacks x 448 pieces). At other indices than the update's
    the stack counts whole."""
    def fusion(read_at):
        return module(f"""  %s = f32[64,1024]{{1,0}} parameter(0)
  %i = s32[] parameter(1)
  %j = s32[] parameter(2)
  ROOT %w = f32[64,1024]{{1,0}} fusion(%s, %i, %j), kind=kLoop, calls=%step""", f"""
%step (p0: f32[64,1024], p1: s32[], p2: s32[]) -> f32[64,1024] {{
  %p0 = f32[64,1024]{{1,0}} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %old = f32[1,1024]{{1,0}} dynamic-slice(%p0, %{read_at}, %z), dynamic_slice_sizes={{1,1024}}
  %two = f32[] constant(2)
  %b = f32[1,1024]{{1,0}} broadcast(%two), dimensions={{}}
  %new = f32[1,1024]{{1,0}} multiply(%old, %b)
  ROOT %u = f32[64,1024]{{1,0}} dynamic-update-slice(%p0, %new, %p1, %z)
}}
""")
    (k,) = step_time(fusion("p1"), M, E).kernels
    assert k.bytes == 4096 + 4 + 4 + 4096  # the old row read, two indices, the new row written
    (k,) = step_time(fusion("p2"), M, E).kernels
    assert k.bytes == 2 * 64 * 4096 + 8  # another row read: the stack read and written whole


def test_an_async_fusion_costs_its_fused_computation():
    """jax 0.11's XLA makes a layer scan's in-place write an async pair, `fusion-start` (its
    tuple holds the operands, the result and a context) and `fusion-done`: the same 8 KiB as the
    plain fusion above, not the start's tuple (two whole stacks) read as one unfused op. Seen
    on the 1B's 16x2048 step compiled by jax 0.11.2: 1.054 s predicted before, 0.540 after,
    as jax 0.10.2's program."""
    text = module("""  %s = f32[64,1024]{1,0} parameter(0)
  %r = f32[1,1024]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %f = ((f32[64,1024]{1,0}, f32[1,1024]{1,0}, s32[]), f32[64,1024]{1,0}, u32[]) fusion-start(%s, %r, %i), kind=kLoop, calls=%dus
  ROOT %w = f32[64,1024]{1,0} fusion-done(%f)""", ROW_INTO_STACK)
    (k,) = step_time(text, M, E).kernels
    assert k.klass == "fusion" and k.bytes == 4096 + 4 + 4096


def test_in_place_update_through_a_bitcast_counts_the_update():
    """XLA's dynamic-slice fusion (kCustom) writes a layer [16, 1024] into its stack [4, 16, 1024]
    seen as rows [64, 1024] through a bitcast (a view): the in-backward step's write of a
    layer's updated weights. The update is read and written; the 256 KiB stack is not (counted
    whole, it put 3.76 GB of phantom traffic per MLP weight and layer into the 8B's step)."""
    fused = """
%dus (p0: f32[16,1024], p1: s32[], p2: f32[4,16,1024]) -> f32[64,1024] {
  %p2 = f32[4,16,1024]{2,1,0} parameter(2)
  %v = f32[64,1024]{1,0} bitcast(%p2)
  %p0 = f32[16,1024]{1,0} parameter(0)
  %c = f32[16,1024]{1,0} copy(%p0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %u = f32[64,1024]{1,0} dynamic-update-slice(%v, %c, %p1, %z)
}
"""
    text = module("""  %r = f32[16,1024]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %s = f32[4,16,1024]{2,1,0} parameter(2)
  ROOT %w = f32[64,1024]{1,0} fusion(%r, %i, %s), kind=kCustom, calls=%dus""", fused)
    (k,) = step_time(text, M, E).kernels
    assert k.bytes == 65536 + 4 + 65536  # the layer read, the index, the layer written


def test_cudnn_attention_flops():
    """4 |q| S forward, halved by the causal mask; the backward 2.5 times that."""
    cfg = ('backend_config={"cudnn_fmha_backend_config": {"intermediate_tensor_shape": '
           '{"element_type": "BF16", "dimensions": ["2", "4", "128", "128"]}, '
           '"mask_type": "CAUSAL"}}')
    text = module(f"""  %q = bf16[2,128,4,64]{{3,2,1,0}} parameter(0)
  %k = bf16[2,128,4,64]{{3,2,1,0}} parameter(1)
  %f = (bf16[2,4,128,64]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%q, %k, %k), custom_call_target="__cudnn$fmhaSoftmax", {cfg}
  ROOT %b = (bf16[2,4,128,64]{{3,2,1,0}}, u8[0]{{0}}) custom-call(%q, %k, %k), custom_call_target="__cudnn$fmhaSoftmaxBackward", {cfg}""")
    fwd, bwd = step_time(text, M, E).kernels
    q = 2 * 128 * 4 * 64
    assert fwd.klass == bwd.klass == "attention"
    assert fwd.flops == 4 * q * 128 / 2 and bwd.flops == 2.5 * fwd.flops


LOOP = """
%body (t: (s32[], s32[])) -> (s32[], s32[]) {
  %t = (s32[], s32[]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] get-tuple-element(%t), index=1
  %a = f32[1000000]{0} parameter(1)
  %x = f32[1000000]{0} fusion(%a), kind=kLoop, calls=%neg
  ROOT %r = (s32[], s32[]) tuple(%i, %n)
}

%neg (p: f32[1000000]) -> f32[1000000] {
  %p = f32[1000000]{0} parameter(0)
  ROOT %o = f32[1000000]{0} negate(%p)
}

%lt (a: s32[], b: s32[]) -> pred[] {
  %a = s32[] parameter(0)
  %b = s32[] parameter(1)
  ROOT %c = pred[] compare(%a, %b), direction=LT
}

%cond (t: (s32[], s32[])) -> pred[] {
  %t = (s32[], s32[]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] get-tuple-element(%t), index=1
  ROOT %c = pred[] fusion(%i, %n), kind=kLoop, calls=%lt
}

%bound (ok: pred[]) -> s32[] {
  %ok = pred[] parameter(0)
  %k = s32[] constant(12)
  %zero = s32[] constant(0)
  ROOT %s = s32[] select(%ok, %k, %zero)
}
"""


@pytest.mark.parametrize("known", [True, False])
def test_loop_runs_its_trips(known):
    """A body of one 8 MB kernel run 12 times: XLA's known_trip_count, or, where XLA left none,
    `i < n` read from the condition with n the largest value the guard's select can take (the
    skipped-step guard runs the update loop N times or not at all)."""
    trip = ', backend_config={"known_trip_count":{"n":"12"}}' if known else ""
    text = module(f"""  %ok = pred[] parameter(0)
  %zero = s32[] constant(0)
  %n = s32[] fusion(%ok), kind=kLoop, calls=%bound
  %init = (s32[], s32[]) tuple(%zero, %n)
  ROOT %w = (s32[], s32[]) while(%init), condition=%cond, body=%body{trip}""", LOOP)
    t = step_time(text, M, E)
    neg = [k for k in t.kernels if k.name == "x"]
    assert neg[0].runs == 12 and not t.unknown_loops
    comps = parse_hlo(text)
    entry = comps["main"]["instrs"]
    assert trip_count(entry["w"], entry, comps) == 12
    # 12 trips of 8 MB, 13 tests of the condition (9 bytes), the bound's fusion once (5 bytes)
    assert t.seconds == pytest.approx((12 * 8e6 + 13 * 9 + 5) / 1e12, rel=1e-12)


COPY = """
%work (p: f32[4000000]) -> f32[4000000] {
  %p = f32[4000000]{0} parameter(0)
  ROOT %o = f32[4000000]{0} negate(%p)
}
"""


@pytest.mark.parametrize("between", [True, False])
def test_async_copy_hides_behind_the_compute_scheduled_under_it(between):
    """A 160 MB host-to-device copy (16 ms on a 10 GB/s link) and a 32 MB kernel (32 us): with
    the kernel between start and done the step is the copy's 16 ms; scheduled after the done,
    the two add up."""
    start = """  %s = (f32[40000000]{0:S(5)}, f32[40000000]{0}, u32[]) copy-start(%h)"""
    done = """  %d = f32[40000000]{0} copy-done(%s)"""
    work = """  %k = f32[4000000]{0} fusion(%a), kind=kLoop, calls=%work"""
    order = [start, work, done] if between else [start, done, work]
    text = module("\n".join(["  %h = f32[40000000]{0:S(5)} parameter(0)",
                             "  %a = f32[4000000]{0} parameter(1)", *order,
                             "  ROOT %t = (f32[40000000]{0}, f32[4000000]{0}) tuple(%d, %k)"]),
                  COPY)
    t = step_time(text, M, E)
    copy, kernel = 160e6 / 10e9, 32e6 / 1e12
    assert t.busy["host transfer"] == pytest.approx(copy)
    assert t.busy["fusion"] == pytest.approx(kernel)
    assert t.seconds == pytest.approx(copy if between else copy + kernel)
