"""The modes of `python -m jaxmem.memory` (jaxmem.memory.cli parses and dispatches): one
configuration's breakdown and verdict, the per-device breakdown on a mesh, and the searches
(`--fit`, `--fit` over meshes, `--fit-seq`); each prints a table or JSON and returns the exit
status (1: nothing fits)."""

from __future__ import annotations

import json
import sys

from jaxmem import target
from jaxmem.memory.analytic import analytic_breakdown
from jaxmem.memory.compiled import compile_step
from jaxmem.memory.measure import measure_in_subprocess
from jaxmem.memory.mesh import format_mesh_report, mesh_report, resolve
from jaxmem.memory.phases import SampleShape, format_phases, run_phases
from jaxmem.memory.search import fit_mesh as search_fit_mesh, fit_seq as search_fit_seq, \
    mesh_candidates, plan, plan_mesh, predicted_seconds
from jaxmem.memory.report import (format_plan, format_report, header_line, step_report,
                                  train_command)
from jaxmem.memory.spec import GiB, StepSpec
from jaxmem.memory.transfers import transfer_plan
from jaxmem.config.flags import given_overrides
from jaxmem.xla.verdict import COMMON_GIB, usable_bytes, verdict_lines, xla_fraction
from jaxmem.model.remat import RematPolicy
from jaxmem.model.fp8_compile import set_xla_flags


def verdict(report: dict, fit: float | None = None) -> list[str]:
    """The verdict on the run's largest phase (jaxmem.memory.phases), and which one it is; with
    --fit its size is judged too (by `usable_bytes`, the rule the search used)."""
    ph = report["phases"]
    others = ", ".join(
        f"{r['name']} {r['analytic_bytes'] / GiB:.2f}a" if r["compiled_bytes"] is None
        else f"{r['name']} {r['compiled_bytes'] / GiB:.2f}" for r in ph["phases"])
    sizes = COMMON_GIB if fit is None else tuple(sorted({*COMMON_GIB, fit}))
    lines = verdict_lines(ph["peak_bytes"], ph["peak_source"], report["backend"],
                          report["precision"], sizes) + [
        f"  the run's largest phase: {ph['peak_phase']} (GiB: {others}; a = analytic)"]
    host = (report.get("transfers") or {}).get("host_bytes")
    if host:  # --offload-optimizer / --offload-params / --offload-base host
        size = f"{host / GiB:.2f} GiB" if host >= GiB else f"{host / 2**20:.1f} MiB"
        lines.append(f"  host: the run needs {size} of pinned host memory besides (not checked "
                     f"against any machine; the transfers are planned above)")
    return lines


def phases(args, cfg, spec, compiled: dict, measured: dict | None = None, cache=None) -> dict:
    """The run's phases (jaxmem.memory.phases), the step's compiled (and measured) peak given."""
    return run_phases(spec, SampleShape.of(cfg), args.compile, compiled,
                      (measured or {}).get("peak_bytes"), cache)


def progress(args, line):
    """A search's log: `line(entry)` on stderr as each candidate is decided; None with --json."""
    return None if args.json else (lambda e: print(line(e), file=sys.stderr, flush=True))


def without(entry: dict, *keys: str) -> dict:
    return {k: v for k, v in entry.items() if k not in keys}


def plot(parser, path, reports, labels, budget=None) -> None:
    if not path:
        return
    from jaxmem.plot.figure import PlotError, save  # noqa: PLC0415
    from jaxmem.plot.memory import plot_memory  # noqa: PLC0415
    if not reports:
        print("no candidate was compiled: nothing to plot", file=sys.stderr)
        return
    try:
        print(f"wrote {save(plot_memory(reports, labels, budget_gib=budget), path)}",
              file=sys.stderr)
    except PlotError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2)


