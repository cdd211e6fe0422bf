"""Where every byte of a train step goes, and will it fit (`python -m jaxmem.memory`).

    python -m jaxmem.memory --preset small --precision amp-bf16 --remat full \
        --batch-size 4 --seq-len 512 --grad-accum 2 [--measure] [--json]
    python -m jaxmem.memory --preset llama-3.2-1b --seq-len 2048 --fit 40 --global-batch 16

Breakdown mode prints, for one configuration of the full train step (optimizer included, state
donated), three views of its memory and the rule of thumb:

    analytic      bytes per component and dtype from shapes alone (jaxmem.memory.planner, docs/memory.md)
    compiled      XLA's memory_analysis() of the step compiled ahead of time from abstract shapes
                  (nothing allocated): temp, argument, output, alias, peak = temp+arg+out-alias
    measured      with --measure, peak_bytes_in_use of the device after real steps, one
                  subprocess per configuration (skipped with a note where the backend has no
                  memory stats, as on CPU)
    rule of thumb 4 / 2 / 1 bytes per parameter for fp32 / 16-bit / int8 weights, 16 B/param for
                  mixed-precision Adam, "6x the fp32 weights" = 24 B/param; each with its ratio
                  to the compiled (or measured) peak

`--fit GIB --global-batch N` runs the planner instead (jaxmem.memory.planner.plan): candidates from
fastest to most frugal, the first whose *compiled* peak fits is printed with its breakdown, with
every rejected candidate and why; exit 1 when nothing fits.

`grad_step_report` (the gradient of the loss alone, fp32) stays for the remat measurements.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax

import os
import subprocess

from jaxmem.config.model import (ConfigError, ModelConfig, add_model_args, model_config_from_args,
                           positive_int)
from jaxmem.train.loss import abstract_batch, lm_loss
from jaxmem.model.llama import Llama, abstract_params, count_params
from jaxmem.train.precision import PRECISIONS, get_precision
from jaxmem.model.remat import VALID_POLICIES, RematError, RematPolicy


def compiled_stats(compiled) -> dict:
    """XLA's memory and cost numbers for a compiled executable, as a plain dict."""
    mem = compiled.memory_analysis()
    stats = {
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
    }
    stats["peak_bytes"] = (stats["temp_bytes"] + stats["argument_bytes"] + stats["output_bytes"]
                           - stats["alias_bytes"])
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax returns one dict per computation
        cost = cost[0] if cost else {}
    return stats, float((cost or {}).get("flops", float("nan")))


def grad_step_report(config: ModelConfig, remat: RematPolicy | str, batch_size: int,
                     seq_len: int) -> dict:
    """Compile value_and_grad of the loss (fp32) ahead of time and report its memory and FLOPs."""
    remat = RematPolicy.parse(remat)
    model = Llama(config, remat)
    params = abstract_params(config)
    step = jax.jit(jax.value_and_grad(lambda p, b: lm_loss(model, p, b)))
    compiled = step.lower(params, abstract_batch(batch_size, seq_len)).compile()
    stats, flops = compiled_stats(compiled)
    return {
        "backend": jax.default_backend(),
        "jax_version": jax.__version__,
        "remat": str(remat),
        "batch_size": batch_size,
        "seq_len": seq_len,
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "params": count_params(params),
        "compiled": stats,
        "flops": flops,
    }


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def measure_available() -> str | None:
    """None if the device reports peak memory; otherwise why it cannot be measured here."""
    device = jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some runtimes raise instead of returning None
        stats = None
    if not stats or "peak_bytes_in_use" not in stats:
        return (f"not measured: the {device.platform} backend reports no memory stats "
                f"(peak_bytes_in_use needs a GPU)")
    return None


def measure_in_subprocess(child_argv: list[str], timeout: float = 1800) -> dict:
    """Run real steps of one configuration in a fresh process and read its device peak."""
    note = measure_available()
    if note:
        return {"peak_bytes": None, "note": note}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    p = subprocess.run([sys.executable, "-m", "jaxmem.memory", *child_argv, "--measure-child"],
                       capture_output=True, text=True, env=env, timeout=timeout)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"peak_bytes": None, "note": f"measurement failed (exit {p.returncode}): {last}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def measure_here(spec, steps: int = 3) -> dict:
    """Allocate the state, run `steps` real train steps, report peak_bytes_in_use (child side)."""
    from jaxmem.train.loss import synthetic_batch
    from jaxmem.train.loss_scale import parse_loss_scale
    from jaxmem.train.step import create_train_state, jit_train_step
    cfg = spec.step_config()
    state = create_train_state(cfg, loss_scale=parse_loss_scale(spec.precision.loss_scale))
    step = jit_train_step(cfg)
    keys = jax.random.split(jax.random.PRNGKey(1), spec.grad_accum)
    parts = [synthetic_batch(k, spec.batch_size, spec.seq_len, spec.model.vocab_size) for k in keys]
    batch = jax.tree_util.tree_map(lambda *xs: jax.numpy.stack(xs), *parts)
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    stats = jax.devices()[0].memory_stats() or {}
    return {"peak_bytes": int(stats["peak_bytes_in_use"]), "steps": steps,
            "note": f"peak_bytes_in_use after {steps} steps, own process"}


