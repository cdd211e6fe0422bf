"""Where every byte of a train step (and of the whole run) goes, and will it fit
(`python -m jaxmem.memory`).

One module per concern; each imports only the ones above it in this list, so there is no cycle:

    spec        StepSpec: one step configuration, and its JSON form for the --measure worker
    analytic    bytes per component and dtype from shapes alone (docs/memory.md)
    compiled    XLA's plan of the real step, compiled ahead of time from abstract shapes
    residuals   bytes of the residuals jax saves for a backward, from jax's own list
    phases      the whole run: making the state, the step, eval, the sample; the largest decides
    planner     the fastest configuration whose compiled peak fits a budget
    measure     real steps in a child process: the device's peak_bytes_in_use
    report      the --json dict and the tables
    cli         the command line (build_parser, main)
"""

from jaxmem.memory.analytic import analytic_breakdown, rule_of_thumb
from jaxmem.memory.compiled import argument_bytes, compile_step, compiled_stats, grad_step_report
from jaxmem.memory.measure import measure_available, measure_here, measure_in_subprocess
from jaxmem.memory.phases import SampleShape, run_phases
from jaxmem.memory.planner import candidates, plan
from jaxmem.memory.report import format_plan, format_report, step_report
from jaxmem.memory.spec import GiB, StepSpec

__all__ = ["GiB", "StepSpec", "analytic_breakdown", "argument_bytes", "candidates",
           "compile_step", "compiled_stats", "format_plan", "format_report", "grad_step_report",
           "measure_available", "measure_here", "measure_in_subprocess", "plan", "rule_of_thumb",
           "run_phases", "SampleShape", "step_report"]