def fit_mesh_and_step(args, spec, global_batch: int, max_micro: int | None) -> int:
    """`--fit GIB --devices N` with a frozen base or --global-batch: the first mesh x
    micro-batch x remat x loss chunk whose per-device peak fits (search.plan_mesh)."""
    whole = spec.replace(batch_size=global_batch, grad_accum=1)
    here = target.device_count() > 1 and not args.analytic_only
    result = plan_mesh(spec, mesh_candidates(whole, args.devices), global_batch,
                       usable_bytes(args.fit), analytic_fn=analytic_breakdown,
                       compile_fn=compile_step if here else None, max_micro=max_micro,
                       log=progress(args, lambda t: f"  mesh {t['mesh']} micro {t['batch_size']} "
                                    f"remat {t['remat']} loss chunk {t['loss_chunk'] or 'auto'}: "
                                    f"{t['reason']}"))
    tried, c = [without(t, "compiled") for t in result["tried"]], result["chosen"]
    if args.json:
        print(json.dumps({"budget_gib": args.fit, "usable_bytes": usable_bytes(args.fit),
                          "devices": args.devices, "global_batch": global_batch,
                          "tried": tried, "chosen": c and tried[-1]}, indent=2))
    elif c:
        host = f", {c['host_bytes'] / GiB:.3f} GiB on the host" if c["host_bytes"] else ""
        print(f"chosen: mesh {c['mesh']}, micro-batch {c['batch_size']} x grad-accum "
              f"{c['grad_accum']}, remat {c['remat']}, loss chunk {c['loss_chunk'] or 'auto'}: "
              f"{c['reason']}{host}")
    if c is None:
        print(f"error: no mesh, micro-batch, remat or loss chunk of {args.devices} devices fits "
              f"global batch {global_batch} in {args.fit:g} GiB per device "
              f"({len(tried)} tried)", file=sys.stderr)
    return 0 if c else 1


def fit_mesh(args, spec) -> int:
    """`--fit GIB --devices N`: the first mesh whose per-device peak fits (search.fit_mesh)."""
    result = search_fit_mesh(spec, mesh_candidates(spec, target.device_count()),
                             usable_bytes(args.fit), compile_step,
                             log=progress(args, lambda t: f"  mesh {t['mesh']}: {t['reason']}"))
    tried = [{"mesh": t["mesh"], "peak_bytes": t["peak_bytes"], "fits": t["fits"],
              "reason": t["reason"], "collectives": (t.get("compiled") or {}).get("collectives")}
             for t in result["tried"]]
    if args.json:
        print(json.dumps({"chosen": tried[-1] if result["chosen"] else None, "tried": tried},
                         indent=2))
    elif result["chosen"]:
        print(f"chosen mesh: {result['chosen']['mesh']}")
    if result["chosen"] is None:
        print(f"error: no mesh of {args.devices} devices fits this step in {args.fit:g} GiB "
              f"per device", file=sys.stderr)
    return 0 if result["chosen"] else 1


def _search_seq(parser, args, cfg, spec, mesh_text, budget: int) -> dict:
    """search.fit_seq's result within `budget` bytes: on a mesh (--mesh, --devices N) by the
    step's per-device compiled peak, with the mesh named; on one device by the run's phases."""
    log = progress(args, lambda e: f"  {e['seq_len']:,} tokens: {e['reason']}")
    if mesh_text is not None or (args.devices or 1) > 1:  # per device (context=N...)
        try:
            mesh = resolve(spec, mesh_text)
        except ValueError as e:  # MeshError names --mesh
            parser.error(str(e))
        result = search_fit_seq(spec, budget, lambda s, step: {
            "peak_bytes": step["peak_bytes"], "peak_phase": f"step per device ({mesh})"},
            compile_fn=compile_step, log=log, mesh=mesh)
        result["mesh"] = str(mesh)
        return result
    sample, cache = SampleShape.of(cfg), {}

    def run(s, step):
        for k in [k for k in cache if k[0] == "eval"]:  # eval depends on T: not reused
            del cache[k]
        return run_phases(s, sample, args.compile, step, cache=cache)
    return search_fit_seq(spec, budget, run, log=log)


