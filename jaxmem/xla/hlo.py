"""Reading XLA's HLO module text: computations, instructions and shapes (any backend's format).

Text parsing, so a module compiled for a GPU can be saved (`XLA_FLAGS=--xla_dump_to=DIR`,
`*after_optimizations.txt`, or `compiled.as_text()`) and read on any machine. Instructions keep
the text's order: in a scheduled module (`is_scheduled=true`) that is the execution order.
"""

from __future__ import annotations

import math
import re

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
# Bits per element; XLA stores sub-byte types packed (s4/u4: two per byte).
_BITS = {"pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
         "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
         "c64": 64, "c128": 128, "token": 0, "opaque": 0}
# Attributes that name called computations, in the formats XLA prints.
_CALL_KEYS = ("calls", "to_apply", "body", "condition", "true_computation", "false_computation",
              "branch_computations", "called_computations", "async_execution_thread_computation")


def _top_level(text: str) -> tuple[list[str], str]:
    """The comma-separated items of `text` outside any brackets (stripped, empty ones dropped) up
    to a bracket that closes one opened before `text`, and what follows that bracket:
    'a, f32[2] %b), calls=%f' -> (['a', 'f32[2] %b'], ', calls=%f')."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if depth < 0 or (ch == "," and depth == 0):
            items.append(text[start:i].strip())
            start = i + 1
            if depth < 0:
                return [t for t in items if t], text[i + 1:]
    items.append(text[start:].strip())
    return [t for t in items if t], ""


def parse_hlo(text: str) -> dict:
    """HLO module text -> {computation: {"root": name, "instrs": {name: instr}}}, where an instr
    is a dict with type, op, operands (names) and attrs (the text after the operands). Both keep
    the text's order."""
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
            items, attrs = _top_level(rest)  # 'a, f32[2] %b), attrs' -> operands a and b
            operands = [t.split()[-1].lstrip("%") for t in items]
            current["instrs"][name] = {"type": type_, "op": op, "operands": operands,
                                       "attrs": attrs}
            if line.lstrip().startswith("ROOT"):
                current["root"] = name
    return comps


def entry_name(text: str) -> str | None:
    """The ENTRY computation's name in an HLO module text."""
    m = re.search(r"^ENTRY\s+%?([\w.\-]+)", text, re.M)
    return m.group(1) if m else None


def attr(attrs: str, key: str) -> str | None:
    """The text of attribute `key` in an instruction's attrs (a quoted string unquoted, a {...}
    group kept whole when it holds no nested braces), or None."""
    m = re.search(rf'\b{key}=("[^"]*"|\{{[^}}]*\}}|[^,\s]+)', attrs)
    return m.group(1).strip('"') if m else None


def called(attrs: str) -> list[tuple[str, str]]:
    """Every (attribute, computation name) an instruction's attrs call: a fusion's `calls`, a
    while's `body` and `condition`, a reduction's `to_apply`, a conditional's branches..."""
    return [(key, n.lstrip("%")) for key in _CALL_KEYS
            for n in re.findall(r"%?[\w.\-]+", (attr(attrs, key) or "").strip("{}"))]


def tuple_elements(type_: str) -> list[str]:
    """The top-level elements of a tuple shape ('(a, (b, c))' -> ['a', '(b, c)']); an array
    shape is its own single element."""
    type_ = type_.strip()
    return _top_level(type_[1:-1])[0] if type_.startswith("(") else [type_]


def shape_bytes(type_: str) -> int:
    """Bytes of every array in a shape (a tuple's summed), from dtypes and dimensions; layouts,
    tiling and memory spaces in {...} are ignored, dynamic bounds (<=N) count at N. An unknown
    dtype raises ValueError."""
    total = 0
    for dtype, dims in _ARRAY.findall(re.sub(r"\{[^{}]*\}", "", type_)):
        bits = _BITS.get(dtype, {"f8": 8, "f4": 4}.get(dtype[:2]))  # f8e4m3fn, f4e2m1fn, ...
        if bits is None:
            raise ValueError(f"unknown HLO element type {dtype!r} in {type_!r}")
        n = math.prod(int(d.lstrip("<=")) for d in dims.split(",") if d.strip())
        total += n * bits
    return total // 8


def module_devices(text: str) -> int:
    """replica_count x num_partitions of the module's HloModule line (1 where not printed)."""
    head = text.split("\n", 1)[0]
    return math.prod(int(m[1]) for key in ("replica_count", "num_partitions")
                     if (m := re.search(rf"{key}=(\d+)", head)))


def entry_argument_bytes(text: str) -> tuple[int, int]:
    """(host, device) bytes of a compiled module's parameters, from its entry layout: a
    parameter whose layout says `S(5)` (`f32[4,256,256]{2,1,0:S(5)}`) is in host memory. Per
    device in a partitioned module. XLA:CPU's memory_analysis() counts both in
    argument_size_in_bytes (host_argument_size_in_bytes 0, jax 0.10.2); this tells them apart.
    (0, 0) for a text without an entry layout."""
    head = text.split("\n", 1)[0]
    start = head.find("entry_computation_layout={(")
    if start < 0:
        return 0, 0
    params = _top_level(head[start + len("entry_computation_layout={("):])[0]  # up to ')->'
    host = sum(shape_bytes(p) for p in params if "S(5)" in p)  # S(5): XLA's host memory space
    return host, sum(shape_bytes(p) for p in params) - host
