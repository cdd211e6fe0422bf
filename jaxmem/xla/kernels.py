"""One kernel of a compiled GPU program costed from its own HLO: the card's facts (`Machine`),
the share of them each kind of kernel reaches (`Efficiency`), and each kernel's class, FLOPs,
bytes and seconds (`kernel`, `transfer`). jaxmem.xla.timing runs a whole program's schedule
with these; its docstring says the model.
"""

from __future__ import annotations

import dataclasses
import math
import re

from jaxmem.xla.alu import elements, fused_cycles, kernel_name, tagged
from jaxmem.xla.collectives import data_bytes, group_size, kind_of, ring_bytes, wrapped_collective
from jaxmem.xla.hlo import attr, called, dims, direction, dtype, shape_bytes, tuple_elements



@dataclasses.dataclass(frozen=True)
class Machine:
    """The card's facts the time model reads (jaxmem.target.Card gives them): dense bf16 and fp8
    FLOP/s, HBM bytes/s, the host link's usable bytes/s each way, the interconnect's bytes/s per
    device each way (NVLink; 0: one card), and its SM count."""

    name: str
    flops: float
    fp8_flops: float
    hbm: float
    host_link: float
    interconnect: float
    sms: int
    lane_cycles: float = 0.0  # fp32 lanes x SMs x boost clock per second (0: not bounded)

    @classmethod
    def of_card(cls, card) -> "Machine":
        """The facts of a jaxmem.target.Card (read by its fields: this module imports no card
        list); the interconnect is NVLink where the card has it, else its PCIe link."""
        return cls(card.name, card.peak_tflops[0] * 1e12, card.peak_tflops[1] * 1e12,
                   card.bandwidth, card.host_link.bandwidth,
                   card.nvlink or card.host_link.bandwidth, card.sms,
                   card.sms * card.fp32_per_sm * card.clock_ghz * 1e9)


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """The share of a card's published peak each kind of kernel reaches; one set for all cards
    and programs, none fitted to a measured row.

    gemm 0.75: cuBLAS's large bf16 GEMMs on an H100 SXM reach 700-760 of 989 TFLOP/s in NVIDIA's
        and the community's published sweeps (0.71-0.77); smaller GEMMs lose more, which the
        wave term models instead of this constant.
    attention 0.45: cuDNN / FlashAttention-3 reach 550-650 TFLOP/s forward at head dim 128 on an
        H100 and well under that backward and at head dim 64 (FlashAttention-3's paper, Fig. 5-7:
        backward 40-50% of peak); the forward and backward together, at the head dims of these
        models, sit near 45%.
    memory 0.80: a streaming kernel reaches 80-90% of HBM's published bandwidth (STREAM-like
        copies on an H100: ~2.9 of 3.35 TB/s); fused elementwise and reduction kernels with
        several operands sit at the low end.
    launch_s 4e-6: the gap between two kernels of one stream without CUDA graphs (3-5 us in
        Nsight traces of XLA programs); it dominates thousands of small kernels.
    link 0.80: a pinned-memory DMA over PCIe reaches ~80% of the link's usable bandwidth once
        it runs beside kernels that share the memory system (NVIDIA's bandwidthTest reaches the
        usable figure alone).
    interconnect 0.80: NCCL's bus bandwidth of large ring collectives on NVLink 4 (nccl-tests:
        ~360 of 450 GB/s).
    """

    gemm: float = 0.75
    attention: float = 0.45
    memory: float = 0.80
    launch_s: float = 4e-6
    link: float = 0.80
    interconnect: float = 0.80


def _ints(text: str | None) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text or "")]


# An fp32 GEMM (both operands f32) runs on TF32 tensor cores: jax's default matmul precision
# on NVIDIA GPUs since Ampere (docs.jax.dev, "Matmul precision": float32 dots use TF32 on
# recent GPUs), at half the dense bf16 rate on every such card (A100 156 / 312, H100 SXM
# 495 / 989, RTX 4090 83 / 165 TFLOP/s): a card fact's ratio, not a fitted number.
TF32_RATE = 0.5


def _operand_kind(lhs: str, rhs: str) -> str:
    """The GEMM's rate class by its operands' dtypes: "fp8" (an f8 operand), "tf32" (both f32),
    else "bf16" (bf16 / fp16 tensor cores)."""
    if dtype(lhs).startswith("f8") or dtype(rhs).startswith("f8"):
        return "fp8"
    return "tf32" if dtype(lhs) == "f32" and dtype(rhs) == "f32" else "bf16"


def _operands(ins: dict, instrs: dict) -> tuple[str, str]:
    types = [instrs.get(o, {}).get("type", "") for o in ins["operands"][:2]]
    return tuple(types + [""] * (2 - len(types)))


