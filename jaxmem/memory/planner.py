"""The planner: the fastest train-step configuration whose *compiled* peak fits a memory budget.

    candidates(base, global_batch)   every configuration for the global batch, fastest first
    plan(base, global_batch, budget) the first candidate whose compiled peak <= budget (never one
                                     that does not), with every rejected candidate and why

The decision is on XLA's compiled peak (jaxmem.memory.compiled.compile_step), not on the analytic
model: the formula explains a peak, the compiler's plan is what the device will be asked for.
"""

from __future__ import annotations

import dataclasses

from jaxmem.memory.compiled import argument_bytes, compile_step
from jaxmem.memory.spec import GiB, StepSpec
from jaxmem.model.remat import RematError, RematPolicy, check_offload_supported

# The selective policy the planner tries between dots_no_batch and full: keep the projections
# that feed attention and the MLP's two wide inputs (docs/remat.md measures it).
PLANNER_NAMES = "names:query,key,value,mlp_gate,mlp_up"


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
    micros = [b for b in range(global_batch, 0, -1)
              if global_batch % b == 0 and (max_micro is None or b <= max_micro)]
    return [dataclasses.replace(base, batch_size=b, grad_accum=global_batch // b,
                                remat=RematPolicy.parse(r), mu_dtype=m)
            for b in micros for r in remat_candidates() for m in mu_dtypes]


def plan(base: StepSpec, global_batch: int, budget_bytes: int, mu_dtypes=("fp32", "bf16"),
         max_micro: int | None = None, compile_fn=compile_step, log=None) -> dict:
    """Try candidates in order; return the first whose compiled peak <= budget, and the tries.

    A candidate whose exact argument bytes (state + batch) already exceed the budget is
    rejected without compiling: the compiled peak is never below its arguments.
    """
    tried = []
    for spec in candidates(base, global_batch, mu_dtypes, max_micro):
        entry = {"batch_size": spec.batch_size, "grad_accum": spec.grad_accum,
                 "remat": str(spec.remat), "mu_dtype": spec.mu_dtype}
        args = argument_bytes(spec)
        if args > budget_bytes:
            entry.update(fits=False, peak_bytes=None, reason=(
                f"arguments alone {args / GiB:.3f} GiB > budget {budget_bytes / GiB:.3f} GiB "
                f"(not compiled)"))
        else:
            try:
                compiled = compile_fn(spec)
            except Exception as e:  # a compile error rejects the candidate, with its message
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                entry.update(fits=False, peak_bytes=None, reason=f"compile error: {msg[:200]}")
            else:
                peak = int(compiled["peak_bytes"])
                fits = peak <= budget_bytes
                entry.update(fits=fits, peak_bytes=peak, compiled=compiled, reason=(
                    f"compiled peak {peak / GiB:.3f} GiB {'<=' if fits else '>'} budget "
                    f"{budget_bytes / GiB:.3f} GiB"))
        tried.append(entry)
        if log:
            log(entry)
        if entry["fits"]:
            return {"chosen": entry, "spec": spec, "tried": tried}
    return {"chosen": None, "spec": None, "tried": tried}
