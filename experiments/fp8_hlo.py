"""Reading XLA's HLO text and a jax.profiler trace for experiments.fp8_diag (GPU formats too).

    parse_hlo(text)          {computation: {"root", "instrs": {name: {type, op, operands, attrs}}}}
    fp8_dots(comps)          dots of dequantized fp8 operands, and how many are plain 2-D GEMMs
    gemms(comps)             `__cublas$lt$matmul$f8` calls counted, every other dot / GEMM listed
    top_kernels(dir, steps)  the kernels that took the most time, ms per step, and a breakdown

Text parsing, so it reads a module compiled on any backend: a GPU's optimized HLO can be saved
(`fp8_diag --dump DIR`) and read back anywhere. tests/test_fp8_diag.py checks it on hand-written
texts in the formats XLA's GPU backend and jax.profiler write.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re

F8_TARGET = "__cublas$lt$matmul$f8"
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")
# Ops the rewriter lets stand between a dequantized fp8 value and its dot (MatchFp8Param).
_PASS_THROUGH = {"convert", "multiply", "broadcast", "transpose", "reshape", "bitcast", "copy",
                 "slice", "pad", "select", "dynamic-slice"}

# ------------------------------------------------------------------------------ HLO text


_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([a-z][\w\-]*)\((.*)$")


def _split_call(rest: str) -> tuple[list[str], str]:
    """'a, f32[2] %b), attrs...' -> (['a', 'b'], 'attrs...'): operand names and what follows."""
    depth, i = 1, 0
    while i < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        i += 1
    inner, attrs = rest[:i - 1], rest[i:]
    names, depth, token = [], 0, ""
    for ch in inner + ",":
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            if token.strip():
                names.append(token.strip().split()[-1].lstrip("%"))
            token = ""
        else:
            token += ch
    return names, attrs


def parse_hlo(text: str) -> dict:
    """HLO module text -> {computation: {"root": name, "instrs": {name: instr}}}, where an instr
    is a dict with type, op, operands (names) and attrs (the text after the operands)."""
    comps, current = {}, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = comps.setdefault(m.group(1), {"root": None, "instrs": {}})
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            name, type_, op, rest = m.groups()
            operands, attrs = _split_call(rest)
            current["instrs"][name] = {"type": type_, "op": op, "operands": operands,
                                       "attrs": attrs}
            if line.lstrip().startswith("ROOT"):
                current["root"] = name
    return comps


def entry_name(text: str) -> str | None:
    """The ENTRY computation's name in an HLO module text."""
    m = re.search(r"^ENTRY\s+%?([\w.\-]+)", text, re.M)
    return m.group(1) if m else None


def _is_f8(type_: str) -> bool:
    return type_.startswith("f8")


def _attr(attrs: str, key: str) -> str | None:
    m = re.search(rf'{key}=("[^"]*"|\{{[^}}]*\}}|[^,\s]+)', attrs)
    return m.group(1).strip('"') if m else None


def _fp8_fed(comps, comp, name, depth=0) -> bool:
    """Is `name` a dequantized fp8 value: an f8 tensor reached through convert/multiply/layout
    ops only (into fusions through their root)?"""
    instr = comps[comp]["instrs"].get(name)
    if instr is None or depth > 12:
        return False
    if _is_f8(instr["type"]):
        return True
    if instr["op"] == "fusion":
        called = (_attr(instr["attrs"], "calls") or "").lstrip("%")
        return called in comps and _fp8_fed(comps, called, comps[called]["root"], depth + 1)
    if instr["op"] not in _PASS_THROUGH:
        return False
    # A multiply is convert(f8) * broadcast(scale): follow both sides; the rest have one input.
    operands = instr["operands"] if instr["op"] in ("multiply", "select") else instr["operands"][:1]
    return any(_fp8_fed(comps, comp, o, depth + 1) for o in operands)


def _operand_type(comps, comp, name) -> str:
    instr = comps[comp]["instrs"].get(name)
    return instr["type"] if instr else "?"


def _short(type_: str) -> str:
    """'(bf16[64,32]{1,0}, s8[1024]{0})' -> 'bf16[64,32]': no layouts, no GEMM workspace."""
    type_ = re.sub(r"\{[^}]*\}", "", type_)
    if type_.startswith("("):  # a custom call's tuple: the result, then its workspace
        type_ = type_[1:].split("]")[0] + "]"
    return type_


def _rank(type_: str) -> int:
    """'bf16[128,64]{1,0}' -> 2."""
    dims = type_.partition("[")[2].partition("]")[0]
    return len(dims.split(",")) if dims else 0


