"""What a compiled step sends between devices: its collectives read from the optimized HLO text
(`find_collectives`), summed per kind and step (`comm_report`, `format_comm_table`).

Bytes follow the ring model, per device and per run, sent = received, for a group of n devices:

    all-gather of output O          O (n-1)/n
    reduce-scatter of input I       I (n-1)/n     (I = n x the output)
    all-reduce of I                 2 I (n-1)/n   (a reduce-scatter then an all-gather)
    all-to-all of I                 I (n-1)/n     (keeps its own 1/n)
    collective-permute of I         I

A collective runs once per run of its computation: a while body runs `known_trip_count` times
(XLA's backend_config; nested loops multiply) and a computation called from several places
(fusions, calls, loop bodies) adds up its callers. A while with no known trip count is counted
once, and a conditional's branches as if each ran: the collectives under either are listed in
`uncertain`. An async pair counts once, at its -start.
"""

from __future__ import annotations

import dataclasses
import graphlib
import math
import re

from jaxmem.xla.hlo import attr, called, entry_name, module_devices, parse_hlo, shape_bytes, \
    tuple_elements

GiB = 2**30
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
RING = {"all-gather": "O (n-1)/n", "reduce-scatter": "I (n-1)/n", "all-reduce": "2 I (n-1)/n",
        "all-to-all": "I (n-1)/n", "collective-permute": "I"}
# Ops that are not compute when scheduled between an async start and its done (nor are
# collectives, sync ones too).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-start",
         "copy-done"}
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_LIST = re.compile(r"replica_groups=\{(\{[^}]*\})?")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a module, as each device of its group sees it."""
    name: str             # the instruction (an async pair's -start)
    computation: str      # where it is scheduled
    kind: str             # one of KINDS
    group_size: int       # n: devices in its replica group
    data_bytes: int       # the ring model's O or I (collective-permute: its operand)
    bytes_per_run: float  # sent by each device each run (= received), by RING
    runs: int             # runs per step (loop trip counts multiplied, call sites summed)
    asynchronous: bool    # a -start / -done pair (or async-start / async-done)
    forced_sync: bool     # async form with backend_config "is_sync": true (runs in stream)
    compute_between: int | None  # compute ops between start and done; None: sync, or no done here
    uncertain: tuple[str, ...] = ()  # loops without a trip count / conditionals around it
    op_name: str = ""     # jax's op_name from the metadata: where in the program it comes from

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_per_run * self.runs


def kind_of(op: str) -> str | None:
    """The collective kind of an opcode ('all-gather-start' -> 'all-gather'), else None."""
    base = op[:-6] if op.endswith("-start") else op
    return base if base in KINDS else None


def group_size(attrs: str, devices: int) -> int:
    """n of a collective: the first group's size (every group of one op has the same) in the three
    printed forms of `replica_groups`: {{0,1,...}}, iota [groups,n]<=[...] and
    mesh['a'=8,'b'=1] {'a'}; `devices` where the groups are {} or not printed."""
    m = _MESH.search(attrs)
    if m:
        sizes = {k.strip().strip("'\""): int(v) for k, v in
                 (kv.split("=") for kv in m.group(1).split(",") if "=" in kv)}
        return math.prod(sizes[a.strip().strip("'\"")] for a in m.group(2).split(",") if a.strip())
    m = _IOTA.search(attrs)
    if m:
        return int(m.group(2))
    m = _LIST.search(attrs)
    if m and m.group(1):
        return len([x for x in m.group(1).strip("{}").split(",") if x.strip()])
    return devices


def ring_bytes(kind: str, data_bytes: int, n: int) -> float:
    """Bytes each device sends (and receives) in one run, by the ring model (module docstring)."""
    if kind == "collective-permute":
        return float(data_bytes)
    return (2 if kind == "all-reduce" else 1) * data_bytes * (n - 1) / n


def data_bytes(kind: str, op: str, type_: str, n: int) -> int:
    """The ring model's O / I of an instruction, from its result shape (of the op an async-start
    wraps); of a -start's tuple: a collective-permute's operand, the others' outputs."""
    if op.endswith("-start") and kind != "all-reduce":  # all-reduce-start: the outputs
        parts = tuple_elements(type_)  # permute: (operand, output, contexts); others: (ins, outs)
        type_ = parts[0] if kind == "collective-permute" else parts[1] if len(parts) > 1 \
            else type_
    out = shape_bytes(type_)
    return n * out if kind == "reduce-scatter" else out


