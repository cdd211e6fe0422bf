"""A compiled program's time on a card, read from its optimized, scheduled HLO text: each kernel
costed from its own shapes and the card's facts, the overlap taken from the program's schedule.

    t = step_time(compiled.as_text(), machine)     # Machine: the card's facts
    t.seconds, t.by_class, t.kernels               # the step, per kernel class, per kernel

Why the HLO text: XLA's `cost_analysis()` answers None in a deviceless GPU compile (jax 0.10.2,
shared/DESIGN.md), and even where it answers it gives FLOPs and bytes of the whole program, not
of each kernel, and counts a loop body once. The text has every kernel the card will launch, in
the order its stream runs them (`is_scheduled=true`), with loop trip counts.

Each kernel (a fusion, a custom call, an unfused op) takes

    launch + max(flops / (peak x efficiency x waves), bytes / (HBM bandwidth x memory efficiency))

- flops: a dot's 2 x |result| x |contracted dims| (inside a GEMM fusion, or a cuBLAS custom
  call by its `dot_dimension_numbers`); cuDNN flash attention 4 B N T S H forward (two GEMMs),
  2.5 times that backward (five), halved under a causal mask (the blocks above the diagonal are
  skipped). An fp8 GEMM (f8 operands) runs at the card's fp8 peak.
- waves: a GEMM is cut in 128 x 128 output tiles spread over the card's SMs; the last wave's
  idle SMs are lost: tiles / (ceil(tiles / SMs) x SMs). The card's SM count, not a fitted number.
- bytes: what the kernel reads and writes in device memory. A fused parameter read only through
  a dynamic-slice counts the slice; a dynamic-update-slice writes its update into the donated
  buffer in place and counts the update, not the buffer (a layer scan writes one layer of its
  stacked result per trip).
- A copy between host (`S(5)`) and device memory runs on the host link; a collective on the
  interconnect, by the ring model of jaxmem.xla.collectives.

Overlap: the compute stream runs the kernels one after another. An asynchronous pair (copy /
fusion / collective / async start ... done) starts its transfer on its own engine (host to
device, device to host, and the interconnect each run one transfer at a time) when the start is
reached, and the done waits for it; the kernels scheduled between them run meanwhile. A while
loop runs its body `known_trip_count` times (a prefetch started in one trip and waited for in the
next bounds each trip by the slower of the two), a conditional its costliest branch.

The efficiency constants (`Efficiency`) are global, one set for every card and program; each is
argued where it is defined. What the model does not see: autotuning's choices (the deviceless
compile keeps default Triton tilings; a real card autotunes, which is why a GEMM is costed by
its FLOPs, not by its tiling), L2 cache reuse, clock throttling, the host's own time between
steps.
"""

from __future__ import annotations

import dataclasses
import re

from jaxmem.xla.collectives import kind_of
from jaxmem.xla.hlo import MOVES, attr, called, entry_name, module_devices, parse_hlo
from jaxmem.xla.kernels import Efficiency, Machine, kernel, transfer

__all__ = ["CLASSES", "Efficiency", "Kernel", "Machine", "StepTime", "step_time", "trip_count"]