def fp8_dots(comps) -> dict:
    """Dots whose two operands are dequantized fp8, and how many of them are plain 2-D GEMMs
    with the contracting axis minor on both operands ([M, K] x [N, K])."""
    total = plain = 0
    for comp, c in comps.items():
        for instr in c["instrs"].values():
            if instr["op"] != "dot" or not all(_fp8_fed(comps, comp, o) for o in instr["operands"]):
                continue
            total += 1
            ranks = [_rank(_operand_type(comps, comp, o)) for o in instr["operands"]]
            plain += (ranks == [2, 2] and _attr(instr["attrs"], "lhs_batch_dims") is None
                      and _attr(instr["attrs"], "lhs_contracting_dims") == "{1}"
                      and _attr(instr["attrs"], "rhs_contracting_dims") == "{1}")
    return {"fp8_dots": total, "fp8_dots_2d": plain}


def gemms(comps) -> dict:
    """The optimized module's GEMMs: f8 custom calls counted, every other dot / GEMM listed."""
    f8, others = 0, {}
    for comp, c in comps.items():
        for instr in c["instrs"].values():
            target = _attr(instr["attrs"], "custom_call_target") if instr["op"] == "custom-call" \
                else None
            if target == F8_TARGET:
                f8 += 1
                continue
            if instr["op"] != "dot" and target not in GEMM_TARGETS:
                continue
            operands = instr["operands"][:2]
            where = "/".join((_attr(instr["attrs"], "op_name") or "").split("/")[-2:])
            key = (target or "dot", _short(instr["type"]),
                   tuple(_short(_operand_type(comps, comp, o)) for o in operands),
                   all(_fp8_fed(comps, comp, o) for o in operands), where)
            others[key] = others.get(key, 0) + 1
    rows = [{"op": k[0], "result": k[1], "operands": list(k[2]), "fp8_intended": k[3],
             "where": k[4], "count": n} for k, n in others.items()]
    rows.sort(key=lambda r: (not r["fp8_intended"], -r["count"]))
    return {"f8_gemm_custom_calls": f8, "non_fp8_dots": rows}


# ------------------------------------------------------------------------------ step table
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


# ------------------------------------------------------------------------------ profile


_KINDS = (  # (kind, pattern on a kernel's name), first match wins; names are cuBLAS/XLA's own
    ("fp8 gemm", re.compile(r"e4m3|e5m2|f8f8|fp8", re.I)),
    ("gemm", re.compile(r"gemm|xmma|nvjet|cutlass|cublas|matmul|dot", re.I)),
    ("attention", re.compile(r"fmha|flash|attention|cudnn", re.I)),
)


def kernel_kind(name: str) -> str:
    """A kernel's kind from its name: 'fp8 gemm', 'gemm', 'attention' or 'other' (a guess from
    naming conventions, for a breakdown; the top kernels list gives the names themselves)."""
    return next((kind for kind, pattern in _KINDS if pattern.search(name)), "other")


def top_kernels(trace_dir: str, steps: int, top: int = 15):
    """(rows [[name, ms per step]], source, {kind: ms per step}) from the newest
    `*.trace.json.gz` under trace_dir (rows None when there is none).

    Device events (processes named '/device:...', e.g. GPU kernels) when the trace has them; on
    CPU the XLA executor threads' ops."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not paths:
        return None, f"no *.trace.json.gz under {trace_dir}", None
    with gzip.open(paths[-1], "rt") as f:
        events = json.load(f).get("traceEvents", [])
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device = {p for p, n in procs.items() if n.startswith("/device:")}
    if device:
        keep, source = (lambda e: e["pid"] in device), "device kernels"
    else:
        # XLA's ops, not the runtime's own scopes ('ThunkExecutor::Execute') or Python frames.
        keep, source = (lambda e: "XLA" in threads.get((e["pid"], e.get("tid")), "")
                        and not e["name"].startswith(("$", "end: ")) and "::" not in e["name"]), \
            "host XLA threads (no device events)"
    total = {}
    for e in events:
        if e.get("ph") == "X" and keep(e):
            total[e["name"]] = total.get(e["name"], 0.0) + float(e.get("dur", 0.0))
    kinds = {}
    for name, us in total.items():
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + us
    rows = sorted(total.items(), key=lambda kv: -kv[1])[:top]
    return ([[name, round(us / 1e3 / steps, 4)] for name, us in rows], source,
            {k: round(us / 1e3 / steps, 4) for k, us in sorted(kinds.items())})
