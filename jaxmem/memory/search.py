"""The planner's one search: the fastest configuration whose *compiled* peak fits a budget.

    search(candidates, decide)   try what a generator proposes, in its order, and tell it each
                                 result; {"chosen", "spec", "tried", "compiles"}

`plan` (--fit), `plan_mesh` and `fit_mesh` (--fit --devices) and `fit_seq` (--fit-seq) search
their own generator's candidates (docs/memory.md). Each is decided the cheapest sound way
(`Decider`): its exact argument bytes, its analytic peak x the lowest compiled/analytic ratio
measured (ANALYTIC_BAND) or a floor (a smaller mu dtype: its fp32 sibling's compiled peak less 3
x the moments it saves: the argument, the donated output and the update's new moment) over the
budget rule it out; any other is compiled and its run's largest phase decides. The chosen
candidate is always compiled (or said to be analytic): a wrong rule-out costs only speed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jaxmem.loss.chunked import resolve_loss_chunk
from jaxmem.memory.analytic import analytic_breakdown
from jaxmem.memory.compiled import compile_step
from jaxmem.memory.counted import Kind, Where, count_state
from jaxmem.memory.spec import GiB, StepSpec
from jaxmem.model.remat import RematPolicy, check_offload_supported
from jaxmem.parallel.mesh import AXES, MeshSpec
from jaxmem.remat import RematError

# The selective policy tried between dots_no_batch and full: keep the projections that feed
# attention and the MLP's two wide inputs (docs/remat.md measures it).
PLANNER_NAMES = "names:query,key,value,mlp_gate,mlp_up"

# compiled / analytic peak on the CPU backend: fp32 0.95-1.04 on every preset, 16-bit up to 1.8
# (CPU bf16 keeps fp32 temporaries; docs/memory.md), tiny at 8 x 512 0.890-1.021 over the 15
# candidates of experiments/tables/fit_speed.py. Only the lower end rules candidates out.
ANALYTIC_BAND = (0.88, 1.6)
GRANULE = 1024  # --fit-seq's step in tokens


@dataclass(frozen=True)
class Candidate:
    spec: StepSpec
    mesh: MeshSpec | None = None  # None: one device
    floor: int | None = None  # a lower bound of its compiled peak, known without compiling
    why_floor: str = ""


def search(candidates, decide, log=None, better=None) -> dict:
    """Decide what `candidates` (a generator of Candidate, sent each decided entry) proposes;
    the chosen one is the last that fit (a generator that wants the first stops there), or
    with `better(new, old)` the best of those that fit. log(entry): called with each entry as
    it is decided (progress)."""
    tried, chosen, entry = [], None, None
    try:
        while True:
            cand = candidates.send(entry)  # (the first send(None) starts the generator)
            entry = decide(cand)
            if log:
                log(entry)
            tried.append(entry)
            if entry["fits"] and (chosen is None or better is None or better(entry, chosen[0])):
                chosen = (entry, cand.spec)
    except StopIteration:
        pass
    return {"chosen": chosen and chosen[0], "spec": chosen and chosen[1], "tried": tried,
            "compiles": sum(e["decided_by"] == "compiled" for e in tried)}


def _first_fit(cands):  # a generator that stops at the first candidate that fits
    for c in cands:
        entry = yield c
        if entry["fits"]:
            return


def remat_candidates() -> list[str]:
    """Least recompute first; `full+untiled` (the MLP whole: more memory, no tiles' loop) before
    `full`; offload only where the backend really offloads."""
    out = ["none", "dots_no_batch", PLANNER_NAMES, "full+untiled", "full"]
    try:
        check_offload_supported()
        out.append("offload")
    except RematError:
        pass
    return out


def _grid(base: StepSpec, global_batch: int, max_micro: int | None, shards: int, field: str,
          values, remats=None) -> list[StepSpec]:
    """`base` at each micro-batch (largest first; `shards` divides it) x remat (least recompute
    first; `remats`, default remat_candidates()) x each of values(micro-batch) for `field`, the
    global batch kept by accumulation."""
    out = [base.replace(batch_size=b, grad_accum=global_batch // b, remat=RematPolicy.parse(r),
                        **{field: v})
           for b in range(global_batch, 0, -1) if global_batch % b == 0 and b % shards == 0
           and (max_micro is None or b <= max_micro)
           for r in (remats or remat_candidates()) for v in values(b)]
    return [s for s in out if s.remat.mlp_tiles or _tiles(s)]


def _tiles(spec: StepSpec) -> bool:
    """Whether `spec`'s policy without `+untiled` would run the MLP in tiles (else the two are
    one program, and the `+untiled` candidate is not tried)."""
    return spec.replace(remat=dataclasses.replace(spec.remat, mlp_tiles=True)).footprint.mlp_tile > 0


def candidates(base: StepSpec, global_batch: int, mu_dtypes=("fp32", "bf16"),
               max_micro: int | None = None, remats=None) -> list[StepSpec]:
    """Every configuration `plan` tries, fastest first (micro-batch, remat, mu dtype); one mu
    dtype where the optimizer's state holds no first moment whose dtype --mu-dtype sets
    (adamw8bit's codes and adafactor's)."""
    if _moment_bytes(base.replace(mu_dtype="fp32")) == _moment_bytes(base.replace(mu_dtype="bf16")):
        mu_dtypes = (base.mu_dtype,)
    return _grid(base, global_batch, max_micro, 1, "mu_dtype", lambda b: mu_dtypes, remats)


def by_speed(base: StepSpec, global_batch: int, mu_dtypes=("fp32", "bf16"),
             max_micro: int | None = None, remats=None):
    """--fit's candidates in a fixed order (the first that fits is taken); a smaller mu dtype
    right after its fp32 sibling, which did not fit by its compile, gets that peak less 3 x the
    moments it saves as its floor."""
    last = None
    for spec in candidates(base, global_batch, mu_dtypes, max_micro, remats):
        floor, why = None, ""
        if last is not None and last[0].mu_dtype != spec.mu_dtype and \
                last[0].replace(mu_dtype=spec.mu_dtype) == spec and \
                last[1].get("decided_by") == "compiled" and last[1].get("peak_bytes"):
            saved = _moment_bytes(last[0]) - _moment_bytes(spec)
            floor, why = last[1]["peak_bytes"] - 3 * saved, (
                f"mu {last[0].mu_dtype}'s compiled peak less 3 x the {saved / GiB:.3f} GiB of "
                f"moments saved")
        entry = yield Candidate(spec, floor=floor, why_floor=why)
        if entry["fits"]:
            return
        last = (spec, entry)


def by_time(base: StepSpec, global_batch: int, mu_dtypes=("fp32", "bf16"),
            max_micro: int | None = None):
    """--fit where the step's time is predicted (a card): for each remat policy, the largest
    micro-batch (then mu dtype) that fits, as `by_speed` orders them; the fastest predicted of
    those is chosen (`predicted_faster`), not the first in that fixed order."""
    for remat in remat_candidates():
        yield from by_speed(base, global_batch, mu_dtypes, max_micro, remats=(remat,))


def predicted_seconds(entry: dict) -> float | None:
    """A decided entry's predicted step time (jaxmem.memory.seconds), None where none."""
    return ((entry.get("compiled") or {}).get("time") or {}).get("seconds")


