"""The memory reports of one configuration: a dict for `--json` (`step_report`), the tables
people read, and the `python -m jaxmem.train` command of a plan. Only formatting and assembly
live here; every number comes from jaxmem.memory.analytic, .compiled and .measure."""

from __future__ import annotations

import shlex

import jax

from jaxmem import target
from jaxmem.config.run import RunConfig, all_paths, field_metadata, flag_names
from jaxmem.memory.analytic import analytic_breakdown, rule_of_thumb
from jaxmem.memory.compiled import compile_step
from jaxmem.memory.seconds import format_seconds, seconds_report
from jaxmem.memory.spec import StepSpec
from jaxmem.memory.transfers import format_transfers, transfer_plan


def step_report(spec: StepSpec, compiled: dict | None = None,
                measured: dict | None = None) -> dict:
    """Analytic, compiled, measured and rule-of-thumb numbers for one configuration, each rule
    of thumb with its ratio to the measured peak, else the compiled one.

    compiled: `compile_step(spec)`'s result when the caller has it (the planner does);
    measured: `measure_in_subprocess(spec)`'s, or None (not measured).
    """
    analytic = analytic_breakdown(spec)
    compiled = compiled if compiled is not None else compile_step(spec)
    ref_name, ref = "compiled", compiled["peak_bytes"]
    if measured and measured.get("peak_bytes"):
        ref_name, ref = "measured", measured["peak_bytes"]
    c = spec.model
    return {
        "backend": target.platform(), "compiler": target.compiler(),
        "jax_version": jax.__version__, "precision": spec.precision.name,
        "remat": str(spec.remat), "batch_size": spec.batch_size, "seq_len": spec.seq_len,
        "grad_accum": spec.grad_accum, "global_batch": spec.batch_size * spec.grad_accum,
        "objective": spec.objective.flags(), "rows": spec.rows,
        "mu_dtype": spec.mu_dtype, "num_layers": c.num_layers, "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size, "params": analytic["params"], "analytic": analytic,
        "compiled": {k: int(v) for k, v in compiled.items() if k.endswith("_bytes")},
        "flops": compiled.get("flops", float("nan")),
        "analytic_over_compiled": analytic["total_bytes"] / compiled["peak_bytes"],
        "measured": measured or {"peak_bytes": None, "note": "not measured (pass --measure)"},
        "rule_of_thumb": {k: {"bytes": v, f"ratio_to_{ref_name}": v / ref}
                          for k, v in rule_of_thumb(analytic["params"]).items()},
        "transfers": transfer_plan(spec),
        "time": seconds_report(spec, compiled.get("time")),
    }


def format_report(r: dict, unit: str | None = None) -> str:
    """A readable table; works for both `step_report` and `grad_step_report` dicts.

    unit: "GiB" or "MiB" (default: GiB, as --fit and the verdict use, or MiB for a step whose
    compiled peak is under 1 GiB: tiny models).
    """
    c = r["compiled"]
    unit = unit or ("GiB" if c["peak_bytes"] >= 2**30 else "MiB")
    div, digits = (2**30, 3) if unit == "GiB" else (2**20, 1)
    _mb = lambda n: f"{n / div:,.{digits}f} {unit}"  # noqa: E731
    rows = [("compiled by", r.get("compiler") or f"{r['backend']} (jax {r['jax_version']})")]
    if "precision" in r:
        rows += [("precision", r["precision"]), ("mu dtype", r["mu_dtype"] or "param dtype")]
    rows += [("remat", r["remat"]), ("batch x seq", f"{r['batch_size']} x {r['seq_len']}")]
    if "grad_accum" in r:
        rows += [("grad accum", f"{r['grad_accum']} (global batch {r['global_batch']})")]
    rows += [("params", f"{r['params']:,}")]
    lines = []
    if "analytic" in r:
        a = r["analytic"]
        lines += ["", f"analytic (attention: {a['attention']}; peak in the {a['peak_phase']} phase;"
                  f" * = live at the peak)", f"  {'component':<52}{'dtype':<16}{unit:>12}"]
        lines += [f"{'*' if x['in_peak'] else ' '} {x['name']:<52}{x['dtype']:<16}"
                  f"{_mb(x['bytes'])[:-4]:>12}" for x in a["components"] if x["bytes"]]
        lines += [f"  {'total (the peak phase)':<68}{_mb(a['total_bytes'])[:-4]:>12}"]
        if a.get("host_bytes"):  # offloaded state or base: never part of the device peak
            lines += [f"  {'host memory (pinned; not in the device peak)':<68}"
                      f"{_mb(a['host_bytes'])[:-4]:>12}"]
    lines += ["", "compiled (XLA memory_analysis, full train step)" if "analytic" in r else
              "compiled (XLA memory_analysis, gradient of the loss)"]
    lines += [f"  {k:<44}{_mb(c[k + '_bytes']):>18}"
              for k in ("temp", "argument", "output", "alias", "peak")]
    if c.get("host_bytes"):  # --remat offload: residuals in pinned host memory
        lines += [f"  {'host memory (offloaded; not in the peak)':<44}{_mb(c['host_bytes']):>18}"]
    if r["flops"] == r["flops"]:  # XLA's cost_analysis: None in a deviceless compile (nan)
        lines += [f"  {'flops (XLA cost_analysis)':<44}{r['flops']:>18.4g}"]
    if "analytic" in r:
        lines += [f"  {'analytic / compiled':<44}{r['analytic_over_compiled']:>18.3f}"]
        m = r["measured"]
        lines += ["", "measured", f"  {_mb(m['peak_bytes']) if m.get('peak_bytes') else m['note']}"]
        lines += ["", "rule of thumb (same model)"]
        for k, v in r["rule_of_thumb"].items():
            (ratio_key, ratio), = [(x, y) for x, y in v.items() if x.startswith("ratio")]
            lines += [f"  {k:<34}{_mb(v['bytes']):>16}  {ratio:6.2f}x {ratio_key[9:]}"]
    if r.get("transfers"):
        lines += [""] + format_transfers(r["transfers"])
    if r.get("time"):
        lines += [""] + format_seconds(r["time"])
    elif "analytic" in r:
        lines += ["", "predicted time: none for a CPU program (pass --target CARD: the time "
                      "model reads the card's own compiled step)"]
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"{k:<{width}}  {v}" for k, v in rows] + lines)