def step_report(spec, compiled: dict | None = None, measured: dict | None = None) -> dict:
    """Analytic, compiled, measured and rule-of-thumb numbers for one configuration."""
    from jaxmem.memory.planner import analytic_breakdown, compile_step, rule_of_thumb
    analytic = analytic_breakdown(spec)
    compiled = compiled if compiled is not None else compile_step(spec)
    ref_name, ref = "compiled", compiled["peak_bytes"]
    if measured and measured.get("peak_bytes"):
        ref_name, ref = "measured", measured["peak_bytes"]
    c = spec.model
    return {
        "backend": jax.default_backend(),
        "jax_version": jax.__version__,
        "precision": spec.precision.name,
        "remat": str(spec.remat),
        "batch_size": spec.batch_size,
        "seq_len": spec.seq_len,
        "grad_accum": spec.grad_accum,
        "global_batch": spec.batch_size * spec.grad_accum,
        "mu_dtype": spec.mu_dtype,
        "num_layers": c.num_layers,
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "params": analytic["params"],
        "analytic": analytic,
        "compiled": {k: int(v) for k, v in compiled.items() if k != "flops"},
        "flops": compiled.get("flops", float("nan")),
        "analytic_over_compiled": analytic["total_bytes"] / compiled["peak_bytes"],
        "measured": measured or {"peak_bytes": None, "note": "not measured (pass --measure)"},
        "rule_of_thumb": {k: {"bytes": v, f"ratio_to_{ref_name}": v / ref}
                          for k, v in rule_of_thumb(analytic["params"]).items()},
    }


def format_report(r: dict) -> str:
    """A readable table; works for both `step_report` and `grad_step_report` dicts."""
    c = r["compiled"]
    rows = [("backend", f"{r['backend']} (jax {r['jax_version']})")]
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
                  f" * = live at the peak)", f"  {'component':<34}{'dtype':<16}{'MiB':>12}"]
        lines += [f"{'*' if x['in_peak'] else ' '} {x['name']:<34}{x['dtype']:<16}"
                  f"{x['bytes'] / 2**20:>12,.1f}" for x in a["components"] if x["bytes"]]
        lines += [f"  {'total (the peak phase)':<50}{a['total_bytes'] / 2**20:>12,.1f}"]
    lines += ["", "compiled (XLA memory_analysis, full train step)" if "analytic" in r else
              "compiled (XLA memory_analysis, gradient of the loss)"]
    lines += [f"  {k:<44}{_mb(c[k + '_bytes']):>18}"
              for k in ("temp", "argument", "output", "alias", "peak")]
    lines += [f"  {'flops':<44}{r['flops']:>18.4g}"]
    if "analytic" in r:
        lines += [f"  {'analytic / compiled':<44}{r['analytic_over_compiled']:>18.3f}"]
        m = r["measured"]
        lines += ["", "measured", f"  {_mb(m['peak_bytes']) if m.get('peak_bytes') else m['note']}"]
        lines += ["", "rule of thumb (same model)"]
        for k, v in r["rule_of_thumb"].items():
            (ratio_key, ratio), = [(x, y) for x, y in v.items() if x.startswith("ratio")]
            lines += [f"  {k:<34}{_mb(v['bytes']):>16}  {ratio:6.2f}x {ratio_key[9:]}"]
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"{k:<{width}}  {v}" for k, v in rows] + lines)


def format_plan(result: dict, budget_gib: float) -> str:
    lines = [f"planner: budget {budget_gib:g} GiB; candidates fastest first "
             f"(micro-batch desc, then remat none > dots_no_batch > names > full > offload, "
             f"then mu fp32 > bf16)"]
    for t in result["tried"]:
        mark = "FITS " if t["fits"] else "no   "
        lines.append(f"  {mark} micro {t['batch_size']:>4} x accum {t['grad_accum']:>3}  "
                     f"remat {t['remat']:<40} mu {t['mu_dtype']:<5} {t['reason']}")
    return "\n".join(lines)


# --- command line ----------------------------------------------------------------------------

