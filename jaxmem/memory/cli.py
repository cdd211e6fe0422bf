"""`python -m jaxmem.memory`: where every byte of a train step goes, and will it fit.

    python -m jaxmem.memory --preset small --precision amp-bf16 --remat full \
        --batch-size 4 --seq-len 512 --grad-accum 2 [--measure] [--json]
    python -m jaxmem.memory --preset llama-3.2-1b --seq-len 2048 --fit 40 --global-batch 16

Breakdown mode prints, for one configuration of the full train step (optimizer included, state
donated), three views of its memory and the rule of thumb:

    analytic      bytes per component and dtype from shapes alone (jaxmem.memory.analytic,
                  docs/memory.md)
    compiled      XLA's memory_analysis() of the step compiled ahead of time from abstract shapes
                  (nothing allocated): temp, argument, output, alias, peak = temp+arg+out-alias
    measured      with --measure, peak_bytes_in_use of the device after real steps, one
                  subprocess per configuration (jaxmem.memory.measure; skipped with a note where
                  the backend has no memory stats, as on CPU)
    rule of thumb 4 / 2 / 1 bytes per parameter for fp32 / 16-bit / int8 weights, 16 B/param for
                  mixed-precision Adam, "6x the fp32 weights" = 24 B/param; each with its ratio
                  to the compiled (or measured) peak

Then the run's phases (jaxmem.memory.phases): making the state, the step, evaluation (the fused
loss on one [B, T] batch) and the end-of-run sample (`--max-new-tokens`), each with what the run
holds outside its program; analytic, and compiled for the step and, with `--compile`, for the
other three. The verdict is on the largest phase, and so is `--fit`'s choice.

`--fit GIB --global-batch N` runs the planner instead (jaxmem.memory.planner.plan): candidates from
fastest to most frugal, the first whose *compiled* peak fits is printed with its breakdown, with
every rejected candidate and why; exit 1 when nothing fits. GIB is the GPU's size; a candidate
fits when its peak is within jaxmem.xla.verdict.usable_bytes(GIB), the verdict's own rule.

`--mesh data=D,fsdp=F,tensor=T` (with `--devices N` on the CPU backend: N simulated devices)
prints the per-device breakdown instead: the analytic model split by the sharding rules and the
step compiled for the mesh, with its collectives (jaxmem.memory.mesh, docs/distributed.md).
`--fit GIB --devices N` chooses the mesh instead of the step: the first mesh of N devices, from
pure data parallel to all-fsdp to tensor=2, whose per-device compiled peak fits. For a LoRA /
QLoRA run, or with `--global-batch`, it chooses the mesh, the micro-batch, the remat policy and
the fused loss's chunk together (jaxmem.memory.planner.plan_mesh; analytic-first as `--fit`).
With `--offload-base host` the frozen block layers are counted in host memory, printed apart
from the device bytes, with the device figure without offload beside it. `--analytic-only`
skips the compile (a 70B step takes minutes to compile on a CPU).

Bad input exits 2 with one line naming the flag. The hidden `--worker JSON` is the child side of
`--measure` (jaxmem.memory.measure): it measures the StepSpec in the JSON and ignores every other
flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from jaxmem import target
from jaxmem.config.flags import (PLANNER_ONLY, PLANNER_SECTIONS, add_run_flags, given_overrides,
                                 positive_int)
from jaxmem.config.run import RunConfig
from jaxmem.memory.measure import measure_in_subprocess, run_worker
from jaxmem.memory.phases import SampleShape, format_phases, run_phases
from jaxmem.memory.planner import plan
from jaxmem.memory.report import (format_plan, format_report, header_line, step_report,
                                  train_command)
from jaxmem.memory.spec import GiB, StepSpec
from jaxmem.xla.verdict import COMMON_GIB, usable_bytes, verdict_lines
from jaxmem.model.remat import RematPolicy
from jaxmem.train.run import build_step_config


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
                    "with no allocation, measured on GPU), and a planner for a memory budget. "
                    "The model, precision, remat and batch flags are jaxmem.train's, with the "
                    "same defaults; with --fit, --batch-size is the largest micro-batch tried "
                    "and --mu-dtype (when not given) tries fp32 then bf16.")
    add_run_flags(p, PLANNER_SECTIONS, only=PLANNER_ONLY)
    p.add_argument("--devices", type=positive_int, default=None, metavar="N",
                   help="compile for N devices (with --mesh: the per-device breakdown, "
                        "jaxmem.memory.mesh): N --target GPUs, or on the CPU backend N simulated "
                        "devices of this host")
    p.add_argument("--hosts", type=positive_int, default=None, metavar="H",
                   help="with --target: the --devices GPUs on H hosts (a multi-host job: "
                        "collectives between hosts; per-device figures as on one host)")
    p.add_argument("--target", default=None, choices=sorted(target.CARDS), metavar="GPU",
                   help="compile every figure with this GPU's own XLA compiler, on this machine "
                        "without the GPU (deviceless: no autotuning, workspaces or "
                        "fragmentation; docs/memory.md): " + ", ".join(sorted(target.CARDS)) +
                        ". Needs `pip install 'jaxmem[gpu-plan]'`")
    g = p.add_argument_group("planner and output")
    g.add_argument("--global-batch", type=positive_int, default=None,
                   help="sequences per optimizer step; sets --grad-accum = global / batch size")
    g.add_argument("--fit", type=positive_gib, default=None, metavar="GIB",
                   help="plan: the fastest configuration whose compiled peak fits a GPU of GIB "
                        "GiB (what XLA may use of it: XLA_PYTHON_CLIENT_MEM_FRACTION, default "
                        ".75, less ~0.5 GiB of CUDA context; the verdict's rule)")
    g.add_argument("--fit-seq", type=positive_gib, default=None, metavar="GIB",
                   help="plan: the longest --seq-len (multiples of 1024, up to the model's "
                        "max positions) whose run fits a GPU of GIB GiB, batch and the rest "
                        "as given (jaxmem.memory.fit_seq: doubling, then bisection on compiled "
                        "peaks); with --devices / --mesh (e.g. --mesh context=8: the sequence "
                        "split over 8 devices) the step's per-device compiled peak decides")
    g.add_argument("--compile", action="store_true",
                   help="also compile the run's other phases (making the state, evaluation, the "
                        "end-of-run sample; the step is always compiled): the verdict and --fit "
                        "then use their compiled peaks instead of the analytic ones")
    g.add_argument("--measure", action="store_true",
                   help="also run real steps in a subprocess and read the device's peak memory")
    g.add_argument("--worker", default=None, metavar="JSON", help=argparse.SUPPRESS)
    g.add_argument("--analytic-only", action="store_true",
                   help="with --mesh / --devices: print the analytic per-device figures only, "
                        "without compiling the step (a CPU compile of a 70B step takes minutes)")
    g.add_argument("--json", action="store_true", help="print JSON instead of a table")
    g.add_argument("--plot", default=None, metavar="PNG",
                   help="also draw the breakdown as stacked bars (one per configuration; with "
                        "--fit, every compiled candidate and the budget line); needs matplotlib")
    return p


def _resolve(parser, args):
    """Validated (spec, global batch, largest micro-batch for --fit or None); exits 2 with a
    one-line message naming the flag."""
    given = given_overrides(args)
    if given.get("optim.in_backward"):  # it needs --clip 0, which this CLI has no flag for
        given["optim.clip"] = 0.0
    try:
        cfg = RunConfig().replace(given)
        build_step_config(cfg)  # validates shapes, remat (offload support), precision
    except ValueError as e:  # ConfigError, RematError, PrecisionError
        parser.error(str(e).splitlines()[0])
    batch, accum = cfg.data.batch_size, cfg.data.grad_accum
    batch_given, accum_given = "data.batch_size" in given, "data.grad_accum" in given
    if args.global_batch is not None:
        if args.global_batch % batch and (batch_given or args.fit is None):
            parser.error(f"--global-batch {args.global_batch} is not divisible by "
                         f"--batch-size {batch}")
        if accum_given and args.global_batch != batch * accum:
            parser.error(f"--global-batch {args.global_batch} != --batch-size {batch} x "
                         f"--grad-accum {accum}")
        if args.fit is None:
            accum = args.global_batch // batch
    elif args.fit is not None and accum_given:
        parser.error("--fit chooses --grad-accum itself; give --global-batch instead")
    spec = StepSpec.from_run_config(cfg.replace({"data.grad_accum": accum}))
    return spec, args.global_batch or batch * accum, batch if batch_given else None


def _verdict(report: dict, fit: float | None = None) -> list[str]:
    """The verdict on the run's largest phase (jaxmem.memory.phases), and which one it is; with
    --fit its size is judged too (by `usable_bytes`, the rule the search used)."""
    ph = report["phases"]
    others = ", ".join(f"{r['name']} {_gib(r)}" for r in ph["phases"])
    sizes = COMMON_GIB if fit is None else tuple(sorted({*COMMON_GIB, fit}))
    return verdict_lines(ph["peak_bytes"], ph["peak_source"], report["backend"],
                         report["precision"], sizes) + [
        f"  the run's largest phase: {ph['peak_phase']} (GiB: {others}; a = analytic)"]


def _gib(row) -> str:
    n = row["compiled_bytes"] if row["compiled_bytes"] is not None else row["analytic_bytes"]
    return f"{n / GiB:.2f}" + ("" if row["compiled_bytes"] is not None else "a")


def _phases(args, cfg, spec, report, cache=None) -> dict:
    measured = (report.get("measured") or {}).get("peak_bytes")
    return run_phases(spec, SampleShape.of(cfg), compile=args.compile,
                      step_compiled=report["compiled"], step_measured=measured, cache=cache)


def _plot(parser, path, reports, labels, budget=None) -> None:
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


def _fit_mesh_and_step(args, spec, global_batch: int, max_micro: int | None) -> int:
    """`--fit GIB --devices N` for a LoRA run or with --global-batch: the first mesh x
    micro-batch x remat x loss chunk whose per-device peak fits (jaxmem.memory.planner.plan_mesh);
    exit 1 when nothing does."""
    from jaxmem.memory.mesh import analytic_per_device, compile_per_device, mesh_candidates
    from jaxmem.memory.planner import plan_mesh
    whole = dataclasses.replace(spec, batch_size=global_batch, grad_accum=1)
    meshes = mesh_candidates(whole, args.devices)
    log = None if args.json else (lambda t: print(
        f"  mesh {t['mesh']} micro {t['batch_size']} remat {t['remat']} loss chunk "
        f"{t['loss_chunk'] or 'auto'}: {t['reason']}", file=sys.stderr, flush=True))
    result = plan_mesh(spec, meshes, global_batch, usable_bytes(args.fit),
                       analytic_fn=lambda s, m: analytic_per_device(s, m, args.devices),
                       compile_fn=None if args.analytic_only else (
                           lambda s, m: compile_per_device(s, m) if target.device_count() > 1
                           else None), max_micro=max_micro, log=log)
    out = {"budget_gib": args.fit, "usable_bytes": usable_bytes(args.fit), "devices": args.devices,
           "global_batch": global_batch, "tried": result["tried"], "chosen": result["chosen"]}
    if args.json:
        print(json.dumps(out, indent=2))
    elif result["chosen"]:
        c = result["chosen"]
        host = f", {c['host_bytes'] / GiB:.3f} GiB on the host" if c["host_bytes"] else ""
        print(f"chosen: mesh {c['mesh']}, micro-batch {c['batch_size']} x grad-accum "
              f"{c['grad_accum']}, remat {c['remat']}, loss chunk {c['loss_chunk'] or 'auto'}: "
              f"{c['reason']}{host}")
    if result["chosen"] is None:
        print(f"error: no mesh, micro-batch, remat or loss chunk of {args.devices} devices fits "
              f"global batch {global_batch} in {args.fit:g} GiB per device "
              f"({len(result['tried'])} tried)", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(run_worker(args.worker)))
        return 0
    if args.target is not None:  # before anything initializes the backend
        if args.measure:
            parser.error("--measure runs real steps on this machine's device; --target only "
                         "compiles for a GPU that is not here: drop one of them")
        if given_overrides(args).get("precision.mode") == "fp8":
            from jaxmem.model.fp8_compile import set_xla_flags  # the flags an fp8 run gets (train CLI)
            set_xla_flags()
        target.prepare()
        try:
            with target.compiling_for(args.target, devices=args.devices or 1,
                                      hosts=args.hosts or 1) as t:
                if not args.json:
                    print(f"compiling for {t.describe()}", file=sys.stderr, flush=True)
                return _main(parser, args)
        except target.TargetError as e:
            parser.error(str(e))
    if args.hosts is not None:
        parser.error("--hosts needs --target: simulated CPU devices are one process")
    if args.devices is not None:  # before anything initializes the backend
        import jax
        jax.config.update("jax_num_cpu_devices", args.devices)
    return _main(parser, args)


def _main(parser, args) -> int:
    spec, global_batch, max_micro = _resolve(parser, args)
    mesh = given_overrides(args).get("parallel.mesh")
    if spec.in_backward and (mesh is not None or args.devices is not None or
                             args.fit is not None):
        parser.error("--optimizer-in-backward plans one device and one configuration: drop "
                     "--mesh, --devices and --fit (--fit-seq works)")
    if args.fit_seq is not None:
        return _fit_seq(parser, args, spec, mesh)
    if args.fit is not None and mesh is not None:
        parser.error("--fit with --devices searches the meshes itself; drop --mesh")
    if args.fit is not None and args.devices is not None:
        both = lambda: _fit_mesh_and_step(args, spec, global_batch, max_micro)  # noqa: E731
        return both() if args.global_batch is not None else \
            spec.trainable.fit_devices(lambda: _fit_mesh(args, spec), both)
    if mesh is not None or args.devices is not None:
        return _mesh_breakdown(parser, args, spec, mesh)
    cfg = RunConfig().replace(given_overrides(args))
    if args.fit is None:
        return _breakdown(parser, args, cfg, spec)
    return _fit(parser, args, cfg, spec, global_batch, max_micro)


def _fit_seq(parser, args, spec, mesh) -> int:
    """`--fit-seq GIB`: the longest sequence that fits (jaxmem.memory.fit_seq)."""
    if args.fit is not None:
        parser.error("--fit-seq searches the sequence length, --fit the batch: drop one")
    mesh_text = None
    if mesh is not None or (args.devices or 1) > 1:  # per device on a mesh (context=N...)
        from jaxmem.memory.mesh import resolve
        try:
            mesh_text = str(resolve(spec, mesh))
        except ValueError as e:  # MeshError names --mesh
            parser.error(str(e))
    from jaxmem.memory.fit_seq import run as fit_seq
    return fit_seq(spec, SampleShape.of(RunConfig().replace(given_overrides(args))),
                   args.fit_seq, args.compile, args.json, log=None if args.json else (
                       lambda e: print(f"  {e['seq_len']:,} tokens: {e['reason']}",
                                       file=sys.stderr, flush=True)), mesh_text=mesh_text)


def _fit_mesh(args, spec) -> int:
    """`--fit GIB --devices N`: the first mesh whose per-device peak fits, else exit 1."""
    from jaxmem.memory.mesh import fit_mesh
    result = fit_mesh(spec, usable_bytes(args.fit), log=None if args.json else (
        lambda t: print(f"  mesh {t['mesh']}: per-device peak {t['peak_bytes'] / GiB:.3f} GiB"
                        f"{'' if t['fits'] else ' > budget'}", file=sys.stderr, flush=True)))
    if args.json:
        print(json.dumps(result, indent=2))
    elif result["chosen"]:
        print(f"chosen mesh: {result['chosen']['mesh']}")
    if result["chosen"] is None:
        print(f"error: no mesh of {args.devices} devices fits this step in {args.fit:g} GiB "
              f"per device", file=sys.stderr)
        return 1
    return 0


def _mesh_breakdown(parser, args, spec, mesh) -> int:
    """`--mesh` / `--devices`: the per-device breakdown (jaxmem.memory.mesh)."""
    from jaxmem.memory.mesh import format_mesh_report, mesh_report
    try:
        report = mesh_report(spec, mesh, compile=not args.analytic_only)
    except ValueError as e:  # MeshError names --mesh
        parser.error(str(e).splitlines()[0])
    print(json.dumps(report, indent=2) if args.json else format_mesh_report(report))
    return 0


def _breakdown(parser, args, cfg, spec) -> int:
    """One configuration: its step's breakdown, the run's phases and the verdict."""
    report = step_report(spec, measured=measure_in_subprocess(spec) if args.measure else None)
    report["phases"] = _phases(args, cfg, spec, report)
    report["verdict"] = _verdict(report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(header_line(cfg, spec, report["params"]) + "\n")
        print(format_report(report))
        print("\n" + format_phases(report["phases"],
                                   "GiB" if report["compiled"]["peak_bytes"] >= GiB else "MiB"))
        print("\n" + "\n".join(report["verdict"]))
    _plot(parser, args.plot, [report], [f"{spec.remat}, micro {spec.batch_size}"])
    return 0


def _fit(parser, args, cfg, spec, global_batch: int, max_micro: int | None) -> int:
    """`--fit GIB`: the planner's candidates and its choice (planner.plan), else exit 1."""
    # progress while compiling, only on a terminal: the list itself is printed once, below
    log = None if args.json or not sys.stderr.isatty() else (
        lambda t: print(f"  tried micro {t['batch_size']} remat {t['remat']} mu {t['mu_dtype']}: "
                        f"{t['reason']}", file=sys.stderr, flush=True))
    cache = {}
    result = plan(spec, global_batch, usable_bytes(args.fit),
                  mu_dtypes=(spec.mu_dtype,) if spec.mu_dtype else ("fp32", "bf16"),
                  max_micro=max_micro, log=log,
                  phases_fn=lambda c, compiled: run_phases(c, SampleShape.of(cfg), args.compile,
                                                           compiled, cache=cache))
    out = _plan_output(args, cfg, result, global_batch, cache)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print_plan(args, cfg, result, out)
    if args.plot:
        _plot_candidates(parser, args, spec, result)
    if result["spec"] is None:
        print(f"error: nothing fits in {args.fit:g} GiB for global batch {global_batch} x "
              f"{spec.seq_len} tokens ({len(result['tried'])} candidates tried; smallest "
              f"peak above); try a smaller --seq-len or --global-batch, or another --precision",
              file=sys.stderr)
        return 1
    return 0