def predicted_faster(new: dict, old: dict) -> bool:
    """Whether `new` is predicted faster than `old` (same global batch: the shorter step)."""
    a, b = predicted_seconds(new), predicted_seconds(old)
    return a is not None and (b is None or a < b)


def _moment_bytes(spec: StepSpec) -> int:
    return sum(c.bytes for c in count_state(spec) if c.kind is Kind.OPTIMIZER)


def mesh_candidates(spec: StepSpec, devices: int) -> list[MeshSpec]:
    """Meshes for `devices`, from the least communication to the least memory per device:
    pure data parallel, then more and more of the devices on fsdp, then tensor=2 with fsdp.
    Only meshes the model and batch can be split by (MeshSpec.check) are listed."""
    out = [MeshSpec(d, devices // d, 1) for d in range(devices, 0, -1) if devices % d == 0]
    ok = []
    for m in out + ([MeshSpec(1, devices // 2, 2)] if devices % 2 == 0 else []):
        try:
            m.check(spec.model, spec.rows)
        except ValueError:
            continue
        ok.append(m)
    return ok


def mesh_candidates_for(base: StepSpec, meshes, global_batch: int,
                        max_micro: int | None = None) -> list[tuple[MeshSpec, StepSpec]]:
    """(mesh, spec) for every mesh x micro-batch x remat x loss chunk, in the order tried: the
    meshes as given, micro-batch (largest first; only those data x fsdp divides), remat, the
    fused loss's chunk: the automatic one (<= 256 MiB of fp32 logits at the local batch), then a
    quarter of it. The step's other settings stay as given."""

    def chunks(mesh, b):
        auto = resolve_loss_chunk(base.loss_chunk, b // mesh.batch_shards, base.seq_len,
                                  base.model)
        return [base.loss_chunk] + ([max(1, auto // 4)] if base.loss_chunk is None and auto > 1
                                    else [])
    return [(mesh, s) for mesh in meshes
            for s in _grid(base, global_batch, max_micro, mesh.batch_shards, "loss_chunk",
                           lambda b: chunks(mesh, b))]


def _round(t: int, granule: int) -> int:
    return max(granule, t // granule * granule)


def by_length(spec: StepSpec, granule: int = GRANULE, mesh: MeshSpec | None = None):
    """--fit-seq: multiples of `granule` up to the model's max positions, from spec.seq_len:
    doubled while it fits (or halved until it does), then bisected; never one length twice."""
    top = _round(spec.model.max_position_embeddings, granule)
    at = lambda t: Candidate(spec.replace(seq_len=t), mesh)  # noqa: E731
    t = min(_round(spec.seq_len, granule), top)
    if (yield at(t))["fits"]:
        good, bad = t, None
        while bad is None and good < top:
            t = min(good * 2, top)
            good, bad = (t, bad) if (yield at(t))["fits"] else (good, t)
    else:
        good, bad = None, t
        while good is None and bad > granule:
            t = _round(bad // 2, granule)
            good, bad = (t, bad) if (yield at(t))["fits"] else (good, t)
    while good is not None and bad is not None and bad - good > granule:
        t = _round((good + bad) // 2, granule)
        good, bad = (t, bad) if (yield at(t))["fits"] else (good, t)


@dataclass
class Decider:
    """How a candidate is decided (see the module docstring). compile_fn(spec, mesh): the
    step's compiled dict, None where not compiled here (the analytic peak decides) or raises (a
    compile error rejects it); analytic_fn(spec, mesh): analytic_breakdown's dict;
    phases_fn(spec, compiled): run_phases' dict (the run's largest phase decides);
    analytic_first False: compile every candidate (`fit_mesh` shows each mesh's peak)."""

    budget: int
    compile_fn: object
    analytic_fn: object = None
    phases_fn: object = None
    analytic_first: bool = True
    band: tuple = ANALYTIC_BAND

    def __call__(self, cand: Candidate) -> dict:
        s, mesh = cand.spec, cand.mesh
        entry = {"mesh": str(mesh) if mesh else None, "batch_size": s.batch_size,
                 "grad_accum": s.grad_accum, "remat": str(s.remat), "mu_dtype": s.mu_dtype,
                 "loss_chunk": s.loss_chunk, "seq_len": s.seq_len, "analytic_bytes": None,
                 "host_bytes": 0}
        budget = f"budget {self.budget / GiB:.3f} GiB"
        no = lambda by, why: {**entry, "fits": False, "peak_bytes": None,  # noqa: E731
                              "decided_by": by, "reason": why}
        a = None
        if self.analytic_first:
            sizes = {} if mesh is None else dict(zip(AXES, mesh.sizes))
            args = sum(c.bytes for c in count_state(s, sizes) if c.where is Where.DEVICE)
            a = self.analytic_fn(s, mesh) if self.analytic_fn else None
            if a is not None:
                entry.update(analytic_bytes=int(a["total_bytes"]), host_bytes=int(a["host_bytes"]))
            if args > self.budget:
                return no("arguments", f"arguments alone {args / GiB:.3f} GiB > {budget} (not "
                                       "compiled)")
            if a is not None and a["total_bytes"] * self.band[0] > self.budget:
                return no("analytic", f"analytic {a['total_bytes'] / GiB:.3f} GiB x "
                          f"{self.band[0]} (lowest compiled/analytic measured) > {budget} (not "
                          "compiled)")
            if cand.floor is not None and cand.floor > self.budget:
                return no("floor", f"at least {cand.floor / GiB:.3f} GiB ({cand.why_floor}) > "
                                   f"{budget} (not compiled)")
        try:
            compiled = self.compile_fn(s, mesh)
        except Exception as e:  # noqa: BLE001  (a compile error rejects the candidate)
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return no("compiled", f"compile error: {msg[:200]}")
        if compiled is None:  # not compiled here: the analytic figure decides
            a = a or self.analytic_fn(s, mesh)
            peak = int(a["total_bytes"])
            entry.update(analytic_bytes=peak, host_bytes=int(a["host_bytes"]),
                         decided_by="analytic", peak_bytes=peak, run_peak_bytes=peak)
            what = "analytic (not compiled here)"
        else:
            # the device's peak: arguments in pinned host memory are not on the device
            peak = int(compiled.get("device_peak_bytes", compiled["peak_bytes"]))
            entry.update(decided_by="compiled", peak_bytes=peak, run_peak_bytes=peak,
                         compiled=compiled, host_bytes=int(compiled.get(
                             "host_argument_bytes", compiled.get("host_bytes", 0)) or 0))
            what = "compiled peak" if mesh is None else "compiled per-device peak"
            if self.phases_fn is not None:  # the largest phase of the run decides
                phases = self.phases_fn(s, compiled)
                entry.update(run_peak_bytes=int(phases["peak_bytes"]),
                             peak_phase=phases["peak_phase"], phases=phases)
                if phases["peak_phase"] != "step":
                    what = f"{phases['peak_phase']} phase ({phases.get('peak_source', '')}) peak"
        fits = entry["run_peak_bytes"] <= self.budget
        return {**entry, "fits": fits, "reason": f"{what} {entry['run_peak_bytes'] / GiB:.3f} "
                                                  f"GiB {'<=' if fits else '>'} {budget}"}


def plan(base: StepSpec, global_batch: int, budget_bytes: int, mu_dtypes=("fp32", "bf16"),
         max_micro: int | None = None, compile_fn=None, log=None, analytic_first: bool = True,
         band: tuple[float, float] = ANALYTIC_BAND, phases_fn=None, timed: bool = False) -> dict:
    """--fit: the first of `by_speed`'s candidates whose compiled run fits `budget_bytes`; with
    `timed` (the steps' time is predicted: a card), the fastest predicted of `by_time`'s.
    compile_fn(spec) -> the compiled step (default: jaxmem.memory.compiled.compile_step)."""
    one = compile_fn or compile_step
    decide = Decider(budget_bytes, lambda s, m: one(s), lambda s, m: analytic_breakdown(s),
                     phases_fn, analytic_first, band)
    if timed:
        return search(by_time(base, global_batch, mu_dtypes, max_micro), decide, log,
                      better=predicted_faster)
    return search(by_speed(base, global_batch, mu_dtypes, max_micro), decide, log)


def plan_mesh(base: StepSpec, meshes, global_batch: int, budget_bytes: int, analytic_fn,
              compile_fn, max_micro: int | None = None, log=None,
              band: tuple[float, float] = ANALYTIC_BAND) -> dict:
    """--fit --devices: the first (mesh, micro-batch, remat, loss chunk) whose per-device peak
    fits; compile_fn None (--analytic-only): the analytic peak decides."""
    decide = Decider(budget_bytes, compile_fn or (lambda s, m: None), analytic_fn, band=band)
    return search(_first_fit(Candidate(s, m) for m, s in mesh_candidates_for(
        base, meshes, global_batch, max_micro)), decide, log)


def fit_seq(spec: StepSpec, budget_bytes: int, phases_fn, granule: int = GRANULE,
            compile_fn=None, log=None, mesh: MeshSpec | None = None) -> dict:
    """--fit-seq: the longest multiple of `granule` tokens whose run fits (its largest phase, by
    phases_fn; on a mesh the per-device step). compile_fn(spec) or (spec, mesh)."""
    cap = spec.model.max_position_embeddings
    granule = min(granule, cap)
    one = compile_fn or compile_step
    decide = Decider(budget_bytes, lambda s, m: one(s) if m is None else one(s, m),
                     phases_fn=phases_fn, analytic_first=False)

    def by_phase(cand):  # "<largest phase> X GiB <= budget Y GiB"
        e = decide(cand)
        if e.get("peak_phase"):
            e["reason"] = (f"{e['peak_phase']} {e['run_peak_bytes'] / GiB:.3f} GiB "
                           f"{'<=' if e['fits'] else '>'} budget {budget_bytes / GiB:.3f} GiB")
        return e
    r = search(by_length(spec, granule, mesh), by_phase, log)
    top = _round(cap, granule)
    fit = r["chosen"]
    return {**r, "limit": "max_position_embeddings" if fit and fit["seq_len"] == top and
            not any(not e["fits"] and e["seq_len"] > fit["seq_len"] for e in r["tried"])
            else "memory", "max_position_embeddings": cap, "granule": granule}


def fit_mesh(spec: StepSpec, meshes, budget_bytes: int, compile_fn, log=None) -> dict:
    """--fit --devices for a full fine-tune: the first mesh whose per-device compiled peak
    fits, the step itself (batch, remat, precision) as given."""
    return search(_first_fit(Candidate(spec, m) for m in meshes),
                  Decider(budget_bytes, compile_fn, analytic_first=False), log)
