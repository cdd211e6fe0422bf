"""What an optimized GPU module runs per step, read from its text (experiments.fp8_diag --target):
a deviceless compile has no cost_analysis, so the figures are summed from the HLO.

    step_table(text)              GEMMs by backend and dtype with their FLOPs, cuDNN attention,
                                  non-GEMM fusion bytes, scaling passes (amax, f8 writes)
    roofline_ms(table, tflops, bandwidth)
                                  a time estimate at a card's published peaks (not a measurement)
    fusion_bytes, type_bytes      the byte sums behind it

Every count is weighted by how often its computation runs (while loops' known trip counts), so a
scanned layer's body counts once per layer. tests/test_fp8_diag.py checks it on hand-written HLO.
"""

from __future__ import annotations

import re

from experiments.fp8_diag.hlo import (F8_TARGET, GEMM_TARGETS, _attr, _is_f8, _operand_type,
                                 entry_name, parse_hlo)

# What an optimized GPU module runs per step, read from its text (a deviceless compile has no
# cost_analysis): GEMMs by backend and dtype with their FLOPs, and the bytes non-GEMM kernels
# move. Every count is weighted by how often its computation runs (while loops' known trip
# counts), so a scanned layer's body counts once per layer.

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "s4": 0.5, "u4": 0.5}
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
         "conditional", "custom-call", "fusion", "after-all", "partition-id", "replica-id",
         "opt-barrier", "iota", "copy-start", "copy-done", "add-dependency"}
_FREE_PREFIX = ("async-", "all-", "collective-", "reduce-scatter", "send", "recv")


def _elem_bytes(dtype: str) -> float:
    return 1 if dtype.startswith("f8") else _BYTES.get(dtype, 4)