def positive_gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of GiB, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxmem.memory",
        description="Where every byte of a train step goes (analytic, compiled ahead of time "
                    "with no allocation, measured on GPU), and a planner for a memory budget.")
    add_model_args(p)
    p.add_argument("--precision", default="fp32", choices=list(PRECISIONS),
                   help="precision mode (jaxmem.train.precision; default fp32)")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="micro-batch size (default 8; with --fit: the largest micro-batch tried)")
    p.add_argument("--seq-len", type=positive_int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--grad-accum", type=positive_int, default=None,
                   help="micro-batches per optimizer step (default 1)")
    p.add_argument("--global-batch", type=positive_int, default=None,
                   help="sequences per optimizer step; sets --grad-accum = global / batch size")
    p.add_argument("--remat", default="none",
                   help=f"remat policy: {', '.join(VALID_POLICIES)} (default none)")
    p.add_argument("--mu-dtype", choices=["fp32", "bf16"], default=None,
                   help="Adam first-moment dtype (default: the params' dtype; --fit tries both)")
    p.add_argument("--fit", type=positive_gib, default=None, metavar="GIB",
                   help="plan: the fastest configuration whose compiled peak fits in GIB GiB")
    p.add_argument("--measure", action="store_true",
                   help="also run real steps in a subprocess and read the device's peak memory")
    p.add_argument("--measure-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _resolve(parser, args):
    """Validated (spec, global batch); exits 2 with a one-line message naming the flag."""
    from jaxmem.memory.planner import StepSpec
    try:
        config = model_config_from_args(args)
        remat = RematPolicy.parse(args.remat)
        if remat.kind == "offload":
            remat.jax_policy()  # raises a clear error where the backend cannot offload
    except (ConfigError, RematError) as e:
        parser.error(str(e))
    if args.seq_len > config.max_position_embeddings:
        parser.error(f"--seq-len {args.seq_len} exceeds the model's max_position_embeddings "
                     f"{config.max_position_embeddings}")
    batch = args.batch_size or 8
    accum = args.grad_accum or 1
    if args.global_batch is not None:
        if args.global_batch % batch and (args.batch_size or args.fit is None):
            parser.error(f"--global-batch {args.global_batch} is not divisible by "
                         f"--batch-size {batch}")
        if args.grad_accum is not None and args.global_batch != batch * args.grad_accum:
            parser.error(f"--global-batch {args.global_batch} != --batch-size {batch} x "
                         f"--grad-accum {args.grad_accum}")
        if args.fit is None:
            accum = args.global_batch // batch
    elif args.fit is not None and args.grad_accum is not None:
        parser.error("--fit chooses --grad-accum itself; give --global-batch instead")
    spec = StepSpec(config, get_precision(args.precision), remat, batch, args.seq_len, accum,
                    args.mu_dtype)
    return spec, args.global_batch or batch * accum


def _child_argv(argv: list[str], spec) -> list[str]:
    """The same command for one configuration (later flags override earlier ones)."""
    drop, out, skip = {"--fit", "--global-batch", "--grad-accum"}, [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in drop:
            skip = "=" not in a
            continue
        if name not in ("--measure", "--json"):
            out.append(a)
    out += ["--batch-size", str(spec.batch_size), "--grad-accum", str(spec.grad_accum),
            "--remat", str(spec.remat)]
    return out + (["--mu-dtype", spec.mu_dtype] if spec.mu_dtype else [])


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    spec, global_batch = _resolve(parser, args)
    if args.measure_child:
        print(json.dumps(measure_here(spec)))
        return 0

    if args.fit is None:
        measured = measure_in_subprocess(_child_argv(argv, spec)) if args.measure else None
        report = step_report(spec, measured=measured)
        print(json.dumps(report, indent=2) if args.json else format_report(report))
        return 0

    from jaxmem.memory.planner import GiB, plan
    log = None if args.json else (lambda t: print(f"  tried micro {t['batch_size']} remat "
                                                  f"{t['remat']} mu {t['mu_dtype']}: {t['reason']}",
                                                  file=sys.stderr, flush=True))
    result = plan(spec, global_batch, int(args.fit * GiB),
                  mu_dtypes=(args.mu_dtype,) if args.mu_dtype else ("fp32", "bf16"),
                  max_micro=args.batch_size, log=log)
    chosen = result["spec"]
    out = {"budget_gib": args.fit, "global_batch": global_batch, "tried": [
        {k: v for k, v in t.items() if k != "compiled"} for t in result["tried"]]}
    if chosen is not None:
        measured = measure_in_subprocess(_child_argv(argv, chosen)) if args.measure else None
        out["chosen"] = step_report(chosen, compiled=result["chosen"]["compiled"],
                                    measured=measured)
    else:
        out["chosen"] = None
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(result, args.fit))
        if chosen is not None:
            print(f"\nchosen: micro-batch {chosen.batch_size} x grad-accum {chosen.grad_accum}, "
                  f"remat {chosen.remat}, mu {chosen.mu_dtype}\n")
            print(format_report(out["chosen"]))
    if chosen is None:
        print(f"error: nothing fits in {args.fit:g} GiB for global batch {global_batch} x "
              f"{spec.seq_len} tokens ({len(result['tried'])} candidates tried; smallest "
              f"peak above); try a smaller --seq-len or --global-batch, or another --precision",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