def wrapped_collective(comps: dict, instr: dict) -> dict | None:
    """The collective an async-start runs (the root of its called computation), else None."""
    if instr["op"] != "async-start":
        return None
    for key, name in called(instr["attrs"]):
        comp = comps.get(name)
        if key == "calls" and comp and comp["root"]:
            root = comp["instrs"][comp["root"]]
            return root if kind_of(root["op"]) else None
    return None


def runs_per_step(comps: dict, entry: str) -> tuple[dict, dict]:
    """{computation: runs per step} from ENTRY (1) down every call edge, and {computation: the
    caveats (unknown loops, conditionals) on the paths to it}. Unreached computations: 0. An
    async-start of a collective calls nothing: its collective is counted at the start."""
    edges: dict[str, list] = {c: [] for c in comps}  # caller: [(callee, factor, caveat)]
    for cname, comp in comps.items():
        for iname, ins in comp["instrs"].items():
            if wrapped_collective(comps, ins) is not None:
                continue
            trips, caveat = 1, None
            if ins["op"] == "while":
                trip = _TRIP.search(ins["attrs"])
                trips = int(trip[1]) if trip else None
                caveat = None if trip else f"{iname} (while, no known trip count: counted once)"
            elif ins["op"] == "conditional":
                caveat = f"{iname} (conditional: every branch counted)"
            for key, callee in called(ins["attrs"]):
                # a body runs `trips` times and its condition is tested once more; a fusion,
                # call, reduction or branch runs once per run of the caller
                factor = {"body": trips or 1, "condition": trips + 1 if trips else 1}.get(key, 1)
                if callee in comps:
                    edges[cname].append((callee, factor, caveat))
    graph = graphlib.TopologicalSorter({c: [e[0] for e in edges[c]] for c in comps})
    runs, caveats = dict.fromkeys(comps, 0), {c: set() for c in comps}
    runs[entry] = 1
    for c in reversed(list(graph.static_order())):  # callers before callees
        if not runs[c]:  # not reached from ENTRY
            continue
        for callee, factor, caveat in edges[c]:
            runs[callee] += runs[c] * factor
            caveats[callee] |= caveats[c] | ({caveat} if caveat else set())
    return runs, caveats


def _compute_between(instrs: list, i: int, comps: dict) -> int | None:
    """Compute ops scheduled between the async start at instrs[i] and its done (an op whose
    operand is the start); None when the done is not in this computation."""
    start = instrs[i][0]
    count = 0
    for name, ins in instrs[i + 1:]:
        if ins["op"].endswith("-done") and start in ins["operands"]:
            return count
        op = ins["op"]
        free = op in _FREE or kind_of(op) or (op.endswith("-done") and kind_of(op[:-5])) or \
            (op in ("async-start", "async-update", "async-done") and
             (op != "async-start" or wrapped_collective(comps, ins) is not None))
        count += not free
    return None


def _op_name(comp: dict, ins: dict, wrapped: dict | None) -> str:
    """jax's op_name of a collective; where XLA left it out (a reduce-scatter it made), its
    first operand's, marked 'operand: '."""
    for i in (ins, wrapped or ins):
        name = attr(i["attrs"], "op_name")
        if name:
            return name
    first = comp["instrs"].get(ins["operands"][0]) if ins["operands"] else None
    name = attr(first["attrs"], "op_name") if first else None
    return f"operand: {name}" if name else ""


def find_collectives(text: str) -> list[Collective]:
    """Every collective of an HLO module text reached from ENTRY, in text order (module
    docstring: the ring model, group sizes, runs, async pairs)."""
    comps, entry, devices = parse_hlo(text), entry_name(text), module_devices(text)
    runs, caveats = runs_per_step(comps, entry)
    out = []
    for cname, comp in comps.items():
        if not runs[cname]:
            continue
        instrs = list(comp["instrs"].items())
        for i, (name, ins) in enumerate(instrs):
            wrapped = wrapped_collective(comps, ins)
            op = (wrapped or ins)["op"]
            kind = kind_of(op)
            if kind is None:  # not a collective, or a -done
                continue
            asynchronous = wrapped is not None or ins["op"].endswith("-start")
            n = group_size((wrapped or ins)["attrs"], devices)
            data = data_bytes(kind, op, (wrapped or ins)["type"], n)
            out.append(Collective(
                name, cname, kind, n, data, ring_bytes(kind, data, n), runs[cname], asynchronous,
                asynchronous and '"is_sync":true' in ins["attrs"],
                _compute_between(instrs, i, comps) if asynchronous else None,
                tuple(sorted(caveats[cname])),
                _op_name(comp, ins, wrapped)))
    return out