def _dot_flops(ins: dict, instrs: dict) -> tuple[float, str]:
    """(FLOPs, rate class) of a dot: 2 x |result| x the lhs's contracted sizes."""
    lhs, rhs = _operands(ins, instrs)
    contracted = math.prod(dims(lhs)[i] for i in _ints(attr(ins["attrs"], "lhs_contracting_dims"))
                           if i < len(dims(lhs)))
    return 2.0 * math.prod(dims(ins["type"])) * contracted, _operand_kind(lhs, rhs)


def _gemm_call_flops(ins: dict, instrs: dict) -> tuple[float, str]:
    """A cuBLAS custom call's FLOPs from its backend_config's dot_dimension_numbers."""
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins["attrs"])
    lhs, rhs = _operands(ins, instrs)
    shape = dims(lhs)
    contracted = math.prod(shape[i] for i in _ints(m.group(1) if m else "") if i < len(shape))
    out = tuple_elements(ins["type"])[0]
    return 2.0 * math.prod(dims(out)) * contracted, _operand_kind(lhs, rhs)


def _attention_flops(ins: dict, instrs: dict) -> float:
    """cuDNN flash attention: 4 B N T S H forward (= 4 |q| S), x 2.5 backward, x 1/2 causal;
    S is the last of the score matrix's dimensions (`intermediate_tensor_shape`: B N T S)."""
    m = re.search(r'"intermediate_tensor_shape":\s*\{[^}]*?"dimensions":\s*\[([^\]]*)\]',
                  ins["attrs"])
    s = _ints(m.group(1))[-1] if m and _ints(m.group(1)) else 0
    q = dims(instrs.get(ins["operands"][0], {}).get("type", "")) if ins["operands"] else []
    flops = 4.0 * math.prod(q) * s if q else 0.0
    flops *= 2.5 if "Backward" in (attr(ins["attrs"], "custom_call_target") or "") else 1
    return flops / 2 if re.search(r'"mask_type":\s*"CAUSAL"', ins["attrs"]) else flops


def _fused_bytes(ins: dict, instrs: dict, fused: dict | None) -> float:
    """Device bytes a fusion reads and writes: an operand read only through dynamic-slices
    counts their slices, the buffer of an in-place dynamic-update-slice counts nothing and the
    result then only the update. `fused` None (an unfused op): its operands and result whole."""
    types = [instrs.get(o, {}).get("type", "") for o in ins["operands"]]
    if fused is None:
        return sum(shape_bytes(t) for t in types) + shape_bytes(ins["type"])
    body = fused["instrs"]
    params = {name: int(i["operands"][0]) if i["operands"] else 0  # parameter(N): operand N
              for name, i in body.items() if i["op"] == "parameter"}
    users: dict[str, list] = {n: [] for n in body}
    for name, i in body.items():
        for pos, o in enumerate(i["operands"]):
            if o in users:
                users[o].append((name, pos))

    def uses_of(name):  # (instruction, operand position), seen through bitcasts (views)
        out = []
        for u, pos in users[name]:
            out += uses_of(u) if body[u]["op"] == "bitcast" else [(body[u], pos)]
        return out

    read = 0.0
    in_place_update = 0.0
    for pname, index in params.items():
        full = shape_bytes(types[index]) if index < len(types) else shape_bytes(body[pname]["type"])
        uses = uses_of(pname)
        sliced = [u for u, pos in uses if u["op"] in ("dynamic-slice", "slice", "gather")
                  and pos == 0]
        updated = [u for u, pos in uses if u["op"] == "dynamic-update-slice" and pos == 0]
        starts = {tuple(u["operands"][2:]) for u in updated}  # the updates' indices
        # updated in place (the buffer is the result's) even where the fusion also reads the old
        # slice it overwrites: XLA's in-place emitter allows a dynamic-slice of the updated
        # operand at the update's own indices
        reads_other_slices = updated and any(
            u["op"] != "dynamic-slice" or tuple(u["operands"][1:]) not in starts for u in sliced)
        if not uses or len(sliced) + len(updated) < len(uses) or reads_other_slices:
            read += full  # read whole (and, updated, written whole: the result's bytes below)
            continue
        read += min(full, sum(shape_bytes(u["type"]) for u in sliced))
        in_place_update += sum(shape_bytes(body[u["operands"][1]]["type"])
                               for u in updated if len(u["operands"]) > 1)
    root = body.get(fused["root"], {})
    written = in_place_update if root.get("op") in ("dynamic-update-slice", "tuple", "bitcast") \
        and in_place_update else shape_bytes(ins["type"])
    return read + written


