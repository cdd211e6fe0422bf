"""`python -m jaxmem.memory`: where every byte of a train step goes, and will it fit.

    python -m jaxmem.memory --preset small --precision amp-bf16 --remat full \
        --batch-size 4 --seq-len 512 --grad-accum 2 [--measure] [--json]
    python -m jaxmem.memory --preset llama-3.2-1b --seq-len 2048 --fit 40 --global-batch 16

One configuration: its full train step (optimizer included, state donated) analytic
(jaxmem.memory.analytic), compiled ahead of time from abstract shapes with nothing allocated
(XLA's memory_analysis(): peak = temp + argument + output - alias), measured with --measure
(jaxmem.memory.measure) and by the rule of thumb; then the run's phases (jaxmem.memory.phases):
the verdict, and `--fit`'s choice, are on the largest. `--fit`, `--fit --devices` and
`--fit-seq` search (jaxmem.memory.search); `--mesh` / `--devices` print per device
(jaxmem.memory.mesh). The modes are jaxmem.memory.commands; docs/memory.md and
docs/distributed.md explain the numbers.

It takes jaxmem.train's command line (every flag, `--config FILE`, `--recipe NAME`:
jaxmem.memory.layered); the settings that change no memory are named on one stderr line and
left out. Bad input exits 2 with one line naming the flag (or the file, line and key); a search where nothing fits exits 1. The
hidden `--worker JSON` is the child side of `--measure`: it measures the StepSpec in the JSON
and ignores every other flag.
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxmem import target
from jaxmem.config.files import add_config_flags
from jaxmem.config.flags import number_type, add_run_flags, given_overrides, positive_int
from jaxmem.config.run import RunConfig
from jaxmem.model.precision import get_precision
from jaxmem.memory import commands, layered, measure
from jaxmem.memory.counted import abstract_frozen
from jaxmem.memory.spec import StepSpec
from jaxmem.model.fp8_compile import set_xla_flags
from jaxmem.train import build_step_config


positive_gib = number_type(float, lambda v: 0 < v < float("inf"), "a positive number of GiB")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxmem.memory",
        usage="%(prog)s [--config FILE] [--recipe NAME] [jaxmem.train's flags ...] "
              "[--target GPU] [--devices N] [--fit GIB | --fit-seq GIB] [--global-batch N] "
              "[--compile] [--measure] [--json] [--plot PNG]",
        description="Where every byte of a train step goes (analytic, compiled ahead of time "
                    "with no allocation, measured on GPU), and a planner for a memory budget. "
                    "The model, precision, remat and batch flags are jaxmem.train's, with the "
                    "same defaults; with --fit, --batch-size is the largest micro-batch tried "
                    "and --mu-dtype (when not given) tries fp32 then bf16. It takes every flag of "
                    "jaxmem.train, and --config / --recipe as it does: those that change no "
                    "memory are listed in their own group and named on stderr when given.")
    add_config_flags(p.add_argument_group("config files"))
    add_run_flags(p, layered.SECTIONS, only=layered.ONLY)
    p.add_argument("--devices", type=positive_int, metavar="N",
                   help="compile for N devices (with --mesh: the per-device breakdown): N "
                        "--target GPUs, or on the CPU backend N simulated devices of this host")
    p.add_argument("--hosts", type=positive_int, metavar="H",
                   help="with --target: the --devices GPUs on H hosts (collectives between "
                        "hosts; per-device figures as on one host)")
    p.add_argument("--target", choices=sorted(target.CARDS), metavar="GPU",
                   help="compile every figure with this GPU's own XLA compiler, without the GPU "
                        "(deviceless: no autotuning, workspaces or fragmentation; docs/memory.md): "
                        + ", ".join(sorted(target.CARDS))
                        + ". Needs `pip install 'jaxmem[gpu-plan]'`. Default: the config "
                          "file's `card:` (on this machine's backend when the compiler is not "
                          "installed)")
    g = p.add_argument_group("planner and output")
    g.add_argument("--global-batch", type=positive_int,
                   help="sequences per optimizer step; sets --grad-accum = global / batch size")
    g.add_argument("--fit", type=positive_gib, metavar="GIB",
                   help="plan: the fastest configuration whose compiled peak fits a GPU of GIB "
                        "GiB (what XLA may use of it: XLA_PYTHON_CLIENT_MEM_FRACTION, default "
                        ".75, less ~0.5 GiB of CUDA context; the verdict's rule)")
    g.add_argument("--fit-seq", type=positive_gib, metavar="GIB",
                   help="plan: the longest --seq-len (multiples of 1024, up to the model's max "
                        "positions) whose run fits a GPU of GIB GiB, at micro-batch 1 unless "
                        "--batch-size is given, the rest as given; with "
                        "--devices / --mesh (--mesh context=8: the sequence split over 8 "
                        "devices) the step's per-device compiled peak decides")
    g.add_argument("--compile", action="store_true",
                   help="also compile the run's other phases (state, eval, end-of-run sample; "
                        "the step always is): the verdict and --fit then use their compiled peaks")
    g.add_argument("--measure", action="store_true",
                   help="also run real steps in a subprocess and read the device's peak memory")
    g.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    g.add_argument("--analytic-only", action="store_true",
                   help="with --mesh / --devices: the analytic per-device figures only, without "
                        "compiling the step (a CPU compile of a 70B step takes minutes)")
    g.add_argument("--json", action="store_true", help="print JSON instead of a table")
    g.add_argument("--plot", metavar="PNG",
                   help="also draw the breakdown as stacked bars (one per configuration; with "
                        "--fit, every compiled candidate and the budget line); needs matplotlib")
    layered.add_ignored_flags(p)
    return p


def _resolve(parser, args):
    """Validated (spec, global batch, largest micro-batch for --fit or None); exits 2 with a
    one-line message naming the flag."""
    given = given_overrides(args)
    if given.get("optim.in_backward"):  # it needs --clip 0, and --clip changes no memory
        given["optim.clip"] = 0.0
    try:
        cfg = RunConfig().replace(given)
        build_step_config(cfg)  # validates shapes, remat (offload support), precision
    except ValueError as e:  # ConfigError, RematError, PrecisionError
        lay = getattr(args, "layers", None)  # main's: a value from a file names its line
        parser.error(lay.explain(str(e).splitlines()[0]) if lay else str(e).splitlines()[0])
    batch_given, accum_given = "data.batch_size" in given, "data.grad_accum" in given
    if args.fit_seq is not None and not batch_given:  # the longest sequence of one, not of 16
        cfg = cfg.replace({"data.batch_size": 1})
    batch, accum = cfg.data.batch_size, cfg.data.grad_accum
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


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(measure.measure_here(StepSpec.from_json(args.worker))))
        return 0
    try:  # --config / --recipe / flags, layered; args then holds the planner's overrides
        lay, ignored = layered.planner_layers(args)
    except ValueError as e:  # ConfigError, HFError, DataError: one line naming file or flag
        parser.error(str(e).splitlines()[0])
    layered.say_ignored(parser.prog, ignored)
    args.layers = lay
    if args.target is None and lay.card is not None:
        try:
            target.check_installed()
            args.target = lay.card
        except target.TargetError:
            print(f"{parser.prog}: the config's card {lay.card} needs XLA's GPU compiler, which "
                  f"is not installed: planning on this machine's backend ({target.install_hint()})",
                  file=sys.stderr, flush=True)
    if args.target is not None:  # before anything initializes the backend
        if args.measure:
            parser.error("--measure runs real steps on this machine's device; --target only "
                         "compiles for a GPU that is not here: drop one of them")
        mode = given_overrides(args).get("precision.mode", RunConfig().precision.mode)
        if get_precision(mode).fp8:  # the XLA flags an fp8 run gets (train CLI), before start
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
    cfg = RunConfig().replace(given_overrides(args))
    if args.fit_seq is not None:
        return commands.fit_seq(parser, args, cfg, spec, mesh)
    if args.fit is not None and mesh is not None:
        parser.error("--fit with --devices searches the meshes itself; drop --mesh")
    if args.fit is not None and args.devices is not None:
        # a full fine-tune at its micro-batch searches meshes; with --global-batch, or with a
        # frozen base (the state is small: the micro-batch decides), meshes and micro-batches
        if args.global_batch is None and abstract_frozen(spec) is None:
            return commands.fit_mesh(args, spec)
        return commands.fit_mesh_and_step(args, spec, global_batch, max_micro)
    if mesh is not None or args.devices is not None:
        return commands.mesh_breakdown(parser, args, spec, mesh)
    if args.fit is None:
        return commands.breakdown(parser, args, cfg, spec)
    return commands.fit(parser, args, cfg, spec, global_batch, max_micro)

