"""The planner: the fastest train-step configuration whose *compiled* peak fits a memory budget.

    candidates(base, global_batch)   every configuration for the global batch, fastest first
    plan(base, global_batch, budget) the first candidate whose compiled peak <= budget (never one
                                     that does not), with every rejected candidate and why

The decision is on XLA's compiled peak (jaxmem.memory.compiled.compile_step), not on the analytic
model: the formula explains a peak, the compiler's plan is what the device will be asked for.
But a compile costs seconds to minutes (hours summed over 8B-sized candidates), so the analytic
model decides first (analytic-first, the default): a candidate whose analytic peak times the
lower end of the measured error band (ANALYTIC_BAND) is over the budget cannot fit and is
rejected without compiling; every other candidate is compiled, in order, and the first whose
compiled peak fits is chosen. Candidates are tried fastest first, so the search stops there: the
compiles are the undecided candidates before the fit, plus the fit itself (which is always
compiled, so the chosen configuration's compiled estimate is known to be within the budget).

    plan_mesh(base, meshes, global_batch, budget, analytic_fn, compile_fn)
                                     the same search per device over meshes too (`--fit GIB
                                     --devices N` for LoRA runs or with --global-batch)
"""

from __future__ import annotations

import dataclasses

from jaxmem.memory.compiled import argument_bytes, compile_step
from jaxmem.memory.spec import GiB, StepSpec
from jaxmem.model.remat import RematPolicy, check_offload_supported
from jaxmem.remat import RematError

# The selective policy the planner tries between dots_no_batch and full: keep the projections
# that feed attention and the MLP's two wide inputs (docs/remat.md measures it).
PLANNER_NAMES = "names:query,key,value,mlp_gate,mlp_up"


# compiled peak / analytic peak, measured on the CPU backend: fp32 0.95-1.04 on every preset,
# 16-bit 1.0-1.55 (CPU bf16 keeps fp32 temporaries; docs/memory.md's tables), tiny at 8 x 512
# 0.890-1.021 over the 15 candidates of experiments/tables/fit_speed.py (the lowest: full remat);
# 8-bit optimizers only add temporaries the formula leaves out (ratio up, never down). Only the
# lower end rules candidates out, so it is the lowest ratio measured, rounded down; a wrong
# rule-out could only cost speed (a slower candidate chosen), never the budget: the chosen
# candidate is always compiled.
ANALYTIC_BAND = (0.88, 1.6)


def remat_candidates() -> list[str]:
    """Least recompute first; offload only where the backend really offloads."""
    out = ["none", "dots_no_batch", PLANNER_NAMES, "full"]
    try:
        check_offload_supported()
        out.append("offload")
    except RematError:
        pass
    return out


def candidates(base: StepSpec, global_batch: int, mu_dtypes=("fp32", "bf16"),
               max_micro: int | None = None) -> list[StepSpec]:
    """Every configuration for `global_batch`, fastest first.

    Order: micro-batch size (largest first: fewer, fuller steps, no accumulation loop), then
    remat policy (fewest recomputed FLOPs first: none, dots_no_batch, names:..., full, offload),
    then Adam mu dtype (fp32 first; bf16 costs no speed, only moment precision).
    """
    if base.optimizer not in ("adamw", "lion"):  # no first moment whose dtype could change
        mu_dtypes = (base.mu_dtype,)
    micros = [b for b in range(global_batch, 0, -1)
              if global_batch % b == 0 and (max_micro is None or b <= max_micro)]
    return [dataclasses.replace(base, batch_size=b, grad_accum=global_batch // b,
                                remat=RematPolicy.parse(r), mu_dtype=m)
            for b in micros for r in remat_candidates() for m in mu_dtypes]


