"""The first command of any session with a GPU: every GPU claim of jaxmem, measured, in one table.

    PYTHONPATH=. python -m experiments.gpu_check --out gpu_check         # one H100: ~9 min
    PYTHONPATH=. python -m experiments.gpu_check --out gpu_check --suite # + the whole test suite
    python -m experiments.gpu_check --smoke --out /tmp/g                 # CPU: the same rows, tiny

It writes DIR/gpu_check.md (a markdown table) and DIR/gpu_check.json, both rewritten as each row
finishes, so nothing measured is lost when a later row dies; each row's output goes to
DIR/logs/ROW.log and its run directory to DIR/runs/ROW (checkpoints deleted after the row unless
--keep-runs: an 8B state is 33 GiB). A row is `ok`, `FAILED` (with the last line of its error) or
`skipped` (with the reason). The exit status is 1 when any row FAILED, naming them; 2 for bad
flags. Rows (`--rows` picks some; experiments.gpu_check.rows has the exact flags):

    gpu-tests     pytest -m gpu
    1b-adamw      llama-3.2-1b amp-bf16 remat full 8x2048, AdamW: tok/s, MFU, measured peak
    1b-adamw8bit  the same with --optimizer adamw8bit       (GPU peak_bytes_in_use, from the run's
    1b-fp8        the same with --precision fp8              metrics.jsonl) against the plan
    8b-1x2048     llama-3-8b bf16-sr + adamw8bit remat full, 1x2048 and 4x2048, and 8x2048
    8b-4x2048     with --remat full+untiled (what --fit 80 picks for a global batch of 8: the
    8b-8x2048-untiled  issue 51 target, 46.1% MFU predicted on the H100)
    8b-1x2048-pallas   8b-1x2048 with --update-kernel pallas (the 8-bit update as one Triton
                  kernel per leaf: the 1x2048 target, 34.8% MFU predicted on the H100; its
                  numbers against XLA's loop are a gpu-tests test)
    8b-fp8-sr-4x2048   8b-4x2048 with --precision fp8-sr (fp8 GEMMs on bf16-sr's weights: the
                  fp8 target, 1.35x 8b-4x2048 predicted on the H100)
    8b-opt-host   8b-1x2048 with --optimizer-in-backward and --offload-optimizer host; both-host:
    8b-both-host  + --offload-params host; both-host-4x: the same at 4x2048 (docs/memory.md's
    8b-both-host-4x  full fine-tune on one card, measured)
    qlora-nf4     LoRA r16 (7 targets) on a random 1B-shaped HF checkpoint made on the spot: NF4 +
    lora-bf16     double quant base, and a bf16 base; amp-bf16 remat full 1x2048
    fp8-diag      python -m experiments.fp8_diag --json: fp8 einsums traced vs f8 cuBLAS calls in
                  the optimized HLO, and the top kernels by time (skipped if the module is absent)
    compare-none  python -m experiments.compare, llama-3.2-1b amp-bf16 4x2048, remat none / full:
    compare-full  jax, torch eager, torch.compile
    suite         with --suite: the whole test suite, pytest -n 8 (no -n without pytest-xdist)

The plan of a train row is `python -m jaxmem.memory ... --json` for the same flags: the analytic
total and XLA's compiled peak, side by side with the measured peak and their ratio, so one run
calibrates the planner (docs/memory.md "Calibration"). `--plan target` compiles every phase of
the run (`--compile`) with `--target CARD` in the background while the GPU rows run: the GPU's
own compiler without the GPU (deviceless: no autotuning, workspaces or fragmentation), the
prediction a user without the card gets; CARD is `--plan-card`, by default the card of
nvidia-smi's name (else h100). `--plan cpu` compiles the step on the CPU (not a GPU's program:
the 1B step is 22% below the H100's); `--plan gpu` on the GPU after each row, a few minutes
more; `--plan off`. The default, auto, is target where XLA's GPU compiler is installed (jax with
CUDA has it), else cpu.

Every row is its own subprocess (one configuration per process: the GPU peak never goes down)
with XLA_PYTHON_CLIENT_PREALLOCATE=false (and a memory fraction of .95 for the train rows, as
the 8B step needs) and its own time limit. It needs jax, flax, optax, orbax; torch for the compare
rows, tokenizers + safetensors for the LoRA rows (else skipped, saying so), and no install of
jaxmem (run it from the repository root with PYTHONPATH=.). `--budget` (default 540 s without
--smoke) skips the rows that would start after it, naming the flag to run them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import importlib.util
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

from experiments.common import cpu_isa
from experiments.gpu_check.rows import (ROOT, Row, compare_numbers, diag_note, last_record,
                                        plan_numbers, pytest_counts, rows, target_card,
                                        target_installed, train_metrics)
from experiments.gpu_check.procs import child_env, error_line, run
from experiments.gpu_check.profiled import profile_row
from experiments.gpu_check.table import commit, gpu_name, markdown, versions, write_report

PROG = "python -m experiments.gpu_check"
_clock = time.perf_counter  # the budget's clock (a test replaces it)


def parse_args(argv=None):
    names = [r.name for r in rows(False)]
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="directory for gpu_check.md, gpu_check.json, logs/ and runs/ (created)")
    p.add_argument("--rows", nargs="+", default=None, metavar="ROW",
                   help=f"run only these rows, in the table's order: {', '.join(names)} "
                        f"(default: all but suite)")
    p.add_argument("--suite", action="store_true",
                   help="also run the whole test suite (pytest -n 8, PREALLOCATE=false) and list "
                        "every failure and error by name")
    p.add_argument("--smoke", action="store_true",
                   help="the same rows at tiny sizes (tiny preset, batch 2 x 32, 3 steps, a tiny "
                        "HF checkpoint, compare without torch.compile): a CPU check of this script")
    p.add_argument("--steps", type=int, default=None,
                   help="train steps per train row (default: 10, --smoke 3); tok/s leaves out the "
                        "first 2 (compilation)")
    p.add_argument("--plan", choices=("auto", "target", "cpu", "gpu", "off"), default="auto",
                   help="where the train rows' plans compile: target (background, every phase "
                        "with the GPU's compiler and no GPU: --target), cpu (background, the "
                        "CPU's program), gpu (after each row, the real compile), off; auto: "
                        "target where the CUDA plugin is installed, else cpu")
    p.add_argument("--plan-card", default=None, metavar="CARD",
                   help="the --target card of --plan target (default: nvidia-smi's GPU, else "
                        "h100)")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="skip rows that would start after this many seconds (0: no limit; "
                        "default: 540, with --smoke 0); the suite is exempt")
    p.add_argument("--profile", action="store_true",
                   help="train rows: a jax.profiler trace of the last 3 steps (jaxmem.train "
                        "--profile) and the GPU's own optimized HLO of the step (XLA dump); "
                        "writes DIR/ROW.profile.md and .json: measured seconds per kernel class "
                        "and the 30 costliest kernels beside the time model's prediction for the "
                        "same program (jaxmem.xla.profile)")
    p.add_argument("--keep-runs", action="store_true",
                   help="keep the train rows' checkpoints (default: delete them after each row)")
    p.add_argument("--make-hf", default=None, help=argparse.SUPPRESS)  # worker: the HF checkpoint
    args = p.parse_args(argv)
    if args.make_hf is not None:
        return args
    unknown = [r for r in args.rows or () if r not in names]
    if unknown:
        p.exit(2, f"{PROG}: error: --rows: unknown row {unknown[0]!r} (rows: {', '.join(names)})\n")
    if args.out.exists() and not args.out.is_dir():
        p.exit(2, f"{PROG}: error: --out {args.out}: exists and is not a directory\n")
    if args.steps is not None and args.steps < 3:
        p.exit(2, f"{PROG}: error: --steps {args.steps}: at least 3 (tok/s leaves out the "
                  f"first 2)\n")
    args.steps = args.steps or (3 if args.smoke else 10)
    if args.budget is None:
        args.budget = 0.0 if args.smoke else 540.0
    if args.plan == "auto":
        args.plan = "target" if target_installed() else "cpu"
    if args.plan_card is None:
        args.plan_card = target_card(gpu_name())
    from jaxmem.target._cards import CARDS  # noqa: PLC0415 (plain data: no jax)
    if args.plan_card not in CARDS:
        p.exit(2, f"{PROG}: error: --plan-card {args.plan_card!r}: not a card of jaxmem.target "
                  f"({', '.join(CARDS)})\n")
    return args


# ---------------------------------------------------------------- rows


def plan_cmd(row: Row, card: str | None = None) -> list[str]:
    target = ["--target", card, "--compile"] if card else []
    return [sys.executable, "-m", "jaxmem.memory", *row.model, *row.shape, *target, "--json"]


def run_plan(row: Row, out: Path, where: str, card: str | None = None) -> dict:
    """`where`: cpu, gpu or target (then `card`: the deviceless compile on this host's CPU)."""
    env = child_env(cpu_only=where != "gpu")
    if card:
        where = f"{card}, deviceless"
    report = out / "logs" / f"{row.name}.plan.json"
    res = run(plan_cmd(row, card), out / "logs" / f"{row.name}.plan.log", 900, env,
              stdout=report)
    if res["rc"] != 0 or res["timed_out"]:
        return {"error": error_line(res, 900), "where": where}
    doc = json.loads(report.read_text())
    return {**plan_numbers(doc), "where": where, "seconds": res["seconds"]}


def train_cmd(row: Row, args, run_dir: Path, hf_dir: Path | None) -> list[str]:
    init = ["--init-from", str(hf_dir)] if row.hf else []
    profile = ["--profile", str(run_dir / "profile")] if args.profile else []
    return [sys.executable, "-m", "jaxmem.train", *init, *row.shape, *row.train, *profile,
            "--steps", str(args.steps),
            "--warmup-steps", "1", "--eval-batches", "1", "--eval-every", "0", "--save-every", "0",
            "--max-new-tokens", "0", "--no-progress", "--no-tensorboard", "--out", str(run_dir)]


def pytest_cmd(files: list[str], suite: bool) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-rfE", "-p", "no:cacheprovider"]
    if suite:  # -v: every failure named as it happens, so a timeout still lists them
        return (cmd + (["-n", "8"] if importlib.util.find_spec("xdist") else [])
                + ["-v", "-m", "slow or not slow"])  # every test, as CI runs them
    return cmd + ["-q", "-m", "gpu", *files]


def run_row(row: Row, args, hf: dict) -> dict:
    """One row: its subprocess(es), then ok / FAILED / skipped with what it measured."""
    out = args.out
    log = out / "logs" / f"{row.name}.log"
    missing = [m for m in row.needs if importlib.util.find_spec(m) is None]
    if missing:
        return {"status": "skipped", "why": f"needs {', '.join(missing)} (not installed)"}
    if row.kind in ("pytest", "suite"):
        files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                       if "mark.gpu" in p.read_text())
        if row.kind == "pytest" and not files:
            return {"status": "skipped", "why": "no test is marked gpu"}
        res = run(pytest_cmd(files, row.kind == "suite"), log, row.timeout,
                  child_env(args.smoke))
        got = pytest_counts(res["text"])
        bad = got["failed"] + got["errors"]
        ok = not res["timed_out"] and res["rc"] in (0, 5) and not bad
        c = got["counts"]
        note = ", ".join(f"{v} {k}" for k, v in c.items()) or "no summary line"
        return {"status": "ok" if ok else "FAILED", "seconds": res["seconds"], "tests": got,
                "note": note, "error": None if ok else (
                    f"{len(got['failed'])} failed, {len(got['errors'])} errors"
                    + (f"; {error_line(res, row.timeout)}" if res["timed_out"] or not bad else ""))}
    if row.kind == "diag":
        if not (ROOT / "experiments" / "fp8_diag" / "__main__.py").is_file():
            return {"status": "skipped", "why": "experiments/fp8_diag/ is not in this checkout"}
        if args.smoke:
            return {"status": "skipped", "why": "--smoke: the diagnosis needs a GPU (cuBLAS fp8 "
                                                "GEMMs, a GPU profile)"}
        stdout = out / "logs" / f"{row.name}.stdout"
        res = run([sys.executable, "-m", "experiments.fp8_diag", "--json"], log, row.timeout,
                  child_env(args.smoke), stdout=stdout)
        lines = [ln for ln in stdout.read_text().splitlines() if ln.strip()][-1:]
        lines = [ln for ln in lines if ln.startswith("{")]  # its last stdout line is the JSON
        if res["rc"] != 0 or not lines:
            return {"status": "FAILED", "seconds": res["seconds"],
                    "error": error_line(res, row.timeout)}
        doc = json.loads(lines[-1])
        return {"status": "ok", "seconds": res["seconds"], "diag": doc, "note": diag_note(doc)}
    if row.kind == "compare":
        path = out / f"{row.name}.json"
        cmd = [sys.executable, "-m", "experiments.compare", *row.args, "--out", str(path),
               "--timeout", str(row.timeout / 2)]  # per framework run
        res = run(cmd, log, row.timeout, child_env(args.smoke))
        doc = json.loads(path.read_text()) if path.is_file() else {}
        metrics, note, failed = compare_numbers(doc)
        ok = res["rc"] == 0 and not res["timed_out"] and not failed and doc.get("complete")
        return {"status": "ok" if ok else "FAILED", "seconds": res["seconds"], **metrics,
                "note": note, "compare_json": str(path),
                "error": None if ok else ("; ".join(failed) or error_line(res, row.timeout))}
    # train
    if row.hf and hf.get("error"):
        return {"status": "FAILED" if hf.get("failed") else "skipped", "why": hf["error"],
                "error": hf["error"] if hf.get("failed") else None}
    run_dir = out / "runs" / row.name
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a fresh run, never a continuation of an earlier check
    env = child_env(args.smoke, XLA_PYTHON_CLIENT_MEM_FRACTION=".95")
    if args.profile:  # the step's own optimized HLO, for the prediction beside the profile;
        # compiled here, not loaded from a persistent cache (which dumps nothing)
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), f"--xla_dump_to={run_dir / 'hlo'}",
                                     "--xla_dump_hlo_as_text",
                                     "--xla_dump_hlo_module_re=.*train_step.*"]).strip()
        env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    res = run(train_cmd(row, args, run_dir, hf.get("dir")), log, row.timeout, env)
    metrics = train_metrics(last_record(run_dir / "metrics.jsonl"))
    if args.profile and res["rc"] == 0:
        metrics["profile"] = profile_row(row, run_dir, out, args.plan_card)
    if not args.keep_runs:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    ok = res["rc"] == 0 and not res["timed_out"]
    return {"status": "ok" if ok else "FAILED", "seconds": res["seconds"], **metrics,
            "error": None if ok else error_line(res, row.timeout)}