def fit_seq(parser, args, cfg, spec, mesh_text) -> int:
    """`--fit-seq GIB`: the longest sequence that fits (search.fit_seq); on a mesh the step's
    per-device compiled peak decides, on one device the run's largest phase. The answer says
    what it assumed: the micro-batch (1 unless --batch-size was given: cli._resolve) and the
    share of the card XLA may use (`xla_fraction`, the verdict's rule)."""
    if args.fit is not None:
        parser.error("--fit-seq searches the sequence length, --fit the batch: drop one")
    budget = usable_bytes(args.fit_seq)
    result = _search_seq(parser, args, cfg, spec, mesh_text, budget)
    result.pop("spec")
    result["tried"] = [{**without(t, "compiled", "phases"), "predicted_seconds":
                        predicted_seconds(t)} for t in result["tried"]]
    c = result["chosen"] = result["chosen"] and {**without(result["chosen"], "compiled",
                                                           "phases"),
                                                 "predicted_seconds": predicted_seconds(
                                                     result["chosen"])}
    given = "data.batch_size" in given_overrides(args)
    assumed = {"batch_size": spec.batch_size, "batch_size_given": given,
               "mem_fraction": xla_fraction(), "compiler": target.compiler()}
    if args.json:
        print(json.dumps({"budget_gib": args.fit_seq, "usable_bytes": budget, **assumed,
                          **result}, indent=2))
        return 0 if c else 1
    print(f"longest sequence for a {args.fit_seq:g} GiB GPU at micro-batch {spec.batch_size} "
          f"(multiples of {result['granule']} tokens; the run's largest phase decides):")
    for e in sorted(result["tried"], key=lambda e: e["seq_len"]):
        host = f", host {e['host_bytes'] / GiB:.2f} GiB" if e.get("host_bytes") else ""
        print(f"  {e['seq_len']:>9,} tokens: {e['reason']}{host}")
    share = (f"  assumed: micro-batch {spec.batch_size} ("
             + ("--batch-size" if given else "--fit-seq's default; --batch-size N searches at N")
             + f")\n  and XLA may use {assumed['mem_fraction']:.0%} of the {args.fit_seq:g} GiB "
             f"card (XLA_PYTHON_CLIENT_MEM_FRACTION, default .75; jaxmem.perf.usable_bytes)"
             + (f"\n  card: {t.card.describe()}" if (t := target.active()) else ""))
    if c is None:
        print(f"nothing fits: not even {result['granule']} tokens\n{share}")
        return 1
    tokens = spec.batch_size * spec.grad_accum * c['seq_len']
    speed = (f"; predicted {tokens / c['predicted_seconds']:,.0f} "
             f"tok/s" if c["predicted_seconds"] else "")
    print(f"chosen: --seq-len {c['seq_len']} --batch-size {spec.batch_size} "
          f"({c.get('peak_phase', 'step')} {c['run_peak_bytes'] / GiB:.2f} GiB of "
          f"{budget / GiB:.2f} usable{speed})\n{share}")
    if result["limit"] == "max_position_embeddings":
        print(f"  limited by the model's max_position_embeddings "
              f"({result['max_position_embeddings']:,}), not by memory: "
              f"--max-position-embeddings N searches further")
    return 0


def mesh_breakdown(parser, args, spec, mesh) -> int:
    """`--mesh` / `--devices`: the per-device breakdown (jaxmem.memory.mesh)."""
    try:
        report = mesh_report(spec, mesh, compile=not args.analytic_only)
    except ValueError as e:  # MeshError names --mesh
        parser.error(str(e).splitlines()[0])
    print(json.dumps(report, indent=2) if args.json else format_mesh_report(report))
    return 0


def print_report(cfg, spec, report: dict, unit: str | None = None) -> None:
    """A report's table: the header, the step's breakdown, the run's phases and the verdict."""
    print(header_line(cfg, spec, report["params"]) + "\n")
    print(format_report(report, unit))
    print("\n" + format_phases(report["phases"], unit or (
        "GiB" if report["compiled"]["peak_bytes"] >= GiB else "MiB")))
    print("\n" + "\n".join(report["verdict"]))