def _plan_output(args, cfg, result, global_batch: int, cache) -> dict:
    """--fit's JSON: the budget, the candidates tried, the chosen one's report and command."""
    chosen = result["spec"]
    out = {"budget_gib": args.fit, "usable_bytes": usable_bytes(args.fit),
           "global_batch": global_batch, "tried": [
        {k: v for k, v in t.items() if k != "compiled"} for t in result["tried"]], "chosen": None}
    if chosen is None:
        return out
    measured = measure_in_subprocess(chosen) if args.measure else None
    out["chosen"] = step_report(chosen, compiled=result["chosen"]["compiled"], measured=measured)
    out["chosen"]["phases"] = (result["chosen"]["phases"] if measured is None else
                               _phases(args, cfg, chosen, out["chosen"], cache))
    out["chosen"]["verdict"] = _verdict(out["chosen"], args.fit)
    out["train_command"] = train_command(cfg.replace({
        "data.batch_size": chosen.batch_size, "data.grad_accum": chosen.grad_accum,
        "remat.policy": str(chosen.remat), "optim.mu_dtype": chosen.mu_dtype}))
    return out


def _print_plan(args, cfg, result, out) -> None:
    """--fit's table: the candidates, the budget, and the chosen configuration's breakdown."""
    chosen = result["spec"]
    print(format_plan(result, args.fit))
    print(f"  (a {args.fit:g} GiB GPU: {usable_bytes(args.fit) / GiB:.3f} GiB usable, "
          f"jaxmem.xla.verdict.usable_bytes)")
    if chosen is None:
        return
    print(f"\nchosen: micro-batch {chosen.batch_size} x grad-accum {chosen.grad_accum}, "
          f"remat {chosen.remat}, mu {chosen.mu_dtype}; train it with:\n"
          f"  {out['train_command']}\n")
    print(header_line(cfg, chosen, out["chosen"]["params"]) + "\n")
    print(format_report(out["chosen"], unit="GiB"))
    print("\n" + format_phases(out["chosen"]["phases"]))
    print("\n" + "\n".join(out["chosen"]["verdict"]))


def _plot_candidates(parser, args, spec, result) -> None:
    """--fit --plot: every compiled candidate's breakdown as a bar, with the budget line."""
    compiled = [(dataclasses.replace(spec, batch_size=t["batch_size"], grad_accum=t["grad_accum"],
                                     remat=RematPolicy.parse(t["remat"]), mu_dtype=t["mu_dtype"]),
                 t) for t in result["tried"] if t.get("compiled")]
    labels = [f"micro {t['batch_size']} x{t['grad_accum']}\n"
              f"{'selective' if t['remat'].startswith('names:') else t['remat']}, "
              f"mu {t['mu_dtype']}" for _, t in compiled]
    _plot(parser, args.plot, [step_report(c, compiled=t["compiled"]) for c, t in compiled],
          labels, budget=usable_bytes(args.fit) / GiB)
