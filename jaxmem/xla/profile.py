"""A measured profile beside the time model: the kernels of a `jax.profiler` trace, by HLO
instruction, against jaxmem.xla.timing's prediction for the same program.

    kernels = kernel_times(trace_dir, module="train_step")   # {hlo_op: Measured}
    rows = by_class(kernels, predicted, steps)                # measured vs predicted per class
    top = costliest(kernels, predicted, steps, 30)

The trace is the Perfetto JSON that `jax.profiler.start_trace(dir, create_perfetto_trace=True)`
writes (`jaxmem.train --profile DIR`): XLA tags each kernel's event with its `hlo_module` and
`hlo_op` (the instruction's name in the optimized HLO). On a GPU the device's events (processes
named `/device:GPU:N`, CUPTI's kernel timings) are read; where there are none (XLA:CPU), the
host threads' thunk events are. A kernel's class is the predicted one of the instruction of the
same name, so the classes compare directly; an instruction the prediction does not know (a
program other than the one predicted) is "unmatched".
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from pathlib import Path

from jaxmem.xla.timing import CLASSES, StepTime


@dataclasses.dataclass(frozen=True)
class Measured:
    """One HLO instruction's kernels in the trace: total seconds and how many ran."""

    seconds: float
    count: int


def trace_file(directory) -> Path:
    """The newest Perfetto trace under `directory` (jax writes plugins/profile/<time>/)."""
    found = sorted(Path(directory).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}")
    return found[-1]


def kernel_times(directory, module: str = "train_step") -> dict[str, Measured]:
    """{hlo_op: Measured} of the events of modules whose name contains `module`, the device's
    where the trace has device events, else the host's (module docstring)."""
    with gzip.open(trace_file(directory), "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    tagged = [e for e in events if e.get("ph") == "X" and module in
              (e.get("args") or {}).get("hlo_module", "") and (e.get("args") or {}).get("hlo_op")]
    device = [e for e in tagged if procs.get(e["pid"], "").startswith("/device:")]
    out: dict[str, list] = {}
    for e in device or tagged:
        op = e["args"]["hlo_op"]
        if _CONTAINER.match(op):  # a loop's or call's host event spans its kernels' events
            continue
        out.setdefault(op, [0.0, 0])
        out[op][0] += float(e.get("dur", 0.0)) * 1e-6  # microseconds
        out[op][1] += 1
    return {op: Measured(s, n) for op, (s, n) in out.items()}


_CONTAINER = re.compile(r"^(while|conditional|call)(\.|$)")


def _norm(name: str) -> str:
    return re.sub(r"[^0-9a-z]+", "_", name.lower()).strip("_")


def classes(predicted: StepTime) -> dict[str, str]:
    """{instruction name (normalized): its predicted class}."""
    return {_norm(k.name): k.klass for k in predicted.kernels}


def by_class(measured: dict[str, Measured], predicted: StepTime, steps: int) -> list[dict]:
    """Per kernel class: measured seconds per step (the trace's total over `steps`) beside the
    predicted busy seconds; "unmatched" for instructions the prediction does not have."""
    known = classes(predicted)
    got = dict.fromkeys((*CLASSES, "unmatched"), 0.0)
    for op, m in measured.items():
        got[known.get(_norm(op), "unmatched")] += m.seconds / steps
    return [{"class": c, "measured_s": got[c], "predicted_s": predicted.busy.get(c, 0.0)}
            for c in got if got[c] or predicted.busy.get(c)]


def costliest(measured: dict[str, Measured], predicted: StepTime, steps: int,
              n: int = 30) -> list[dict]:
    """The `n` instructions with the most measured time per step, each with its predicted
    seconds per step (its kernel's time x runs; None where the prediction lacks it)."""
    pred: dict[str, tuple] = {}
    for k in predicted.kernels:
        s, runs, klass = pred.get(_norm(k.name), (0.0, 0, k.klass))
        pred[_norm(k.name)] = (s + k.total, runs + k.runs, klass)
    top = sorted(measured.items(), key=lambda kv: -kv[1].seconds)[:n]
    return [{"hlo_op": op, "class": pred.get(_norm(op), (0, 0, "unmatched"))[2],
             "measured_s": m.seconds / steps, "runs": m.count / steps,
             "predicted_s": pred[_norm(op)][0] if _norm(op) in pred else None,
             "predicted_runs": pred[_norm(op)][1] if _norm(op) in pred else None}
            for op, m in top]


def markdown(rows: list[dict], top: list[dict]) -> str:
    """The two tables: by class, and the costliest instructions."""
    out = ["| class | measured s/step | predicted s/step | predicted / measured |",
           "|---|---|---|---|"]
    out += [f"| {r['class']} | {r['measured_s']:.4f} | {r['predicted_s']:.4f} | "
            + (f"{r['predicted_s'] / r['measured_s']:.2f} |" if r["measured_s"] else "n/a |")
            for r in rows]
    out += ["", "| instruction | class | measured s/step | runs/step | predicted s/step |",
            "|---|---|---|---|---|"]
    out += [f"| {t['hlo_op']} | {t['class']} | {t['measured_s']:.5f} | {t['runs']:g} | "
            + (f"{t['predicted_s']:.5f} |" if t["predicted_s"] is not None else "n/a |")
            for t in top]
    return "\n".join(out)
