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
import json
import math
import re

from jaxmem.xla.collectives import kind_of, ring_bytes, group_size
from jaxmem.xla.hlo import attr, called, direction, entry_name, module_devices, parse_hlo, \
    shape_bytes, tuple_elements

# Kernel classes, in the order reports list them.
CLASSES = ("gemm", "attention", "fusion", "rng", "copy", "host transfer", "collective")
_FREE = {"parameter", "constant", "bitcast", "tuple", "get-tuple-element", "after-all",
         "add-dependency", "opt-barrier", "optimization-barrier", "partition-id", "replica-id",
         "domain"}
_DIMS = re.compile(r"\[([^\]]*)\]")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


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
                "costliest": [dataclasses.asdict(k) | {"total_seconds": k.total}
                              for k in self.costliest(top)]}


def _dims(type_: str) -> list[int]:
    m = _DIMS.search(re.sub(r"\{[^{}]*\}", "", type_))
    return [int(d.lstrip("<=")) for d in m.group(1).split(",") if d.strip()] if m else []


def _dtype(type_: str) -> str:
    return type_.strip("( ").split("[", 1)[0]


def _ints(text: str | None) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text or "")]


def _dot_flops(ins: dict, instrs: dict) -> tuple[float, bool]:
    """(FLOPs, fp8) of a dot: 2 x |result| x the lhs's contracted sizes."""
    lhs = instrs.get(ins["operands"][0], {}).get("type", "") if ins["operands"] else ""
    contracted = math.prod(_dims(lhs)[i] for i in _ints(attr(ins["attrs"], "lhs_contracting_dims"))
                           if i < len(_dims(lhs)))
    return 2.0 * math.prod(_dims(ins["type"])) * contracted, _dtype(lhs).startswith("f8")


def _gemm_call_flops(ins: dict, instrs: dict) -> tuple[float, bool]:
    """A cuBLAS custom call's FLOPs from its backend_config's dot_dimension_numbers."""
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins["attrs"])
    lhs = instrs.get(ins["operands"][0], {}).get("type", "") if ins["operands"] else ""
    dims = _dims(lhs)
    contracted = math.prod(dims[i] for i in _ints(m.group(1) if m else "") if i < len(dims))
    out = tuple_elements(ins["type"])[0]
    return 2.0 * math.prod(_dims(out)) * contracted, _dtype(lhs).startswith("f8")


def _attention_flops(ins: dict, instrs: dict) -> float:
    """cuDNN flash attention: 4 B N T S H forward (= 4 |q| S), x 2.5 backward, x 1/2 causal;
    S is the last of the score matrix's dimensions (`intermediate_tensor_shape`: B N T S)."""
    m = re.search(r'"intermediate_tensor_shape":\s*\{[^}]*?"dimensions":\s*\[([^\]]*)\]',
                  ins["attrs"])
    s = _ints(m.group(1))[-1] if m and _ints(m.group(1)) else 0
    q = _dims(instrs.get(ins["operands"][0], {}).get("type", "")) if ins["operands"] else []
    flops = 4.0 * math.prod(q) * s if q else 0.0
    flops *= 2.5 if "Backward" in (attr(ins["attrs"], "custom_call_target") or "") else 1
    return flops / 2 if re.search(r'"mask_type":\s*"CAUSAL"', ins["attrs"]) else flops