def comm_report(text: str, ops: bool = False) -> dict:
    """Per device per step of the module `text`: for each kind its static ops, async ops, runs
    and bytes sent / received (ring model); totals; the async pairs (with compute scheduled
    between start and done, forced synchronous by XLA's backend_config) and the synchronous ops;
    `uncertain`: the collectives under a loop with no known trip count or a conditional. With
    `ops`, also every collective as a dict."""
    found = find_collectives(text)
    by_kind = {}
    for k in KINDS:
        mine = [c for c in found if c.kind == k]
        step = sum(c.bytes_per_step for c in mine)
        by_kind[k] = {"ops": len(mine), "async_ops": sum(c.asynchronous for c in mine),
                      "runs": sum(c.runs for c in mine), "send_bytes": step, "recv_bytes": step}
    pairs = [c for c in found if c.asynchronous]
    out = {"devices": module_devices(text), "model": dict(RING), "by_kind": by_kind,
           "send_bytes": sum(r["send_bytes"] for r in by_kind.values()),
           "recv_bytes": sum(r["recv_bytes"] for r in by_kind.values()),
           "async": {"pairs": len(pairs),
                     "with_compute_between": sum(bool(c.compute_between) for c in pairs),
                     "forced_sync": sum(c.forced_sync for c in pairs),
                     "done_elsewhere": sum(c.compute_between is None for c in pairs)},
           "synchronous": len(found) - len(pairs),
           "uncertain": sorted({f"{c.name}: {u}" for c in found for u in c.uncertain})}
    if ops:
        out["ops"] = [dataclasses.asdict(c) | {"bytes_per_step": c.bytes_per_step}
                      for c in found]
    return out


def collective_counts(text: str) -> dict[str, int]:
    """How many collective ops of each kind the module has (an op in the layer scan, and an
    async pair, count once)."""
    found = find_collectives(text)
    return {k: sum(c.kind == k for c in found) for k in KINDS}


def fsdp_volume(param_bytes: int, n: int) -> float:
    """FSDP's theoretical bytes each device sends (and receives) per step on a group of n:
    the parameters all-gathered for the forward, again for the backward, and the gradients
    reduce-scattered, each param_bytes (n-1)/n by the ring model."""
    return 3 * param_bytes * (n - 1) / n


def format_comm_table(report: dict, param_bytes: int | None = None, group: int | None = None
                      ) -> str:
    """Markdown: one row per kind (ops, async, runs per step, GiB sent = received per device per
    step), the total, FSDP's theoretical volume for `param_bytes` on `group` devices when
    given, then the async line."""
    lines = ["| collective | ops (async) | runs per step | sent = received per device per step |",
             "|---|---|---|---|"]
    for k, r in report["by_kind"].items():
        lines.append(f"| {k} | {r['ops']} ({r['async_ops']}) | {r['runs']} | "
                     f"{r['send_bytes'] / GiB:.2f} GiB |")
    lines.append(f"| **total** | | | **{report['send_bytes'] / GiB:.2f} GiB** |")
    if param_bytes is not None:
        n = group or report["devices"]
        theory = fsdp_volume(param_bytes, n)
        lines.append(f"| FSDP theory: 3 x {param_bytes / GiB:.2f} GiB params x ({n}-1)/{n} | | | "
                     f"{theory / GiB:.2f} GiB ({report['send_bytes'] / theory:.2f}x) |")
    a = report["async"]
    lines += ["", f"async pairs: {a['pairs']}, {a['with_compute_between']} with compute "
                  f"scheduled between start and done, {a['forced_sync']} marked is_sync by XLA, "
                  f"{a['done_elsewhere']} with the done in another computation; synchronous "
                  f"collectives: {report['synchronous']}"]
    lines += [f"uncertain: {u}" for u in report["uncertain"]]
    return "\n".join(lines)


def comm_line(report: dict) -> str:
    """One line for jaxmem.memory's mesh report: bytes sent per device per step, by kind."""
    kinds = ", ".join(f"{k} {r['send_bytes'] / GiB:.2f}" for k, r in report["by_kind"].items()
                      if r["ops"])
    a = report["async"]
    return (f"sent = received per device per step (ring model, loops counted): "
            f"{report['send_bytes'] / GiB:.2f} GiB ({kinds or 'no collectives'}); async pairs "
            f"{a['pairs']}, {a['with_compute_between']} with compute between"
            + (f"; {len(report['uncertain'])} uncertain" if report["uncertain"] else ""))