def breakdown(parser, args, cfg, spec) -> int:
    """One configuration: its step's breakdown, the run's phases and the verdict."""
    report = step_report(spec, measured=measure_in_subprocess(spec) if args.measure else None)
    report["phases"] = phases(args, cfg, spec, report["compiled"], report["measured"])
    report["verdict"] = verdict(report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(cfg, spec, report)
    plot(parser, args.plot, [report], [f"{spec.remat}, micro {spec.batch_size}"])
    return 0


def fit(parser, args, cfg, spec, global_batch: int, max_micro: int | None) -> int:
    """`--fit GIB`: the planner's candidates and its choice (search.plan), else exit 1."""
    # progress while compiling, only on a terminal: the list itself is printed once, below
    log = progress(args, lambda t: f"  tried micro {t['batch_size']} remat {t['remat']} mu "
                   f"{t['mu_dtype']}: {t['reason']}") if sys.stderr.isatty() else None
    cache, timed = {}, target.card_here() is not None  # a card: candidates by predicted time
    result = plan(spec, global_batch, usable_bytes(args.fit),
                  mu_dtypes=(spec.mu_dtype,) if spec.mu_dtype else ("fp32", "bf16"),
                  max_micro=max_micro, log=log,
                  phases_fn=lambda c, compiled: phases(args, cfg, c, compiled, cache=cache),
                  timed=timed)
    chosen, out = result["spec"], {
        "budget_gib": args.fit, "usable_bytes": usable_bytes(args.fit),
        "global_batch": global_batch, "tried": [
            {**without(t, "compiled"), "predicted_seconds": predicted_seconds(t)}
            for t in result["tried"]],
        "chosen": None}
    if chosen is not None:
        measured = measure_in_subprocess(chosen) if args.measure else None
        r = out["chosen"] = step_report(chosen, result["chosen"]["compiled"], measured)
        r["phases"] = (result["chosen"]["phases"] if measured is None else
                       phases(args, cfg, chosen, r["compiled"], measured, cache))
        r["verdict"] = verdict(r, args.fit)
        out["train_command"] = train_command(cfg.replace({
            "data.batch_size": chosen.batch_size, "data.grad_accum": chosen.grad_accum,
            "remat.policy": str(chosen.remat), "optim.mu_dtype": chosen.mu_dtype}))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(result, args.fit, timed=timed))
        print(f"  (a {args.fit:g} GiB GPU: {usable_bytes(args.fit) / GiB:.3f} GiB usable, "
              f"jaxmem.xla.verdict.usable_bytes)")
        if chosen is not None:
            print(f"\nchosen: micro-batch {chosen.batch_size} x grad-accum {chosen.grad_accum}, "
                  f"remat {chosen.remat}, mu {chosen.mu_dtype}; train it with:\n"
                  f"  {out['train_command']}\n")
            print_report(cfg, chosen, out["chosen"], "GiB")
    if args.plot:  # every compiled candidate's breakdown as a bar, with the budget line
        done = [t for t in result["tried"] if t.get("compiled")]
        specs = [spec.replace(batch_size=t["batch_size"], grad_accum=t["grad_accum"],
                              remat=RematPolicy.parse(t["remat"]), mu_dtype=t["mu_dtype"])
                 for t in done]
        plot(parser, args.plot, [step_report(s, t["compiled"]) for s, t in zip(specs, done)],
             [f"micro {t['batch_size']} x{t['grad_accum']}\n{t['remat'][:24]}, mu {t['mu_dtype']}"
              for t in done], budget=usable_bytes(args.fit) / GiB)
    if chosen is None:
        print(f"error: nothing fits in {args.fit:g} GiB for global batch {global_batch} x "
              f"{spec.seq_len} tokens ({len(result['tried'])} candidates tried; smallest "
              f"peak above); try a smaller --seq-len or --global-batch, or another --precision",
              file=sys.stderr)
    return 0 if chosen is not None else 1


def plan_run(cfg, card: str | None, prog: str) -> int:
    """`python -m jaxmem.train --dry-run`'s plan: the step's breakdown, every phase of the run
    and the verdict, compiled for `card` (a jaxmem.target card: deviceless) or for the GPU here;
    on a CPU without a card, or for a card whose compiler is not installed, the analytic plan,
    saying so on one line. Call it before anything starts JAX's backend."""
    spec = StepSpec.from_run_config(cfg)
    if cfg.parallel.mesh is not None:
        print(f"(one device's plan; per device on --mesh {cfg.parallel.mesh}: python -m "
              f"jaxmem.memory with the same flags)")
    if cfg.precision.fp8_gemms:  # the XLA flags an fp8 run gets, before the backend starts
        set_xla_flags()
    if card is not None:
        try:
            target.check_installed()
        except target.TargetError:
            print(f"{prog}: card {card}: XLA's GPU compiler is not installed, so nothing is "
                  f"compiled for it: the analytic plan ({target.install_hint()})")
            return _analytic_plan(cfg, spec)
        target.prepare()
        with target.compiling_for(card) as t:
            print(f"compiling for {t.describe()}", flush=True)
            return _compiled_plan(cfg, spec)
    if target.platform() != "gpu":
        print(f"{prog}: no GPU here and no card (--target, or card: in the config file): the "
              f"analytic plan")
        return _analytic_plan(cfg, spec)
    return _compiled_plan(cfg, spec)


def _compiled_plan(cfg, spec) -> int:
    report = step_report(spec)
    report["phases"] = run_phases(spec, SampleShape.of(cfg), False, report["compiled"])
    report["verdict"] = verdict(report)
    print_report(cfg, spec, report)
    return 0


def _analytic_plan(cfg, spec) -> int:
    ph = run_phases(spec, SampleShape.of(cfg))
    report = {"phases": ph, "backend": "analytic", "precision": spec.precision.name,
              "transfers": transfer_plan(spec)}
    print(header_line(cfg, spec, analytic_breakdown(spec)["params"]) + "\n")
    print(format_phases(ph, "GiB" if ph["peak_bytes"] >= GiB else "MiB"))
    print("\n" + "\n".join(verdict(report)))
    return 0