CLASSES = ("gemm", "attention", "fusion", "rng", "copy", "host transfer", "collective")
_FREE = {"parameter", "constant", "bitcast", "tuple", "get-tuple-element", "after-all",
         "add-dependency", "opt-barrier", "optimization-barrier", "partition-id", "replica-id",
         "domain"}
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of the program, with its count per step."""

    name: str
    klass: str        # one of CLASSES
    seconds: float    # one run
    runs: int         # per step
    flops: float      # one run
    bytes: float      # one run (device memory, or the link / interconnect)
    op_name: str      # jax's op_name: where in the program it comes from
    arithmetic: float = 0.0  # one run's lane cycles at the full issue rate, s (jaxmem.xla.alu)

    @property
    def arithmetic_beyond(self) -> float:
        """Seconds per step its counted arithmetic would add, were it the kernel's bound."""
        return max(0.0, self.arithmetic - self.seconds) * self.runs

    @property
    def total(self) -> float:
        return self.seconds * self.runs


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A program's predicted time: the critical path in `seconds`; `busy` per kernel class (a
    class's kernels summed, overlapped or not); `kernels` every kernel with its runs."""

    seconds: float
    busy: dict
    kernels: list
    machine: Machine
    efficiency: Efficiency
    unknown_loops: tuple = ()  # whiles counted once: no trip count could be read

    def costliest(self, n: int = 10) -> list[Kernel]:
        merged = {}
        for k in self.kernels:  # one kernel reached from several call sites: summed
            merged[k.name] = dataclasses.replace(
                k, runs=merged[k.name].runs + k.runs) if k.name in merged else k
        return sorted(merged.values(), key=lambda k: -k.total)[:n]

    def to_dict(self, top: int = 10) -> dict:
        return {"seconds": self.seconds, "busy_seconds": self.busy,
                "exposed_transfer_seconds": max(0.0, self.seconds - sum(
                    v for c, v in self.busy.items() if c not in ("host transfer", "collective"))),
                "machine": dataclasses.asdict(self.machine),
                "efficiency": dataclasses.asdict(self.efficiency),
                "unknown_loops": list(self.unknown_loops),
                "arithmetic_beyond_seconds": sum(k.arithmetic_beyond for k in self.kernels),
                "costliest": [dataclasses.asdict(k) | {"total_seconds": k.total}
                              for k in self.costliest(top)]}


def _scalar(name: str, instrs: dict, comps: dict, depth: int = 0) -> int | None:
    """The integer a scalar operand holds: a constant through copies and bitcasts; of a fusion
    (a bound the program computes, such as the skipped-step guard's select between N and 0)
    the largest integer constant it can take."""
    ins = instrs.get(name)
    if ins is None or depth > 8:
        return None
    if ins["op"] == "constant" and ins["operands"]:
        return int(ins["operands"][0]) if re.fullmatch(r"-?\d+", ins["operands"][0]) else None
    if ins["op"] in ("copy", "bitcast", "convert") and ins["operands"]:
        return _scalar(ins["operands"][0], instrs, comps, depth + 1)
    if ins["op"] == "fusion":
        fused = comps.get(next((c for k, c in called(ins["attrs"]) if k == "calls"), ""))
        values = [int(i["operands"][0]) for i in (fused or {"instrs": {}})["instrs"].values()
                  if i["op"] == "constant" and i["type"].startswith("s32[]")
                  and i["operands"] and re.fullmatch(r"-?\d+", i["operands"][0])]
        return max(values) if values else None
    return None


def trip_count(ins: dict, instrs: dict, comps: dict) -> int | None:
    """A while's trips: XLA's `known_trip_count`, else read from its condition `i < n` with i's
    and n's initial values in the caller (n computed at run time: its largest value); None where
    neither says."""
    trip = _TRIP.search(ins["attrs"])
    if trip:
        return int(trip[1])
    cond = comps.get(next((c for k, c in called(ins["attrs"]) if k == "condition"), ""))
    init = instrs.get(ins["operands"][0]) if ins["operands"] else None
    if not cond or not init or init["op"] != "tuple":
        return None
    root = cond["instrs"][cond["root"]]
    if root["op"] == "fusion":  # the compare wrapped in a fusion of its own
        inner = comps.get(next((c for k, c in called(root["attrs"]) if k == "calls"), ""))
        if not inner or "direction=LT" not in inner["instrs"][inner["root"]]["attrs"]:
            return None
    elif root["op"] != "compare" or "direction=LT" not in root["attrs"]:
        return None
    bounds = []
    for operand in root["operands"][:2]:
        o = cond["instrs"].get(operand, {})
        if o.get("op") == "get-tuple-element":
            index = int(attr(o["attrs"], "index") or 0)
            bounds.append(_scalar(init["operands"][index], instrs, comps)
                          if index < len(init["operands"]) else None)
        else:
            bounds.append(_scalar(operand, cond["instrs"], comps))
    if len(bounds) != 2 or bounds[1] is None:
        return None
    return max(0, bounds[1] - (bounds[0] or 0))


