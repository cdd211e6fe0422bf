"""jaxmem vs the PyTorch recipe (eager and torch.compile): same model, weights, batches, optimizer.

    python -m experiments.compare --quick                      # CPU, a few minutes
    python -m experiments.compare --preset llama-3.2-1b --seq-len 2048 --batch-size 4 \\
        --steps 20 --modes amp-bf16 bf16 --remats none full selective    # GPU (H100/H200)

For every precision mode x remat policy, each framework runs in its OWN subprocess (a process's
peak-memory counters never go down), starting from the same weights (jaxmem's init, converted to
a torch state_dict with experiments/compare/convert.py) and the same batches (numpy, fixed seed; no
padding, so both sides run causal-only attention). Per run it reports:

    saved_bytes   bytes kept for the backward pass by one forward + loss, parameters and their
                  compute-dtype copies EXCLUDED on both sides (the same count):
                    jax:   jax's saved_residuals of the loss as a function of the params already
                           cast to the compute dtype, minus the residuals that are those params
                    torch: saved_tensors_hooks over the forward (experiments.compare.torch_train.
                           saved_bytes_for_backward, exclude_param_copies=True, which drops the
                           parameters and autocast's cached weight copies), plus what a selective
                           checkpoint policy keeps in its own cache
                  Inputs such as token ids and targets count on both sides when they are saved.
    peak_est      jax only: XLA's compiled estimate for the whole donated train step
                  (memory_analysis: temp + arguments + outputs - aliased)
    peak_bytes    measured peak on GPU: jax `peak_bytes_in_use`, torch `max_memory_allocated`
                  (on CPU neither framework has a peak allocator stat: null)
    step_ms, tok/s  median over the steps after `--warmup` (jax: block_until_ready)
    loss          the loss of the last step (the same step and batch on both sides)
    mfu           GPU, bf16/fp16 modes: (6 N + 12 L D T) tokens/s / the device's dense peak

Remat policies, by name: `none`, `full` (keep only each block's input), and `selective`:
jaxmem `names:query,key,value,attn_context,mlp_gate,mlp_up` / torch per-layer checkpoint whose
policy keeps the matmul and attention outputs (experiments.compare.torch_train.SelectiveCheckpoint).
Why that jaxmem policy: on the tiny preset at B=4, T=256 (fp32, CPU) it keeps 22.9 MiB for
backward at 1.965 GFLOP per step, vs 57.1 MiB / 1.926 (none), 4.9 MiB / 2.300 (full, +19%),
24.9 / 1.932 (dots), 22.9 / 2.000 (dots_no_batch): the bytes of dots_no_batch for half of its
recompute (it keeps q/k after RoPE, so RoPE is not recomputed); docs/results.md. (XLA attention
recomputes its T x T probabilities in the backward under every policy, docs/remat.md.) Any jaxmem
policy string can be given instead (`--remats none "names:query,key"`); torch then runs
`selective`.

`--json` prints only the JSON document; results go to a new experiments/results/compare-*_<date>.json
(never over a tracked file) or to `--out`, rewritten after every run (`"complete": false` until
the last run and the ratios are in, so a crash loses no finished run), and a chart (matplotlib, the `plot` extra: saved
activations and tokens/s per mode and remat, a bar per framework) next to it as .png.

Layout: this module is the driver (flags, one subprocess per run, the JSON document);
experiments.compare.workers is what each subprocess runs; experiments.compare.report the ratios,
MFU, tables and chart.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from experiments.common import cpu_isa
from experiments.compare.report import (add_mfu, add_ratios, format_table, mib, remat_label,
                                        versions, write_chart)
from experiments.compare.workers import FRAMEWORKS, MODES, SELECTIVE, worker
from experiments.common.resultfiles import new_result_file
from jaxmem.config.flags import add_run_flags, given_overrides
from jaxmem.plot.figure import PlotError
from jaxmem.config.run import RunConfig

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"


# ---------------------------------------------------------------- CLI


# jaxmem's side of every run is a RunConfig: the comparison's own defaults, then the flags given
# (generated from RunConfig like jaxmem.train's), then each run's precision mode and remat.
DEFAULTS = RunConfig().replace({"data.seq_len": 256, "data.batch_size": 4, "optim.total_steps": 12})
QUICK = {"model.preset": "tiny", "model.num_layers": 2, "data.batch_size": 2, "data.seq_len": 64,
         "optim.total_steps": 8}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.compare", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[1])
    add_run_flags(p, ["model", "optim", "data"], defaults=DEFAULTS,
                  only={"optim": ("lr", "total_steps"), "data": ("batch_size", "seq_len", "seed")})
    g = p.add_argument_group("comparison")
    g.add_argument("--warmup", type=int, default=2,
                   help="steps left out of the median time (default: 2)")
    g.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, metavar="MODE",
                   help=f"precision modes: {', '.join(MODES)} (default: all)")
    g.add_argument("--remats", nargs="+", default=["none", "full", "selective"],
                   help="none, full, selective (= %s) or any jaxmem policy (default: none full "
                        "selective)" % SELECTIVE)
    g.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS,
                   metavar="FW", help=f"{', '.join(FRAMEWORKS)} (default: all)")
    g.add_argument("--compile-modes", nargs="+", default=None,
                   help="modes that also run torch.compile (default: all)")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU compute threads per process (1: XLA without its Eigen pool, "
                        "torch.set_num_threads(1)); default: each framework's own")
    g.add_argument("--timeout", type=float, default=900,
                   help="seconds per subprocess (default: 900)")
    g.add_argument("--quick", action="store_true",
                   help="CPU smoke: tiny preset, 2 layers, B=2, T=64, 8 steps, 1 thread, "
                        "torch.compile only for fp32 (a few minutes on 2 cores)")
    g.add_argument("--json", action="store_true", help="print only the JSON document")
    g.add_argument("--out", type=Path, default=None, help="JSON path; the chart goes next to it "
                   "as .png (default: a new experiments/results/compare-<run>-<device>_<date>.json)")
    g.add_argument("--no-save", action="store_true", help="write no files")
    g.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.config = DEFAULTS.replace({**given_overrides(args), **(QUICK if args.quick else {})})
    if args.quick:
        args.warmup = 2
        # One thread each: on a 2-core machine shared with other jobs, torch's 2 OpenMP threads
        # made steps 10-100x slower and erratic (measured 15 ms -> 0.2-2 s per step).
        args.threads = args.threads or 1
        if args.compile_modes is None:
            args.compile_modes = ["fp32"]
    return args


def specs_from_args(args) -> list[dict]:
    remats = [SELECTIVE if r == "selective" else r for r in args.remats]
    cfg = args.config
    steps, lr = cfg.optim.total_steps, cfg.optim.lr
    base = {"preset": cfg.model.preset, "num_layers": cfg.model.num_layers,
            "batch_size": cfg.data.batch_size, "seq_len": cfg.data.seq_len, "steps": steps,
            "warmup": args.warmup, "lr": lr, "seed": cfg.data.seed, "n_batches": 4,
            "threads": args.threads}
    # the optimizer of both sides: no warmup, cosine to lr/10 over the run (at least 2 steps)
    run = cfg.replace({"optim.min_lr": lr / 10, "optim.warmup_steps": 0,
                       "optim.total_steps": max(steps, 2)})
    out = []
    for mode in args.modes:
        for remat in remats:
            config = run.replace({"precision.mode": mode, "remat.policy": remat}).to_dict()
            for fw in args.frameworks:
                if fw == "torch-compile" and args.compile_modes and mode not in args.compile_modes:
                    continue
                out.append({**base, "framework": fw, "mode": mode, "remat": remat, "config": config})
    return out


# ---------------------------------------------------------------- one process per run


def run_in_subprocess(spec: dict, timeout: float) -> dict:
    """`python -m experiments.compare --worker SPEC` in a fresh process: its JSON line, or
    {"spec", "error"} with the exception line when it fails or runs past `timeout` seconds."""
    # `experiments` is not installed: the child runs from the repository root with the root on
    # PYTHONPATH, so it imports this checkout's experiments and jaxmem whatever the parent's cwd.
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if spec["framework"] != "jax":
        env["JAX_PLATFORMS"] = "cpu"  # jax only builds the weights there: keep it off the GPU
        env.update(cpu_isa.cap_env(env))  # torch's oneDNN off AMX where AMX dies (SIGILL)
    if spec.get("threads") == 1:  # CPU: one compute thread for XLA and torch alike
        env["OMP_NUM_THREADS"] = "1"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    cmd = [sys.executable, "-m", "experiments.compare", "--worker", json.dumps(spec)]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"spec": spec, "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        err = (p.stderr or p.stdout).strip().splitlines()
        # the exception line ("torch._dynamo.exc.Unsupported: ...") says more than the tail
        exc = [ln for ln in err if ln[:1].isalpha() and ("Error" in ln.split(":")[0]
                                                         or "exc." in ln.split(":")[0])]
        msg = " | ".join(exc[-2:] + err[-3:])
        return {"spec": spec, "error": f"exit {p.returncode}: {msg}"[:1200]}
    return json.loads(lines[-1])


def write_json(path: Path, doc: dict) -> None:
    """The document, replaced atomically: a crash while writing leaves the previous version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    specs = specs_from_args(args)
    results = []
    doc = {"date": datetime.date.today().isoformat(), "device": None,
           "host": f"{platform.machine()} {os.cpu_count()} cores", "versions": versions(),
           "args": {k: (str(v) if isinstance(v, Path) else v.to_dict() if k == "config" else v)
                    for k, v in vars(args).items() if k != "worker"},
           "selective_policy": {"jax": SELECTIVE, "torch": "SelectiveCheckpoint (mm + attention)"},
           "complete": False, "results": results, "ratios": []}
    out = None

    def save() -> None:
        """Write the document as it stands. Called after every run, so a crash later (another
        run, the report, the chart) never loses the runs already measured (on a GPU, minutes)."""
        nonlocal out
        if args.no_save:
            return
        if out is None:  # named after the first run's device (the jax run comes first)
            run = "quick" if args.quick else args.config.model.preset
            stem = f"compare-{run}-{(doc['device'] or 'x').split(':')[0]}"
            out = args.out or new_result_file(stem, companions=(".png",))  # never a tracked file
        write_json(out, doc)

    for spec in specs:
        r = run_in_subprocess(spec, args.timeout)
        results.append(r)
        doc["device"] = doc["device"] or next(
            (x["device"] for x in results if x.get("spec", {}).get("framework") == "jax"
             and "device" in x), None)
        save()
        if not args.json:
            msg = r.get("error") or (f"saved {mib(r.get('saved_bytes'))} MiB, "
                                     f"{r['tokens_per_s']:,.0f} tok/s, loss {r['loss']:.4f}")
            print(f"[{spec['framework']:>13s} {spec['mode']:>8s} {remat_label(spec['remat']):>9s}] "
                  f"{msg}",
                  file=sys.stderr, flush=True)
    add_mfu(results)
    doc["ratios"] = rows = add_ratios(results)
    doc["complete"] = True
    save()
    dev = doc["device"]
    if out is not None:
        doc["written"] = [str(out)]
        try:
            write_chart(out.with_suffix(".png"), results)
            doc["written"].append(str(out.with_suffix(".png")))
        except PlotError as e:  # matplotlib missing: the measured JSON is kept regardless
            print(f"no chart: {e}", file=sys.stderr)
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"date {doc['date']}  device {dev}  host {doc['host']}  versions {doc['versions']}")
        print(format_table(results, rows))
        for w in doc.get("written", []):
            print("wrote", w)
    return 0
