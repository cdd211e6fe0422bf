"""Seconds as well as bytes: the planner's prediction of a step's time, read from the card's own
compiled step (jaxmem.xla.timing), with tokens per second and MFU.

    card = target.card_here()               # the --target card, or this machine's GPU; else None
    t = predict(compiled_hlo_text, card)    # compile_phase("step") puts this under "time"
    seconds_report(spec, t)                 # + tokens, tok/s, MFU: the report's "time"
    format_seconds(r)                       # the lines the planner prints

MFU is the project's one formula, (6 N + 12 L N H T) x tok/s / the card's dense bf16 peak
(jaxmem.perf.flops_per_token), so a predicted MFU and a measured one compare directly; the
FLOPs the kernels run (recompute included) are printed beside it.
"""

from __future__ import annotations

from jaxmem.memory.spec import StepSpec
from jaxmem.xla.timing import CLASSES, Efficiency, Machine, step_time
from jaxmem.families.params import model_flops


def predict(hlo: str, card, top: int = 10) -> dict:
    """The time model on a compiled program's text for `card`: seconds, busy seconds per kernel
    class, the `top` costliest kernels, the card's facts and the constants used."""
    t = step_time(hlo, Machine.of_card(card), Efficiency())
    kernel_flops = sum(k.flops * k.runs for k in t.kernels)
    return {**t.to_dict(top), "card": card.name, "kernel_flops": kernel_flops,
            "kernels": sum(k.runs for k in t.kernels)}


def seconds_report(spec: StepSpec, time: dict | None) -> dict | None:
    """`time` (predict's) with the step's tokens, tok/s and MFU; None without a prediction."""
    if not time:
        return None
    tokens = spec.rows * spec.seq_len * spec.grad_accum
    per_token = model_flops(spec.model, spec.seq_len)
    peak = time["machine"]["flops"]
    tok_s = tokens / time["seconds"]
    return {**time, "tokens": tokens, "tokens_per_s": tok_s, "flops_per_token": per_token,
            "mfu": per_token * tok_s / peak, "prediction": "predicted from the compiled program "
            "(jaxmem.xla.timing), not measured"}


def format_seconds(r: dict) -> list[str]:
    """The planner's lines for a `seconds_report`."""
    m, e = r["machine"], r["efficiency"]
    lines = [f"predicted time (the {r['card']}'s compiled step, jaxmem.xla.timing: a prediction, "
             f"not a measurement)",
             f"  {'step':<34}{r['seconds']:10.3f} s   {r['tokens']:,} tokens",
             f"  {'tokens/s':<34}{r['tokens_per_s']:10,.0f}",
             f"  {'MFU (6N + 12LNHT, dense bf16 peak)':<34}{r['mfu']:10.1%}",
             f"  {'kernels per step':<34}{r['kernels']:10,}   "
             f"{r['kernel_flops'] / 1e12:.1f} TFLOP run (recompute included)",
             "  busy seconds by kernel class (transfers overlap compute where the schedule lets "
             "them):"]
    lines += [f"    {c:<32}{r['busy_seconds'][c]:10.3f} s" for c in CLASSES
              if r["busy_seconds"][c]]
    beyond = r.get("arithmetic_beyond_seconds", 0.0)
    if beyond > 1e-4:
        lines.append(f"    {'arithmetic beyond these (floor)':<32}{beyond:10.3f} s   not in the "
                     "step: counted lane cycles (jaxmem.xla.alu), unmeasured")
    if r["exposed_transfer_seconds"] > 1e-4:
        lines.append(f"    {'step beyond compute (waiting)':<32}"
                     f"{r['exposed_transfer_seconds']:10.3f} s")
    lines.append(f"  the {len(r['costliest'])} costliest kernels (seconds per step, runs, class, "
                 f"where):")
    lines += [f"    {k['total_seconds']:8.4f} s  x{k['runs']:<5} {k['klass']:<13} {k['name']}  "
              f"{_where(k['op_name'])}" for k in r["costliest"]]
    lines.append(
        f"  assumed: {m['flops'] / 1e12:g} TFLOP/s bf16 ({m['fp8_flops'] / 1e12:g} fp8), HBM "
        f"{m['hbm'] / 1e12:g} TB/s, host link {m['host_link'] / 1e9:g} GB/s, interconnect "
        f"{m['interconnect'] / 1e9:g} GB/s, {m['sms']} SMs; reached: GEMMs {e['gemm']:.0%}, "
        f"attention {e['attention']:.0%}, memory {e['memory']:.0%}, link {e['link']:.0%}, "
        f"launch {e['launch_s'] * 1e6:g} us (docs/results.md: the calibration)")
    if r.get("unknown_loops"):
        lines.append(f"  loops counted once (no trip count read): {', '.join(r['unknown_loops'])}")
    return lines


def _where(op_name: str) -> str:
    """The last three parts of jax's op_name: enough to find the kernel's source."""
    parts = [p for p in op_name.split("/") if p and not p.startswith("jit(")]
    return "/".join(parts[-3:])