def plan(base: StepSpec, global_batch: int, budget_bytes: int, mu_dtypes=("fp32", "bf16"),
         max_micro: int | None = None, compile_fn=compile_step, log=None,
         analytic_first: bool = True, band: tuple[float, float] = ANALYTIC_BAND,
         phases_fn=None) -> dict:
    """Try candidates in order; return the first whose compiled peak <= budget, and the tries.

    A candidate whose exact argument bytes (state + batch) already exceed the budget is
    rejected without compiling: the compiled peak is never below its arguments. With
    `analytic_first`, so is one whose analytic peak x band[0] exceeds the budget. Each entry
    says how it was decided ("decided_by": arguments, analytic or compiled), with its analytic
    peak; the result counts the compiles.

    phases_fn(spec, compiled) -> jaxmem.memory.phases.run_phases' dict: the whole run decides,
    not the step alone: a compiled candidate fits when the largest phase (import for LoRA,
    state, step, eval, sample) is within the budget (entry "run_peak_bytes", "peak_phase").

    budget_bytes: what the device may give the run, as `--fit GIB` passes it:
    jaxmem.xla.verdict.usable_bytes(GIB), the rule the verdict judges by (plan_mesh's too).
    """
    from jaxmem.memory.analytic import analytic_breakdown
    tried, compiles = [], 0
    for spec in candidates(base, global_batch, mu_dtypes, max_micro):
        entry = {"batch_size": spec.batch_size, "grad_accum": spec.grad_accum,
                 "remat": str(spec.remat), "mu_dtype": spec.mu_dtype}
        args = argument_bytes(spec)
        analytic = int(analytic_breakdown(spec)["total_bytes"]) if analytic_first else None
        entry["analytic_bytes"] = analytic
        if args > budget_bytes:
            entry.update(fits=False, peak_bytes=None, decided_by="arguments", reason=(
                f"arguments alone {args / GiB:.3f} GiB > budget {budget_bytes / GiB:.3f} GiB "
                f"(not compiled)"))
        elif analytic is not None and analytic * band[0] > budget_bytes:
            entry.update(fits=False, peak_bytes=None, decided_by="analytic", reason=(
                f"analytic {analytic / GiB:.3f} GiB x {band[0]} (lowest compiled/analytic "
                f"measured) > budget {budget_bytes / GiB:.3f} GiB (not compiled)"))
        else:
            compiles += 1
            entry["decided_by"] = "compiled"
            entry.update(_compiled_entry(spec, budget_bytes, compile_fn, phases_fn))
        tried.append(entry)
        if log:
            log(entry)
        if entry["fits"]:
            return {"chosen": entry, "spec": spec, "tried": tried, "compiles": compiles}
    return {"chosen": None, "spec": None, "tried": tried, "compiles": compiles}


def _compiled_entry(spec: StepSpec, budget_bytes: int, compile_fn, phases_fn) -> dict:
    """A candidate decided by its compile: the step's compiled peak, or with `phases_fn` the
    run's largest phase, against the budget (a compile error rejects it, with its message)."""
    try:
        compiled = compile_fn(spec)
    except Exception as e:  # a compile error rejects the candidate, with its message
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return dict(fits=False, peak_bytes=None, reason=f"compile error: {msg[:200]}")
    entry = {}
    peak = int(compiled["peak_bytes"])
    run_peak, what = peak, "compiled peak"
    if phases_fn is not None:  # the largest phase of the run decides
        phases = phases_fn(spec, compiled)
        run_peak = phases["peak_bytes"]
        entry.update(run_peak_bytes=run_peak, peak_phase=phases["peak_phase"], phases=phases)
        if phases["peak_phase"] != "step":
            what = f"{phases['peak_phase']} phase ({phases['peak_source']}) peak"
    fits = run_peak <= budget_bytes
    entry.update(fits=fits, peak_bytes=peak, compiled=compiled, reason=(
        f"{what} {run_peak / GiB:.3f} GiB {'<=' if fits else '>'} budget "
        f"{budget_bytes / GiB:.3f} GiB"))
    return entry