class _Walker:
    """Runs the schedule: the compute stream's clock, each engine's, the kernels seen."""

    def __init__(self, text: str, m: Machine, eff: Efficiency):
        self.comps, self.m, self.eff = parse_hlo(text), m, eff
        self.devices = module_devices(text)
        self.kernels: list[Kernel] = []
        self.unknown_loops: list[str] = []  # whiles counted once: no trip count could be read
        self.entry = entry_name(text)

    def run(self, cname: str, runs: int) -> float:
        """Seconds of one run of computation `cname` (run `runs` times per step)."""
        comp = self.comps[cname]
        instrs = comp["instrs"]
        done_of = {i["operands"][0]: n for n, i in instrs.items()
                   if i["op"].endswith("-done") and i["operands"]}
        now, engines, pending = 0.0, {}, {}
        for name, ins in instrs.items():
            op = ins["op"]
            if op in _FREE or op.endswith("-update"):
                continue
            if op == "while":
                trips = trip_count(ins, instrs, self.comps)
                if trips is None:
                    self.unknown_loops.append(name)
                    trips = 1
                body = next(c for k, c in called(ins["attrs"]) if k == "body")
                cond = next(c for k, c in called(ins["attrs"]) if k == "condition")
                now += trips * self.run(body, runs * trips) + \
                    (trips + 1) * self.run(cond, runs * (trips + 1))
            elif op == "conditional":
                now += self._costliest_branch([c for _, c in called(ins["attrs"])], runs)
            elif op == "call":
                now += sum(self.run(c, runs) for k, c in called(ins["attrs"]) if k == "to_apply")
            elif op.endswith("-done"):
                now = max(now, pending.pop(ins["operands"][0], now) if ins["operands"] else now)
            elif op.endswith("-start"):
                done = done_of.get(name)
                moved = transfer(ins, ins["type"], instrs[done]["type"] if done else None,
                                 instrs, self.devices, self.comps, self.m, self.eff)
                if moved is None:  # an async wrapper of compute: run it on the stream
                    if op == "fusion-start" and done:  # jax 0.11's XLA: a fusion made async,
                        # its result the done's (the start's tuple also holds the operands)
                        ins = {**ins, "op": "fusion", "type": instrs[done]["type"]}
                    now += self._compute(name, ins, instrs, runs)
                    continue
                klass, engine, secs, nbytes = moved
                begin = max(now, engines.get(engine, 0.0))
                engines[engine] = pending[name] = begin + secs
                self.kernels.append(Kernel(name, klass, secs, runs, 0.0, nbytes,
                                           attr(ins["attrs"], "op_name") or ""))
            else:
                moves = op in MOVES or kind_of(op)
                moved = transfer(ins, ins["type"], None, instrs, self.devices, self.comps,
                                 self.m, self.eff) if moves else None
                if moved is not None:  # synchronous: the stream waits for it
                    klass, engine, secs, nbytes = moved
                    begin = max(now, engines.get(engine, 0.0))
                    now = engines[engine] = begin + secs
                    self.kernels.append(Kernel(name, klass, secs, runs, 0.0, nbytes,
                                               attr(ins["attrs"], "op_name") or ""))
                else:
                    now += self._compute(name, ins, instrs, runs)
        return max([now, *engines.values()])

    def _costliest_branch(self, branches: list[str], runs: int) -> float:
        """A conditional: its costliest branch's time, and only that branch's kernels kept."""
        best = (0.0, [])
        for cname in branches:
            before = len(self.kernels)
            secs = self.run(cname, runs)
            best = max(best, (secs, self.kernels[before:]), key=lambda b: b[0])
            del self.kernels[before:]
        self.kernels += best[1]
        return best[0]

    def _compute(self, name: str, ins: dict, instrs: dict, runs: int) -> float:
        klass, secs, flops, nbytes, arith = kernel(ins, instrs, self.comps, self.m, self.eff)
        self.kernels.append(Kernel(name, klass, secs, runs, flops, nbytes,
                                   attr(ins["attrs"], "op_name") or "", arith))
        return secs


def step_time(text: str, machine: Machine, efficiency: Efficiency = Efficiency()) -> StepTime:
    """The predicted time of one run of the module `text` on `machine` (module docstring)."""
    w = _Walker(text, machine, efficiency)
    seconds = w.run(w.entry, 1)
    busy = dict.fromkeys(CLASSES, 0.0)
    for k in w.kernels:
        busy[k.klass] += k.total
    return StepTime(seconds, busy, w.kernels, machine, efficiency, tuple(w.unknown_loops))
