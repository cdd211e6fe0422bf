"""Where every byte of a train step (and of the whole run) goes, and will it fit
(`python -m jaxmem.memory`); and the memory analysis of any function (`analyze`, from
jaxmem.xla: the readers of XLA's own answers, a block under the model).

One module per concern (docs/architecture.md lists them), each importing only those before it:
spec, counted, activations, analytic, compiled, phases, search, mesh, measure, report,
commands, layered, cli. The names below are imported on first use (module `__getattr__`), so `from
jaxmem.memory import analyze` loads jax and jaxmem.xla, not jaxmem's trainer.
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it (jaxmem.memory's own modules by their short name)
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
        module = _EXPORTS[name]
        value = getattr(importlib.import_module(
            module if "." in module else f"jaxmem.memory.{module}"), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'jaxmem.memory' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
