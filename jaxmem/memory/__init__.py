"""Where every byte of a train step (and of the whole run) goes, and will it fit
(`python -m jaxmem.memory`); and the memory analysis of any function (`analyze`).

One module per concern; each imports only the ones above it in this list, so there is no cycle:

    residuals   bytes of the residuals jax saves for a backward, from jax's own list
    verdict     header, verdict on 24/40/80/141 GiB, the `jaxmem.train` command of a plan
    analysis    analyze(fn, *args): XLA's memory plan of any jittable function, its residuals
                (not named analyze.py: a submodule would shadow the function of that name)
    spec        StepSpec: one step configuration, and its JSON form for the --measure worker
    analytic    bytes per component and dtype from shapes alone (docs/memory.md)
    compiled    XLA's plan of the real step, compiled ahead of time from abstract shapes
    phases      the whole run: making the state, the step, eval, the sample; the largest decides
    planner     the fastest configuration whose compiled peak fits a budget
    measure     real steps in a child process: the device's peak_bytes_in_use
    report      the --json dict and the tables
    cli         the command line (build_parser, main)

The names below are imported on first use (module `__getattr__`), so `from jaxmem.memory import
analyze` loads jax and the three modules above spec, not jaxmem's trainer (spec and below
import jaxmem.train).
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS = {
    "analyze": "jaxmem.xla.analysis", "MemoryAnalysis": "jaxmem.xla.analysis",
    "Residual": "jaxmem.xla.residuals",
    "analytic_breakdown": "analytic", "rule_of_thumb": "analytic",
    "argument_bytes": "compiled", "compile_step": "compiled", "compiled_stats": "compiled",
    "grad_step_report": "compiled",
    "measure_available": "measure", "measure_here": "measure",
    "measure_in_subprocess": "measure",
    "SampleShape": "phases", "run_phases": "phases",
    "candidates": "search", "plan": "search",
    "format_plan": "report", "format_report": "report", "step_report": "report",
    "GiB": "spec", "StepSpec": "spec",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name] if "." in _EXPORTS[name]
                                                    else f"jaxmem.memory.{_EXPORTS[name]}"), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'jaxmem.memory' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