def type_bytes(type_: str) -> int:
    """Bytes of an HLO type, tuples summed: '(bf16[64,32]{1,0}, f32[])' -> 4100."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(type_):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _elem_bytes(dtype)
    return int(total)


def _dims(type_: str) -> list[int]:
    m = _ARRAY.search(type_)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _dtype(type_: str) -> str:
    m = _ARRAY.search(type_)
    return m.group(1) if m else "?"


def computation_weights(comps: dict, entry: str) -> tuple[dict, list]:
    """{computation: executions per run of `entry`} for the computations that run as such
    (entry, while bodies and conditions, called and branch computations; fused computations are
    part of their fusion), and the while loops whose trip count is unknown (counted once)."""
    weights, unknown = {}, []

    def visit(comp, w):
        weights[comp] = weights.get(comp, 0) + w
        for name, instr in comps[comp]["instrs"].items():
            a = instr["attrs"]
            if instr["op"] == "while":
                m = re.search(r'"known_trip_count":\{"n":"(\d+)"', a)
                if m is None:
                    unknown.append(name)
                trips = int(m.group(1)) if m else 1
                for key in ("condition", "body"):
                    called = (_attr(a, key) or "").lstrip("%")
                    if called in comps:
                        visit(called, w * (trips + (key == "condition")))
            elif instr["op"] in ("call", "conditional") or instr["op"].startswith("async-start"):
                for called in re.findall(r"(?:to_apply|calls|true_computation|false_computation|"
                                         r"branch_computations)=\{?([^,}\s]+(?:,\s*%[\w.\-]+)*)",
                                         a):
                    for c in called.split(","):
                        c = c.strip().lstrip("%")
                        if c in comps:
                            visit(c, w)

    visit(entry, 1)
    return weights, unknown


def _fused(comps, instr) -> str | None:
    called = (_attr(instr["attrs"], "calls") or "").lstrip("%")
    return called if called in comps else None


def _inner(comps, comp, op):
    """Instructions with opcode `op` in `comp` and the computations its fusions call."""
    for instr in comps[comp]["instrs"].values():
        if instr["op"] == op:
            yield comp, instr
        if instr["op"] == "fusion" and _fused(comps, instr):
            yield from _inner(comps, _fused(comps, instr), op)


def _has_f8_param(comps, comp) -> bool:
    return any(_is_f8(i["type"]) for _, i in _inner(comps, comp, "parameter"))


def _dot_flops(comps, comp, dot) -> float:
    """2 x result elements x contracted size, for a dot instruction."""
    lhs = _dims(_operand_type(comps, comp, dot["operands"][0]))
    contracting = _attr(dot["attrs"], "lhs_contracting_dims") or "{}"
    k = 1
    for d in re.findall(r"\d+", contracting):
        k *= lhs[int(d)] if int(d) < len(lhs) else 1
    n = 1
    for d in _dims(dot["type"]):
        n *= d
    return 2.0 * n * k


def _cublas_flops(comps, comp, instr) -> float:
    lhs = _dims(_operand_type(comps, comp, instr["operands"][0]))
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instr["attrs"])
    k = 1
    for d in re.findall(r"\d+", m.group(1) if m else ""):
        k *= lhs[int(d)] if int(d) < len(lhs) else 1
    n = 1
    for d in _dims(instr["type"]):  # the first array: the result (then the workspace)
        n *= d
    return 2.0 * n * k


def _param_read_bytes(comps, comp, param_name: str, full: int) -> int:
    """Bytes a fusion reads of one parameter: the slices it takes when every use is a
    (dynamic-)slice, nothing when every use is the buffer of an in-place dynamic-update-slice,
    else the whole operand. Bitcasts are followed."""
    instrs = comps[comp]["instrs"]
    total, seen = 0, [param_name]
    while seen:
        name = seen.pop()
        for user in (i for i in instrs.values() if name in i["operands"]):
            if user["op"] == "bitcast":
                seen.append(next(k for k, v in instrs.items() if v is user))
            elif user["op"] in ("slice", "dynamic-slice") and user["operands"][0] == name:
                total += type_bytes(user["type"])
            elif user["op"] == "dynamic-update-slice" and user["operands"][0] == name:
                continue
            else:
                return full
    return min(total, full)


def _written_bytes(comps, comp, name: str) -> int:
    """Bytes a fusion writes for the value `name` of its computation: the update of an
    in-place dynamic-update-slice, each element of a tuple, else the whole value."""
    instr = comps[comp]["instrs"].get(name)
    if instr is None:
        return 0
    if instr["op"] == "tuple":
        return sum(_written_bytes(comps, comp, o) for o in instr["operands"])
    if instr["op"] == "bitcast":
        return _written_bytes(comps, comp, instr["operands"][0])
    if instr["op"] == "dynamic-update-slice":
        return type_bytes(_operand_type(comps, comp, instr["operands"][1]))
    return type_bytes(instr["type"])


def fusion_bytes(comps, comp: str, instr: dict) -> int:
    """Bytes a non-GEMM fusion moves: its operands read plus its results written (the slices
    only, for (dynamic-)slices of an operand and in-place dynamic-update-slices)."""
    called = _fused(comps, instr)
    if called is None:
        return sum(type_bytes(_operand_type(comps, comp, o)) for o in instr["operands"]) + \
            type_bytes(instr["type"])
    params = {int(i["operands"][0]): n for n, i in comps[called]["instrs"].items()
              if i["op"] == "parameter"}
    read = 0
    for pos, operand in enumerate(instr["operands"]):
        full = type_bytes(_operand_type(comps, comp, operand))
        pname = params.get(pos)
        read += full if pname is None else _param_read_bytes(comps, called, pname, full)
    return read + _written_bytes(comps, called, comps[called]["root"])


def _is_amax(comps, comp: str, reduce: dict) -> bool:
    """A reduce with a maximum as its combiner over abs(x) (through converts and bitcasts)."""
    combiner = (_attr(reduce["attrs"], "to_apply") or "").lstrip("%")
    if combiner not in comps or comps[combiner]["instrs"].get(
            comps[combiner]["root"], {}).get("op") != "maximum":
        return False
    instrs, name = comps[comp]["instrs"], reduce["operands"][0]
    for _ in range(6):
        instr = instrs.get(name)
        if instr is None:
            return False
        if instr["op"] == "abs":
            return True
        if instr["op"] not in ("convert", "bitcast", "reshape", "copy"):
            return False
        name = instr["operands"][0]
    return False


def _scaling_kind(comps, comp: str, instr: dict) -> str | None:
    """What a non-GEMM fusion does for fp8 scaling, or None: 'quantize' (writes an f8 array),
    'round-trip' (converts to f8 and back inside: a GEMM after it is not an fp8 GEMM),
    'dequantize' (reads f8, writes a wider type), 'amax' (a reduce-max over abs: a per-tensor
    absolute max; a fusion that also quantizes counts as 'quantize')."""
    called = _fused(comps, instr)
    if re.search(r"\bf8e\w+\[", instr["type"]):
        return "quantize"
    inner = [i for _, i in _inner(comps, called, "convert")] if called else []
    if any(_is_f8(i["type"]) for i in inner):
        return "round-trip"
    if any(_is_f8(_operand_type(comps, comp, o)) for o in instr["operands"]):
        return "dequantize"
    if called and any(_is_amax(comps, c, r) for c, r in _inner(comps, called, "reduce")):
        return "amax"
    return None


def step_table(text: str) -> dict:
    """Per-step GEMMs, attention calls and non-GEMM traffic of an optimized GPU module's text.

    gemms: {"<backend> <dtype>": {"count", "gflop"}}, backend one of cublasLt (a
    `__cublas$lt$matmul[$f8]` call), cublas (`__cublas$gemm`), triton (a GEMM fusion: a custom
    fusion holding a dot; f8 when an f8 array goes into it), dot (a dot left unfused);
    attention: cuDNN fused attention calls and their GFLOP (causal: half the blocks, backward
    2.5x the forward's); fusions: non-GEMM fusions counted, with `bytes` (operands read plus
    results written); other_ops: unfused non-GEMM ops with their bytes; scaling: the fusions
    of `_scaling_kind` (count, bytes) by kind; unknown_trip_counts: loops counted once."""
    comps = parse_hlo(text)
    entry = entry_name(text)
    weights, unknown = computation_weights(comps, entry)
    gemm, attention = {}, {"count": 0, "gflop": 0.0}
    fusions = {"count": 0, "bytes": 0}
    other = {"count": 0, "bytes": 0}
    scaling = {}

    def add(table, key, count, **values):
        row = table.setdefault(key, {"count": 0, **{k: 0 for k in values}})
        row["count"] += count
        for k, v in values.items():
            row[k] += v

    for comp, w in weights.items():
        for instr in comps[comp]["instrs"].values():
            op = instr["op"]
            target = _attr(instr["attrs"], "custom_call_target") if op == "custom-call" else None
            if target == F8_TARGET or target in GEMM_TARGETS:
                backend = "cublas" if target == "__cublas$gemm" else "cublasLt"
                dtype = "f8" if target == F8_TARGET else \
                    _dtype(_operand_type(comps, comp, instr["operands"][0]))
                add(gemm, f"{backend} {dtype}", w, gflop=w * _cublas_flops(comps, comp, instr) / 1e9)
            elif target and target.startswith("__cudnn$fmha"):
                m = re.search(r'"intermediate_tensor_shape":\s*\{[^}]*?"dimensions":\s*\[([^\]]*)\]',
                              instr["attrs"])
                dims = [int(d) for d in re.findall(r"\d+", m.group(1))] if m else []
                head = _dims(instr["type"])[-1] if _dims(instr["type"]) else 0
                flop = 4.0 * head
                for d in dims:
                    flop *= d
                flop *= 0.5 if '"CAUSAL"' in instr["attrs"] else 1.0
                flop *= 2.5 if "Backward" in target else 1.0
                attention["count"] += w
                attention["gflop"] += w * flop / 1e9
            elif op == "dot":
                add(gemm, f"dot {_dtype(_operand_type(comps, comp, instr['operands'][0]))}", w,
                    gflop=w * _dot_flops(comps, comp, instr) / 1e9)
            elif op == "fusion":
                called = _fused(comps, instr)
                dots = list(_inner(comps, called, "dot")) if called else []
                if dots:
                    dcomp, dot = dots[0]
                    dtype = "f8" if _has_f8_param(comps, called) else \
                        _dtype(_operand_type(comps, dcomp, dot["operands"][0]))
                    add(gemm, f"triton {dtype}", w,
                        gflop=w * sum(_dot_flops(comps, c, d) for c, d in dots) / 1e9)
                    continue
                moved = fusion_bytes(comps, comp, instr)
                fusions["count"] += w
                fusions["bytes"] += w * moved
                kind = _scaling_kind(comps, comp, instr)
                if kind:
                    add(scaling, kind, w, bytes=w * moved)
            elif op not in _FREE and not op.startswith(_FREE_PREFIX):
                other["count"] += w
                other["bytes"] += w * fusion_bytes(comps, comp, instr)
    for row in gemm.values():
        row["gflop"] = round(row["gflop"], 3)
    attention["gflop"] = round(attention["gflop"], 3)
    return {"gemms": dict(sorted(gemm.items())), "attention": attention, "fusions": fusions,
            "other_ops": other, "scaling": dict(sorted(scaling.items())),
            "unknown_trip_counts": unknown}


def roofline_ms(table: dict, tflops: dict, bandwidth: float) -> dict:
    """An estimate, not a measurement: every GEMM at the card's peak for its dtype (`tflops`:
    {"f8": .., "bf16": .., "f32": ..}; other dtypes at the bf16 rate), attention at the bf16
    peak, every non-GEMM byte at the memory bandwidth (bytes/s); no overlap, no launch cost."""
    gemm = sum(row["gflop"] * 1e9 / (tflops.get(key.split()[-1], tflops["bf16"]) * 1e12)
               for key, row in table["gemms"].items())
    attention = table["attention"]["gflop"] * 1e9 / (tflops["bf16"] * 1e12)
    memory = (table["fusions"]["bytes"] + table["other_ops"]["bytes"]) / bandwidth
    return {"gemm_ms": round(gemm * 1e3, 3), "attention_ms": round(attention * 1e3, 3),
            "non_gemm_ms": round(memory * 1e3, 3),
            "total_ms": round((gemm + attention + memory) * 1e3, 3)}
