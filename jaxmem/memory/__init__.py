"""Where every byte of a train step (and of the whole run) goes, and will it fit
(`python -m jaxmem.memory`); and the memory analysis of any function (`analyze`, from
jaxmem.xla: the readers of XLA's own answers, a block under the model).

One module per concern; each imports only the ones above it in this list, so there is no cycle:

    spec        StepSpec: one step configuration, and its JSON form for the --measure worker
    counted     every argument of a step counted leaf by leaf on the program's abstract values,
                per device under the placement's shardings; typed components (Kind, Where)
    activations the one formula: the saved activations and the MLP backward, per remat policy
    analytic    analytic_breakdown(spec, mesh): counted components + activations, the peak
    compiled    compile_phase(name, spec, mesh): XLA's plan of a program of the run
    phases      the whole run: import, making the state, the step, eval, the sample
    search      one search; --fit, --fit --devices and --fit-seq are its generators
    mesh        the per-device report (--mesh)
    measure     real steps in a child process: the device's peak_bytes_in_use
    report      the --json dict and the tables
    commands    the modes of the command line; cli parses and dispatches to them

The names below are imported on first use (module `__getattr__`), so `from jaxmem.memory import
analyze` loads jax and jaxmem.xla, not jaxmem's trainer (spec and below import jaxmem.train).
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