def _fused_bytes(ins: dict, instrs: dict, fused: dict | None) -> float:
    """Device bytes a fusion reads and writes: an operand read only through dynamic-slices
    counts their slices, the buffer of an in-place dynamic-update-slice counts nothing and the
    result then only the update."""
    types = [instrs.get(o, {}).get("type", "") for o in ins["operands"]]
    if fused is None:
        return sum(shape_bytes(t) for t in types) + shape_bytes(ins["type"])
    body = fused["instrs"]
    params = {name: int(i["operands"][0]) if i["operands"] else 0  # parameter(N): operand N
              for name, i in body.items() if i["op"] == "parameter"}
    users: dict[str, list] = {n: [] for n in params}
    for name, i in body.items():
        for pos, o in enumerate(i["operands"]):
            if o in users:
                users[o].append((i, pos))
    read = 0.0
    in_place_update = 0.0
    for pname, index in params.items():
        full = shape_bytes(types[index]) if index < len(types) else shape_bytes(body[pname]["type"])
        uses = users[pname]
        if uses and all(u["op"] in ("dynamic-slice", "slice", "gather") and pos == 0
                        for u, pos in uses):
            read += min(full, sum(shape_bytes(u["type"]) for u, _ in uses))
        elif uses and all(u["op"] == "dynamic-update-slice" and pos == 0 for u, pos in uses):
            in_place_update += sum(shape_bytes(body[u["operands"][1]]["type"])
                                   for u, _ in uses if len(u["operands"]) > 1)
        else:
            read += full
    root = body.get(fused["root"], {})
    written = in_place_update if root.get("op") in ("dynamic-update-slice", "tuple", "bitcast") \
        and in_place_update else shape_bytes(ins["type"])
    return read + written


def _fusion_cost(ins: dict, instrs: dict, comps: dict) -> tuple[str, float, float, bool]:
    """(class, FLOPs, bytes, fp8) of a fusion: a GEMM where it holds a dot or a convolution,
    else a memory-bound kernel (rng where jax's random bits made it)."""
    callee = next((c for k, c in called(ins["attrs"]) if k == "calls"), None)
    fused = comps.get(callee)
    flops, fp8 = 0.0, False
    if fused:
        for i in fused["instrs"].values():
            if i["op"] == "dot":
                f, f8 = _dot_flops(i, fused["instrs"])
                flops, fp8 = flops + f, fp8 or f8
    nbytes = _fused_bytes(ins, instrs, fused)
    name = attr(ins["attrs"], "op_name") or ""
    klass = "gemm" if flops else "rng" if re.search(r"random|threefry|rng", name) else "fusion"
    return klass, flops, nbytes, fp8


def _gemm_waves(ins_type: str, sms: int) -> float:
    """The share of the card's SMs a GEMM's 128 x 128 output tiles keep busy over its waves."""
    dims = _dims(tuple_elements(ins_type)[0])
    if len(dims) < 2:
        return 1.0
    tiles = math.prod(dims[:-2]) * math.ceil(dims[-2] / 128) * math.ceil(dims[-1] / 128)
    return tiles / (math.ceil(tiles / sms) * sms)


def _kernel(ins: dict, instrs: dict, comps: dict, m: Machine, eff: Efficiency
            ) -> tuple[str, float, float, float]:
    """(class, seconds, FLOPs, bytes) of one synchronous kernel."""
    op = ins["op"]
    target = attr(ins["attrs"], "custom_call_target") or ""
    fp8 = False
    if op == "fusion":
        klass, flops, nbytes, fp8 = _fusion_cost(ins, instrs, comps)
    elif op == "custom-call" and "fmha" in target:
        klass, flops = "attention", _attention_flops(ins, instrs)
        nbytes = sum(shape_bytes(instrs.get(o, {}).get("type", "")) for o in ins["operands"]) \
            + shape_bytes(ins["type"])
    elif op == "custom-call" and ("gemm" in target or "matmul" in target):
        (flops, fp8), klass = _gemm_call_flops(ins, instrs), "gemm"
        nbytes = sum(shape_bytes(instrs.get(o, {}).get("type", "")) for o in ins["operands"]) \
            + shape_bytes(tuple_elements(ins["type"])[0])
    elif op == "dot":
        (flops, fp8), klass = _dot_flops(ins, instrs), "gemm"
        nbytes = sum(shape_bytes(instrs.get(o, {}).get("type", "")) for o in ins["operands"]) \
            + shape_bytes(ins["type"])
    elif op in ("rng-bit-generator", "rng"):
        klass, flops, nbytes = "rng", 0.0, shape_bytes(ins["type"])
    else:  # copies, slices, reductions, sorts, scatters, other custom calls: memory-bound
        klass = "copy" if op in ("copy", "dynamic-slice", "dynamic-update-slice", "slice",
                                 "concatenate", "transpose", "pad") else "fusion"
        flops, nbytes = 0.0, _fused_bytes(ins, instrs, None) if op != "dynamic-update-slice" \
            else 2 * shape_bytes(instrs.get(ins["operands"][1], {}).get("type", ""))
    peak = (m.fp8_flops if fp8 and m.fp8_flops else m.flops) * (
        eff.attention if klass == "attention" else eff.gemm)
    if klass == "gemm":
        peak *= _gemm_waves(ins["type"], m.sms)
    seconds = eff.launch_s + max(flops / peak if flops else 0.0, nbytes / (m.hbm * eff.memory))
    return klass, seconds, flops, nbytes


