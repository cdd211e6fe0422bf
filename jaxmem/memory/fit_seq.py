"""`--fit-seq GIB`: the longest sequence whose run fits a GPU of GIB GiB.

The peak of every phase grows with the sequence length T (activations, the batch, the loss
chunks; the weights and optimizer state do not), so the longest T that fits is found by search on
compiled peaks, as `--fit` searches the micro-batch: from the given `--seq-len` (rounded to the
granule), double T while the run fits, then bisect between the last length that fits and the
first that does not, to the granule (1024 tokens). Each length is one compile of the step and,
with `--compile`, of the run's other phases (the state and sample programs do not depend on T:
compiled once); the largest phase decides, by `jaxmem.xla.verdict.usable_bytes`, the rule of
the verdict and `--fit`. The search stops at the model's `max_position_embeddings` (RoPE
positions beyond it are not trained: `--max-position-embeddings` raises it).

On a mesh (`--devices N --mesh ...`, context parallelism's `context=N` above all) each length
is one compile of the step for the mesh (jaxmem.memory.mesh.compile_per_device) and its
per-device peak decides; the other phases are not compiled there (they do not depend on T).
"""

from __future__ import annotations

import dataclasses

from jaxmem.memory.compiled import compile_step
from jaxmem.memory.spec import GiB, StepSpec

GRANULE = 1024


def _round(t: int, granule: int) -> int:
    return max(granule, t // granule * granule)


def fit_seq(spec: StepSpec, budget_bytes: int, phases_fn, granule: int = GRANULE,
            compile_fn=compile_step, log=None) -> dict:
    """The longest multiple of `granule` tokens per sequence (batch and everything else as in
    `spec`) whose largest phase fits `budget_bytes`.

    phases_fn(spec, step_compiled) -> jaxmem.memory.phases.run_phases' dict.
    Returns {"chosen": entry or None, "limit": "memory" | "max_position_embeddings", "tried":
    [entry]}, each entry {seq_len, peak_bytes (the run's largest phase), peak_phase,
    step_peak_bytes, host_bytes, fits, reason}.
    """
    cap = spec.model.max_position_embeddings
    granule = min(granule, cap)
    tried: dict[int, dict] = {}

    def fits(t: int) -> bool:
        if t not in tried:
            tried[t] = _measure(dataclasses.replace(spec, seq_len=t), budget_bytes, phases_fn,
                                compile_fn)
            if log:
                log(tried[t])
        return tried[t]["fits"]

    top = _round(cap, granule)
    good, bad = _search(fits, min(_round(spec.seq_len, granule), top), top, granule)
    return {"chosen": tried[good] if good is not None else None,
            "limit": "max_position_embeddings" if good == top and bad is None else "memory",
            "max_position_embeddings": cap, "granule": granule,
            "tried": [tried[k] for k in tried]}


def _measure(s: StepSpec, budget_bytes: int, phases_fn, compile_fn) -> dict:
    """One length's entry: its step compiled, the run's largest phase against the budget (a
    compile error: it does not fit)."""
    entry = {"seq_len": s.seq_len}
    try:
        step = compile_fn(s)
    except Exception as e:  # noqa: BLE001  (a compile error: this length does not fit)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        entry.update(fits=False, peak_bytes=None, reason=f"compile error: {msg[:200]}")
        return entry
    phases = phases_fn(s, step)
    peak = int(phases["peak_bytes"])
    fits = peak <= budget_bytes
    entry.update(fits=fits, peak_bytes=peak, peak_phase=phases["peak_phase"],
                 step_peak_bytes=int(step["peak_bytes"]),
                 host_bytes=int(step.get("host_bytes", 0)), reason=(
                     f"{phases['peak_phase']} {peak / GiB:.3f} GiB "
                     f"{'<=' if fits else '>'} budget {budget_bytes / GiB:.3f} GiB"))
    return entry


def _search(fits, t: int, top: int, granule: int) -> tuple[int | None, int | None]:
    """(longest length found to fit, shortest found not to), multiples of `granule` up to `top`:
    from `t`, double while it fits (or halve until it does), then bisect to the granule."""
    if fits(t):  # double while it fits
        good, bad = t, None
        while bad is None and good < top:
            t = min(good * 2, top)
            if fits(t):
                good = t
            else:
                bad = t
    else:  # halve until it fits
        good, bad = None, t
        while good is None and bad > granule:
            t = _round(bad // 2, granule)
            if fits(t):
                good = t
            else:
                bad = t
    while good is not None and bad is not None and bad - good > granule:  # bisect
        t = _round((good + bad) // 2, granule)
        if fits(t):
            good = t
        else:
            bad = t
    return good, bad


def format_fit_seq(result: dict, budget_gib: float) -> list[str]:
    """The lines `python -m jaxmem.memory --fit-seq` prints."""
    lines = [f"longest sequence for a {budget_gib:g} GiB GPU (multiples of {result['granule']} "
             f"tokens; the run's largest phase decides):"]
    for e in sorted(result["tried"], key=lambda e: e["seq_len"]):
        host = f", host {e['host_bytes'] / GiB:.2f} GiB" if e.get("host_bytes") else ""
        lines.append(f"  {e['seq_len']:>9,} tokens: {e['reason']}{host}")
    c = result["chosen"]
    if c is None:
        lines.append(f"nothing fits: not even {result['granule']} tokens")
    else:
        lines.append(f"chosen: --seq-len {c['seq_len']} ({c['peak_phase']} "
                     f"{c['peak_bytes'] / GiB:.2f} GiB)")
        if result["limit"] == "max_position_embeddings":
            lines.append(f"  limited by the model's max_position_embeddings "
                         f"({result['max_position_embeddings']:,}), not by memory: "
                         f"--max-position-embeddings N searches further")
    return lines


def run(spec: StepSpec, sample, budget_gib: float, compile_phases: bool, as_json: bool,
        log=None, mesh_text: str | None = None) -> int:
    """`--fit-seq GIB` of the CLI: search, print (a table or JSON); 1 when nothing fits.
    mesh_text: the resolved mesh (per-device step peaks) or None (one device)."""
    import json  # noqa: PLC0415
    if mesh_text is not None:
        from jaxmem.memory.mesh import compile_per_device  # noqa: PLC0415
        from jaxmem.xla.verdict import usable_bytes  # noqa: PLC0415
        result = fit_seq(spec, usable_bytes(budget_gib),
                         lambda s, step: {"peak_bytes": step["peak_bytes"],
                                          "peak_phase": f"step per device ({mesh_text})"},
                         compile_fn=lambda s: compile_per_device(s, mesh_text), log=log)
        result["mesh"] = mesh_text
        if as_json:
            print(json.dumps({"budget_gib": budget_gib, "usable_bytes": usable_bytes(budget_gib),
                              **result}, indent=2))
        else:
            print("\n".join(format_fit_seq(result, budget_gib)))
        return 0 if result["chosen"] else 1

    from jaxmem.memory.phases import run_phases  # noqa: PLC0415
    from jaxmem.xla.verdict import usable_bytes  # noqa: PLC0415
    cache: dict = {}

    def phases(s, step):
        for k in [k for k in cache if k[0] == "eval"]:  # eval depends on T: not reused
            del cache[k]
        return run_phases(s, sample, compile_phases, step, cache=cache)

    result = fit_seq(spec, usable_bytes(budget_gib), phases, log=log)
    if as_json:
        print(json.dumps({"budget_gib": budget_gib, "usable_bytes": usable_bytes(budget_gib),
                          **result}, indent=2))
    else:
        print("\n".join(format_fit_seq(result, budget_gib)))
    return 0 if result["chosen"] else 1
