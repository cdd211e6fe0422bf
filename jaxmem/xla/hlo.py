"""Reading XLA's HLO module text: computations, instructions and shapes (any backend's format).

Text parsing, so a module compiled for a GPU can be saved (`XLA_FLAGS=--xla_dump_to=DIR`,
`*after_optimizations.txt`, or `compiled.as_text()`) and read on any machine. Instructions keep
the text's order: in a scheduled module (`is_scheduled=true`) that is the execution order,
which `host_transfers` reads to tell whether a copy between host and device memory is
asynchronous with compute scheduled under it (issue 39: --offload-optimizer host).
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


def dims(type_: str) -> list[int]:
    """The dimensions of a shape's first array (dynamic bounds <=N as N; [] for a scalar)."""
    m = re.search(r"\[([^\]]*)\]", re.sub(r"\{[^{}]*\}", "", type_))
    return [int(d.lstrip("<=")) for d in m.group(1).split(",") if d.strip()] if m else []


def dtype(type_: str) -> str:
    """The element type of a shape's first array ('f32[2,3]{1,0}' -> 'f32')."""
    return type_.strip("( ").split("[", 1)[0]


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


# Instructions that launch no work of their own: plumbing between values, not compute. A plain
# `copy` moves data (a device-to-device copy, or a synchronous transfer below), so it is not
# counted as compute scheduled under a transfer either.
_NOT_COMPUTE = {"parameter", "constant", "bitcast", "tuple", "get-tuple-element", "copy",
                "after-all", "add-dependency", "opt-barrier", "optimization-barrier",
                "partition-id", "replica-id"}
# Ops that move data between memories when their operand and result sit in different ones.
MOVES = {"copy", "fusion", "dynamic-slice", "dynamic-update-slice"}
_HOST_SPACE = "S(5)"  # XLA's host memory space in a layout: f32[4,256,256]{2,1,0:S(5)}


def _on_host(type_: str) -> bool:
    return _HOST_SPACE in type_


def direction(result: str, operands: list[str]) -> tuple[str, int] | None:
    """("H2D", bytes) / ("D2H", bytes) for an instruction that writes `result` from arrays of
    types `operands` (tuples and scalars, such as slice offsets, left out), or None where it
    moves nothing between host and device memory. The bytes are the device side's: the slice
    fetched, or the device values written into host memory."""
    arrays = [t for t in operands if not t.startswith("(") and shape_bytes(t) > 0
              and "[]" not in t.split("{")[0]]
    if result.startswith("("):
        return None
    if not _on_host(result) and any(_on_host(t) for t in arrays):
        return "H2D", shape_bytes(result)
    device = [t for t in arrays if not _on_host(t)]
    if _on_host(result) and device:
        return "D2H", sum(shape_bytes(t) for t in device)
    return None


def host_transfers(text: str) -> list[dict]:
    """Every copy between host memory (`S(5)` in a layout) and device memory in a compiled
    module's HLO text, in each computation's order, as a dict: name (the start, or the one
    instruction), direction ("H2D" / "D2H"), bytes (device side), computation, async (split
    into a start and a done: `fusion-start`/`fusion-done` of a dynamic-slice or
    dynamic-update-slice, `copy-start`/`copy-done`), done (the done's name; None when
    synchronous) and compute_between: how many compute instructions (fusions, custom-calls such
    as cuBLAS GEMMs and cuDNN attention, convolutions, nested loops; not bitcasts, tuples,
    get-tuple-elements, parameters, constants, copies or other starts and dones) the schedule
    puts between start and done. In a scheduled module (`is_scheduled=true`) the text's order
    is the execution order, so compute_between > 0 is work the device runs while the copy is
    in flight; a nested loop counts as one. Fused computations are not read (the fusion that
    calls one is the kernel). A synchronous transfer (a plain `copy`, or a fusion that reads
    host memory into the device or writes device values into it, not split) has
    compute_between 0.

    >>> hlo = '''HloModule m, is_scheduled=true
    ... ENTRY %main (p: f32[4,256]{1,0:S(5)}, g: f32[1,256], i: s32[]) -> f32[1,256] {
    ...   %p = f32[4,256]{1,0:S(5)} parameter(0)
    ...   %g = f32[1,256]{1,0} parameter(1)
    ...   %i = s32[] parameter(2)
    ...   %ds-start = ((f32[4,256]{1,0:S(5)}, s32[]), f32[1,256]{1,0}, u32[]) fusion-start(%p, %i)
    ...   %mul = f32[1,256]{1,0} fusion(%g), kind=kLoop, calls=%m
    ...   %ds-done = f32[1,256]{1,0} fusion-done(%ds-start)
    ...   %dus = f32[4,256]{1,0:S(5)} fusion(%p, %mul, %i), kind=kLoop, calls=%u
    ...   ROOT %add = f32[1,256]{1,0} fusion(%ds-done, %mul), kind=kLoop, calls=%a
    ... }'''
    >>> for t in host_transfers(hlo):
    ...     print(t["name"], t["direction"], t["bytes"], t["async"], t["compute_between"])
    ds-start H2D 1024 True 1
    dus D2H 1024 False 0
    """
    comps, out = parse_hlo(text), []
    fused = {c for comp in comps.values() for ins in comp["instrs"].values()
             for key, c in called(ins["attrs"]) if key == "calls"}  # run inside their caller
    for comp_name, comp in comps.items():
        if comp_name in fused:
            continue
        instrs = comp["instrs"]
        order, seq = {name: i for i, name in enumerate(instrs)}, list(instrs.values())
        done_of = {ins["operands"][0]: name for name, ins in instrs.items()
                   if ins["op"].endswith("-done") and ins["operands"]}
        for name, ins in instrs.items():
            operand_types = [instrs[o]["type"] for o in ins["operands"] if o in instrs]
            done = done_of.get(name) if ins["op"].endswith("-start") else None
            if done is not None:  # the result is the done's; the operands are the start's
                moved = direction(instrs[done]["type"], operand_types)
            elif ins["op"] in MOVES:
                moved = direction(ins["type"], operand_types)
            else:
                continue
            if moved is None:
                continue
            between = seq[order[name] + 1:order[done]] if done else []
            out.append({"name": name, "direction": moved[0], "bytes": moved[1],
                        "computation": comp_name, "async": done is not None, "done": done,
                        "compute_between": sum(_is_compute(i["op"]) for i in between)})
    return out


def _is_compute(op: str) -> bool:
    """Whether an instruction of this op runs work on the device (see _NOT_COMPUTE)."""
    return op not in _NOT_COMPUTE and not op.endswith(("-start", "-done", "-update"))
