"""A kernel's arithmetic in lane cycles, reported beside the time model's prediction
(jaxmem.xla.kernels), which bounds each kernel by its FLOPs and its bytes only.

    fused_cycles(fused_computation)     an XLA fusion's lane cycles, from its instructions
    cycles_per_element(hlo_text)        a Pallas kernel's, from its body's compiled HLO
    tag(name, cycles) / tagged(name)    a kernel name that carries its cycles per element

A lane cycle is one issue slot of one of the card's fp32 lanes (`Card.fp32_per_sm` x SMs x the
boost clock per second). Each instruction costs its result's elements times the lane cycles one
element takes, from the per-SM throughputs of compute capability 8.x / 9.x (CUDA C++
Programming Guide, "Arithmetic Instructions"): fp32 add / multiply / compare / select 128 per
clock (1 cycle), 32-bit integer add, logic, shift, multiply and compare 64 (2), conversions
between integers and floats and the special-function unit 16 (8); an IEEE fp32 division or
square root is a special-function approximation refined by a few fused multiply-adds (16); a
gather from a table a load through L1, 32 per clock (4); a rotate (two shifts and an or) one
funnel shift. Views, broadcasts and data movement cost nothing here (their bytes are the memory
bound's). These are throughputs with every issue slot filled: a floor, were they right.

Why beside the time and not in it: the counts are HLO operations, not the instructions a GPU
issues (the code generators merge integer operations: IADD3, LOP3), and the issue rate a kernel
reaches is unknown until a profile. At the full issue rate the calibration rows stay within
+-20% (the 8B rows move by 2-7%, docs/results.md); at 60% of it the two 8B rows at 1x2048 fell
to 0.80x / 0.78x of their measured tok/s. So the planner's step time is the bytes' bound and
this is the pessimistic side, printed beside it. Elementwise kernels with a few operations per
element are far from it; random bits (threefry-2x32: ~75 integer operations per element) and
8-bit code searches are not.

A Pallas kernel is a Triton custom call whose program XLA keeps as MLIR bytecode; its builder
counts its body's cycles per element from the body's HLO (`cycles_per_element`) and puts the
count in the kernel's name (`tag`), which the compiled program keeps and the time model reads
(`tagged`).
"""

from __future__ import annotations

import math
import re

from jaxmem.xla.hlo import dims, dtype, parse_hlo

_FREE = {"parameter", "constant", "bitcast", "broadcast", "reshape", "tuple", "get-tuple-element",
         "slice", "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "copy",
         "transpose", "iota", "bitcast-convert", "after-all", "partition-id", "replica-id",
         "custom-call", "call", "fusion", "while", "conditional"}
_SLOW = {"divide": 16, "sqrt": 16, "rsqrt": 8, "exponential": 8, "log": 8, "tanh": 8,
         "logistic": 16, "power": 32, "sine": 8, "cosine": 8, "exponential-minus-one": 8,
         "log-plus-one": 8, "cbrt": 16, "atan2": 32, "erf": 16, "remainder": 32}
_FLOAT = ("f16", "bf16", "f32", "f64", "f8")
_TAG = re.compile(r"_(\d+)cyc$")


def elements(type_: str) -> int:
    """Elements of an instruction's (first) array result."""
    return math.prod(dims(type_))


def instruction_cycles(ins: dict, instrs: dict) -> float:
    """Lane cycles of one instruction of a fused (or kernel) computation."""
    op = ins["op"]
    if op in _FREE:
        return 0.0
    if op == "convert":
        src = dtype(instrs.get(ins["operands"][0], {}).get("type", "")) if ins["operands"] else ""
        dst = dtype(ins["type"])
        # float <-> float of other widths is a shift or a repack (1); int <-> float 8
        per = 1 if src.startswith(_FLOAT) == dst.startswith(_FLOAT) else 8
        return per * elements(ins["type"])
    if op in ("reduce", "reduce-window"):  # the reducer's operation per element read
        src = instrs.get(ins["operands"][0], {}).get("type", "") if ins["operands"] else ""
        return (1 if dtype(src).startswith(_FLOAT) else 2) * elements(src)
    if op == "gather":
        return 4 * elements(ins["type"])
    if op in _SLOW:
        return _SLOW[op] * elements(ins["type"])
    # compare and select by their operands' type; other elementwise ops by their result's
    kind = ins["type"]
    if op in ("compare", "select") and len(ins["operands"]) > 1:
        kind = instrs.get(ins["operands"][-1], {}).get("type", kind)
    return (1 if dtype(kind).startswith(_FLOAT) else 2) * elements(ins["type"])


def _rotates(instrs: dict) -> set[str]:
    """The shifts of every rotate `or(shift-left(x, a), shift-right-logical(x, b))`: the GPU
    does the three in one funnel shift (SHF), which the `or` stands for."""
    out = set()
    for ins in instrs.values():
        if ins["op"] != "or" or len(ins["operands"]) != 2:
            continue
        a, b = (instrs.get(o, {}) for o in ins["operands"])
        ops = {a.get("op"), b.get("op")}
        if ops == {"shift-left", "shift-right-logical"} and \
                a["operands"][:1] == b["operands"][:1]:
            out.update(ins["operands"])
    return out


def fused_cycles(fused: dict | None) -> float:
    """Lane cycles of an XLA fusion's computation (its instructions, not nested reducers; a
    rotate's two shifts and its `or` one operation)."""
    if not fused:
        return 0.0
    instrs, folded = fused["instrs"], _rotates(fused["instrs"])
    return sum(instruction_cycles(i, instrs) for n, i in instrs.items() if n not in folded)


def cycles_per_element(hlo_text: str, elements: int) -> int:
    """Lane cycles per element of a computation over `elements` elements (a kernel body's tile
    lowered to HLO text, `jax.jit(f).lower(...).as_text(dialect="hlo")`): every computation of
    the module but the reducers' bodies, rounded up."""
    comps = parse_hlo(hlo_text)
    reducers = set()
    for comp in comps.values():
        for ins in comp["instrs"].values():
            reducers.update(re.findall(r"to_apply=%?([\w.\-]+)", ins["attrs"]))
    total = sum(fused_cycles(c) for name, c in comps.items() if name not in reducers)
    return -(-int(total) // max(elements, 1))


def tag(name: str, cycles: int) -> str:
    """`name` carrying `cycles` lane cycles per element (read back by `tagged`)."""
    return f"{name}_{int(cycles)}cyc"


def tagged(name: str) -> int | None:
    """The lane cycles per element a `tag`ged kernel name carries, or None."""
    m = _TAG.search(name or "")
    return int(m.group(1)) if m else None


def kernel_name(attrs: str) -> str:
    """A Triton custom call's kernel name (its backend_config's `name = "..."`), or ""."""
    m = re.search(r'\bname = "([^"]*)"', attrs)
    return m.group(1) if m else ""