def format_plan(result: dict, budget_gib: float, timed: bool = False) -> str:
    """One line per candidate `plan` tried, in order, with its verdict (and its predicted tok/s
    where the step's time is predicted: `timed`)."""
    if timed:
        head = ("for each remat policy (none > dots_no_batch > names > full+untiled > full > "
                "offload) the largest micro-batch that fits (then mu fp32 > bf16); the fastest "
                "predicted is chosen")
    else:
        head = ("candidates in a fixed order, the first that fits chosen (micro-batch desc, "
                "then remat none > dots_no_batch > names > full+untiled > full > offload, then "
                "mu fp32 > bf16; no predicted time without a card: --target)")
    lines = [f"planner: budget {budget_gib:g} GiB; {head}"]
    chosen = result.get("chosen")
    for t in result["tried"]:
        seconds = ((t.get("compiled") or {}).get("time") or {}).get("seconds")
        tokens = t["batch_size"] * t["grad_accum"] * t["seq_len"]
        speed = f"; predicted {tokens / seconds:,.0f} tok/s" if seconds and t["fits"] else ""
        mark = "CHOSE" if chosen is not None and t is chosen else "FITS " if t["fits"] else "no   "
        lines.append(f"  {mark} micro {t['batch_size']:>4} x accum {t['grad_accum']:>3}  remat "
                     f"{t['remat']:<40} mu {str(t['mu_dtype']):<5} {t['reason']}{speed}")
    return "\n".join(lines)


def header_line(cfg: RunConfig, spec: StepSpec, params: int) -> str:
    """Two lines: model and params, precision, remat; optimizer and batch."""
    return (f"jaxmem.memory: {cfg.model.preset} ({params:,} params), precision "
            f"{spec.precision.name}, remat {spec.remat}\n  optimizer {spec.optimizer} (mu "
            f"{spec.mu_dtype or 'param dtype'}), batch {spec.batch_size} x {spec.seq_len} tokens, "
            f"grad accum {spec.grad_accum} (global batch {spec.batch_size * spec.grad_accum})"
            + objective_line(cfg, spec))


def objective_line(cfg: RunConfig, spec: StepSpec) -> str:
    """A preference objective's line: pairs, rows and where its reference comes from."""
    obj = spec.objective
    if obj.rows_per_example == 1:
        return ""
    ref = cfg.objective.resolved_reference(bool(cfg.peft.lora_rank))
    where = {None: "no reference", "adapters": "reference: the frozen base with the adapters "
             "off (a second forward, no second copy of any weight)",
             "precompute": "reference: precomputed before training (no reference weights)"}[ref]
    return (f"\n  objective {obj.name}: the batch counts pairs, {spec.rows} sequences per "
            f"micro-batch (chosen + rejected); {where}")


def train_command(cfg: RunConfig) -> str:
    """`python -m jaxmem.train` with a flag for every field of `cfg` that differs from the
    default (run-directory fields aside)."""
    args, base = ["python", "-m", "jaxmem.train"], RunConfig()
    for path in all_paths():
        md, value = field_metadata(path), cfg.get(path)
        if md["cli"] and not path.startswith("run.") and value != base.get(path):
            flag = flag_names(path)[0]
            args += [flag] if md["store_true"] else [flag, str(value)]
    return shlex.join(args)