def mesh_candidates_for(base: StepSpec, meshes, global_batch: int,
                        max_micro: int | None = None) -> list[tuple[str, StepSpec]]:
    """(mesh text, spec) for every mesh x micro-batch x remat x loss chunk, in the order tried.

    Order: the meshes as given (jaxmem.memory.mesh.mesh_candidates: least communication
    first), then micro-batch (largest first; only those data x fsdp divides), then remat (fewest
    recomputed FLOPs first), then the fused loss's chunk: the automatic one (<= 256 MiB of fp32
    logits at the local batch), then a quarter of it (less memory, more loop steps). The step's
    other settings (precision, LoRA, --offload-base, the optimizer and its mu dtype) stay as given.
    """
    from jaxmem.loss.chunked import resolve_loss_chunk
    out = []
    for mesh in meshes:
        shards = mesh.data * mesh.fsdp
        micros = [b for b in range(global_batch, 0, -1) if global_batch % b == 0
                  and b % shards == 0 and (max_micro is None or b <= max_micro)]
        for b in micros:
            auto = resolve_loss_chunk(base.loss_chunk, b // shards, base.seq_len, base.model)
            chunks = [base.loss_chunk] + ([max(1, auto // 4)] if base.loss_chunk is None
                                          and auto > 1 else [])
            for r in remat_candidates():
                for chunk in chunks:
                    out.append((str(mesh), dataclasses.replace(
                        base, batch_size=b, grad_accum=global_batch // b,
                        remat=RematPolicy.parse(r), loss_chunk=chunk)))
    return out


def plan_mesh(base: StepSpec, meshes, global_batch: int, budget_bytes: int, analytic_fn,
              compile_fn, max_micro: int | None = None, log=None,
              band: tuple[float, float] = ANALYTIC_BAND) -> dict:
    """The first (mesh, micro-batch, remat, loss chunk) whose per-device compiled peak fits.

    analytic_fn(spec, mesh_text) -> the per-device analytic dict (jaxmem.memory.analytic.
    analytic_breakdown on the mesh: "total_bytes" on the device, "host_bytes"); compile_fn(spec, mesh_text) ->
    the per-device compiled dict ("peak_bytes"), or None where the step is not compiled here
    (compile_fn None: --analytic-only; or one device only): the analytic figure then decides, and
    the entry says so. As `plan`: a candidate whose
    analytic peak x band[0] is over the budget is rejected without compiling; the others are
    compiled in order and the first that fits is chosen. Host bytes (--offload-base host) are
    never part of the device budget; each entry carries them. budget_bytes: as `plan`'s
    (jaxmem.xla.verdict.usable_bytes of the device's size).
    """
    tried, compiles = [], 0
    for mesh_text, spec in mesh_candidates_for(base, meshes, global_batch, max_micro):
        a = analytic_fn(spec, mesh_text)
        entry = {"mesh": mesh_text, "batch_size": spec.batch_size, "grad_accum": spec.grad_accum,
                 "remat": str(spec.remat), "loss_chunk": spec.loss_chunk,
                 "analytic_bytes": int(a["total_bytes"]), "host_bytes": int(a["host_bytes"])}
        if a["total_bytes"] * band[0] > budget_bytes:
            entry.update(fits=False, peak_bytes=None, decided_by="analytic", reason=(
                f"analytic {a['total_bytes'] / GiB:.3f} GiB x {band[0]} > budget "
                f"{budget_bytes / GiB:.3f} GiB (not compiled)"))
        else:
            compiles += compile_fn is not None
            try:
                compiled = compile_fn(spec, mesh_text) if compile_fn is not None else None
            except Exception as e:  # a compile error rejects the candidate, with its message
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                entry.update(fits=False, peak_bytes=None, decided_by="compiled",
                             reason=f"compile error: {msg[:200]}")
            else:
                if compiled is None:
                    peak, what = int(a["total_bytes"]), "analytic (not compiled here)"
                else:
                    peak, what = int(compiled["peak_bytes"]), "compiled per-device peak"
                fits = peak <= budget_bytes
                entry.update(fits=fits, peak_bytes=peak, decided_by=what.split()[0],
                             reason=f"{what} {peak / GiB:.3f} GiB {'<=' if fits else '>'} "
                                    f"budget {budget_bytes / GiB:.3f} GiB")
        tried.append(entry)
        if log:
            log(entry)
        if entry["fits"]:
            return {"chosen": entry, "spec": spec, "tried": tried, "compiles": compiles}
    return {"chosen": None, "spec": None, "tried": tried, "compiles": compiles}