def make_hf_checkpoint(args, smoke: bool) -> dict:
    """The random HF checkpoint of the LoRA rows, made once, in its own CPU-only process."""
    missing = [m for m in ("tokenizers", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        return {"error": f"needs {', '.join(missing)} (not installed)"}
    d = args.out / "hf-random"
    if d.exists():
        shutil.rmtree(d)
    cmd = [sys.executable, "-m", "experiments.gpu_check", "--out", str(args.out),
           "--make-hf", "smoke" if smoke else "full"]
    res = run(cmd, args.out / "logs" / "make-hf.log", 600, child_env(cpu_only=True))
    if res["rc"] != 0 or res["timed_out"]:
        return {"error": "making the random HF checkpoint: " + error_line(res, 600), "failed": True}
    return {"dir": d / "hf", "seconds": res["seconds"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.make_hf is not None:
        from experiments.gpu_check.rows import make_hf
        make_hf(args.out / "hf-random", args.make_hf)
        return 0
    t0 = _clock()
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = [r for r in rows(args.smoke)
              if (r.name in args.rows if args.rows else r.name != "suite")
              or (r.name == "suite" and args.suite)]
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "mode": "smoke" if args.smoke else "full",
           "argv": sys.argv[1:] if argv is None else argv,
           "host": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
           "gpu": gpu_name(), "commit": commit(ROOT), "versions": versions(),
           "cpu_isa": cpu_isa.cap().as_record(),  # torch's oneDNN ISA cap (SIGILL on AMX VMs)
           "rows": [{"name": r.name, "kind": r.kind, "what": r.what, "status": "pending"}
                    for r in chosen],
           "total_s": None}
    write_report(args.out, doc)
    plans = {}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    if args.plan in ("cpu", "target"):  # compiled on the CPU while the GPU rows run
        card = args.plan_card if args.plan == "target" else None
        plans = {r.name: pool.submit(run_plan, r, args.out, args.plan, card) for r in chosen
                 if r.kind == "train"}
    hf = None
    for i, (row, rec) in enumerate(zip(chosen, doc["rows"])):
        elapsed = _clock() - t0
        if args.budget and elapsed > args.budget and row.kind != "suite":
            rec.update(status="skipped", why=f"the --budget of {args.budget:.0f} s was spent "
                                              f"(run it alone: --rows {row.name})")
            if row.name in plans and plans[row.name].cancel():  # no plan for a row not run
                del plans[row.name]
        else:
            print(f"[{i + 1}/{len(chosen)} {elapsed:5.0f} s] {row.name}: {row.what}",
                  file=sys.stderr, flush=True)
            rec["status"] = "running"
            write_report(args.out, doc)
            if row.hf and hf is None:
                hf = make_hf_checkpoint(args, args.smoke)
            rec.update(run_row(row, args, hf or {}))
            if args.plan == "gpu" and row.kind == "train":
                where = "cpu" if args.smoke else "gpu"  # --smoke never uses a GPU
                plans[row.name] = pool.submit(run_plan, row, args.out, where)
                plans[row.name].result()  # in sequence: nothing else on the GPU meanwhile
        _say(rec)
        _fill_plans(doc, plans, wait=False)
        write_report(args.out, doc)
    _fill_plans(doc, plans, wait=True)
    pool.shutdown()
    doc["total_s"] = _clock() - t0
    write_report(args.out, doc)
    print(markdown(doc))  # the table, for the session's notes
    failed = [r["name"] for r in doc["rows"] if r["status"] == "FAILED"]
    print(f"gpu_check: {len(doc['rows'])} rows in {doc['total_s']:.0f} s; wrote "
          f"{args.out / 'gpu_check.md'} and gpu_check.json", file=sys.stderr)
    for r in doc["rows"]:
        if r["status"] == "FAILED":
            print(f"gpu_check: FAILED {r['name']}: {r.get('error')}", file=sys.stderr)
    if failed:
        print(f"gpu_check: FAILED rows: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _fill_plans(doc: dict, plans: dict, wait: bool) -> None:
    for rec in doc["rows"]:
        f = plans.get(rec["name"])
        if f is not None and "plan" not in rec and (wait or f.done()):
            rec["plan"] = f.result()


def _say(rec: dict) -> None:
    s = rec["status"]
    detail = rec.get("why") or rec.get("error") or rec.get("note") or ""
    if rec.get("tokens_per_s"):
        detail = f"{rec['tokens_per_s']:,.0f} tok/s" + (
            f", peak {rec['peak_bytes'] / 2**30:.2f} GiB" if rec.get("peak_bytes") else "")
    secs = f" {rec['seconds']:.0f} s" if rec.get("seconds") else ""
    print(f"  {rec['name']}: {s}{secs} {detail}", file=sys.stderr, flush=True)