def _transfer(ins: dict, start_type: str, done_type: str | None, instrs: dict, devices: int,
              comps: dict, m: Machine, eff: Efficiency) -> tuple[str, str, float, float] | None:
    """(class, engine, seconds, bytes) of an asynchronous start, or of a synchronous host copy;
    None where the op moves nothing between memories or devices."""
    wrapped = None
    if ins["op"] == "async-start":
        callee = next((c for k, c in called(ins["attrs"]) if k == "calls"), None)
        comp = comps.get(callee)
        wrapped = comp["instrs"][comp["root"]] if comp and comp["root"] else None
    op = (wrapped or ins)["op"]
    kind = kind_of(op)
    if kind:
        n = group_size((wrapped or ins)["attrs"], devices)
        out = tuple_elements((wrapped or ins)["type"])
        data = shape_bytes(out[-1] if op.endswith("-start") and len(out) > 1 else out[0])
        data = data * n if kind == "reduce-scatter" else data
        nbytes = ring_bytes(kind, data, n)
        bw = m.interconnect * eff.interconnect
        return "collective", "net", (nbytes / bw if bw else 0.0) + 10e-6, nbytes
    moved = direction(done_type or start_type,
                      [instrs.get(o, {}).get("type", "") for o in ins["operands"]])
    if moved is None:
        return None
    engine, nbytes = moved[0].lower(), moved[1]
    return "host transfer", engine, nbytes / (m.host_link * eff.link), nbytes


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
                moved = _transfer(ins, ins["type"], instrs[done]["type"] if done else None,
                                  instrs, self.devices, self.comps, self.m, self.eff)
                if moved is None:  # an async wrapper of compute: run it on the stream
                    now += self._compute(name, ins, instrs, runs)
                    continue
                klass, engine, secs, nbytes = moved
                begin = max(now, engines.get(engine, 0.0))
                engines[engine] = pending[name] = begin + secs
                self.kernels.append(Kernel(name, klass, secs, runs, 0.0, nbytes,
                                           attr(ins["attrs"], "op_name") or ""))
            else:
                moved = _transfer(ins, ins["type"], None, instrs, self.devices, self.comps,
                                  self.m, self.eff) if op in ("copy", "fusion", "dynamic-slice",
                                                              "dynamic-update-slice") or \
                    kind_of(op) else None
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
        klass, secs, flops, nbytes = _kernel(ins, instrs, self.comps, self.m, self.eff)
        self.kernels.append(Kernel(name, klass, secs, runs, flops, nbytes,
                                   attr(ins["attrs"], "op_name") or ""))
        return secs


def step_time(text: str, machine: Machine, efficiency: Efficiency = Efficiency()) -> StepTime:
    """The predicted time of one run of the module `text` on `machine` (module docstring)."""
    w = _Walker(text, machine, efficiency)
    seconds = w.run(w.entry, 1)
    busy = dict.fromkeys(CLASSES, 0.0)
    for k in w.kernels:
        busy[k.klass] += k.total
    return StepTime(seconds, busy, w.kernels, machine, efficiency, tuple(w.unknown_loops))


def dumps(t: StepTime) -> str:
    return json.dumps(t.to_dict())