def _fusion_cost(ins: dict, instrs: dict, comps: dict) -> tuple[str, float, float, str, float]:
    """(class, FLOPs, bytes, rate class, lane cycles) of a fusion: a GEMM where it holds a dot or
    a convolution (its rate that of its dot's operands, as the fusion converts them), else a
    memory- or arithmetic-bound kernel (rng where jax's random bits made it)."""
    callee = next((c for k, c in called(ins["attrs"]) if k == "calls"), None)
    fused = comps.get(callee)
    flops, rate = 0.0, "bf16"
    if fused:
        for i in fused["instrs"].values():
            if i["op"] == "dot":
                f, rate = _dot_flops(i, fused["instrs"])
                flops += f
    nbytes = _fused_bytes(ins, instrs, fused)
    name = attr(ins["attrs"], "op_name") or ""
    klass = "gemm" if flops else "rng" if re.search(r"random|threefry|rng", name) else "fusion"
    return klass, flops, nbytes, rate, fused_cycles(fused)


def _gemm_waves(ins_type: str, sms: int) -> float:
    """The share of the card's SMs a GEMM's 128 x 128 output tiles keep busy over its waves."""
    shape = dims(tuple_elements(ins_type)[0])
    if len(shape) < 2:
        return 1.0
    tiles = math.prod(shape[:-2]) * math.ceil(shape[-2] / 128) * math.ceil(shape[-1] / 128)
    return tiles / (math.ceil(tiles / sms) * sms)


def kernel(ins: dict, instrs: dict, comps: dict, m: Machine, eff: Efficiency
            ) -> tuple[str, float, float, float, float]:
    """(class, seconds, FLOPs, bytes, arithmetic seconds) of one synchronous kernel. The
    arithmetic (jaxmem.xla.alu's lane cycles at the card's full issue rate) is reported beside
    the time, not in it (jaxmem.xla.alu says why)."""
    op = ins["op"]
    target = attr(ins["attrs"], "custom_call_target") or ""
    rate, cycles = "bf16", 0.0
    if op == "fusion":
        klass, flops, nbytes, rate, cycles = _fusion_cost(ins, instrs, comps)
    elif op == "custom-call" and "fmha" in target:
        klass, flops = "attention", _attention_flops(ins, instrs)
        nbytes = _fused_bytes(ins, instrs, None)
    elif op == "custom-call" and ("gemm" in target or "matmul" in target):
        (flops, rate), klass = _gemm_call_flops(ins, instrs), "gemm"
        nbytes = sum(shape_bytes(instrs.get(o, {}).get("type", "")) for o in ins["operands"]) \
            + shape_bytes(tuple_elements(ins["type"])[0])
    elif op == "dot":
        (flops, rate), klass = _dot_flops(ins, instrs), "gemm"
        nbytes = _fused_bytes(ins, instrs, None)
    elif op in ("rng-bit-generator", "rng"):
        klass, flops, nbytes = "rng", 0.0, shape_bytes(ins["type"])
    else:  # copies, slices, reductions, sorts, scatters, other custom calls: memory-bound
        klass = "copy" if op in ("copy", "dynamic-slice", "dynamic-update-slice", "slice",
                                 "concatenate", "transpose", "pad") else "fusion"
        flops, nbytes = 0.0, _fused_bytes(ins, instrs, None) if op != "dynamic-update-slice" \
            else 2 * shape_bytes(instrs.get(ins["operands"][1], {}).get("type", ""))
        if op == "custom-call":  # a Pallas (Triton) kernel states its cycles in its name
            per = tagged(kernel_name(ins["attrs"]))
            cycles = per * elements(tuple_elements(ins["type"])[0]) if per else 0.0
    peak = (m.fp8_flops if rate == "fp8" and m.fp8_flops else
            m.flops * TF32_RATE if rate == "tf32" else m.flops) * (
        eff.attention if klass == "attention" else eff.gemm)
    if klass == "gemm":
        peak *= _gemm_waves(ins["type"], m.sms)
    seconds = eff.launch_s + max(flops / peak if flops else 0.0, nbytes / (m.hbm * eff.memory))
    return klass, seconds, flops, nbytes, cycles / m.lane_cycles if m.lane_cycles else 0.0


def transfer(ins: dict, start_type: str, done_type: str | None, instrs: dict, devices: int,
              comps: dict, m: Machine, eff: Efficiency) -> tuple[str, str, float, float] | None:
    """(class, engine, seconds, bytes) of an asynchronous start, or of a synchronous host copy;
    None where the op moves nothing between memories or devices."""
    coll = wrapped_collective(comps, ins) or ins  # an async-start's collective, or the op itself
    kind = kind_of(coll["op"])
    if kind:  # the ring model's bytes, as jaxmem.xla.collectives counts them
        n = group_size(coll["attrs"], devices)
        nbytes = ring_bytes(kind, data_bytes(kind, coll["op"], coll["type"], n), n)
        bw = m.interconnect * eff.interconnect
        return "collective", "net", (nbytes / bw if bw else 0.0) + 10e-6, nbytes
    moved = direction(done_type or start_type,
                      [instrs.get(o, {}).get("type", "") for o in ins["operands"]])
    if moved is None:
        return None
    engine, nbytes = moved[0].lower(), moved[1]
    return "host transfer", engine, nbytes / (m.host_link * eff.link), nbytes
