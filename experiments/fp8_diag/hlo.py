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

from jaxmem.xla.hlo import attr, entry_name, parse_hlo  # noqa: F401  (re-exported)

F8_TARGET = "__cublas$lt$matmul$f8"
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")
# Ops the rewriter lets stand between a dequantized fp8 value and its dot (MatchFp8Param).
_PASS_THROUGH = {"convert", "multiply", "broadcast", "transpose", "reshape", "bitcast", "copy",
                 "slice", "pad", "select", "dynamic-slice"}

# ------------------------------------------------------------------------------ HLO text
# The reader is jaxmem.xla.hlo's (one implementation); `_attr` is its `attr`, kept under the
# name experiments.fp8_diag.table imports.
_attr = attr


def _is_f8(type_: str) -> bool:
    return type_.startswith("f8")


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
