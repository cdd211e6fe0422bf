"""Loss after the same steps in every precision mode, on the same data, init and batches.

    python -m experiments.tables.precision_curves                      # tiny preset, 300 steps, CPU ~10 min
    python -m experiments.tables.precision_curves --steps 100 --modes fp32,amp-bf16
    python -m experiments.tables.precision_curves --name optimizers \
        --modes fp32,amp-bf16,fp32/adamw8bit,amp-bf16/adamw8bit,bf16,bf16-sr,bf16-sr/adamw8bit

A mode is a `--precision` value, optionally with `/OPTIMIZER` (`--optimizer`, default adamw).

Each mode runs `python -m jaxmem.train` in its own process (same seed, so the same init and the
same batches) and the final numbers are read back from each run's metrics.jsonl. Prints a table
and writes experiments/results/precision_<date>.json. The gap is
(mode's loss - fp32's loss) / fp32's loss, for the train loss averaged over the last 20 logged
steps and for the final eval loss; with an optimizer, also the eval gap against the same
precision with AdamW (`eval_gap_vs_adamw`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import jax

from experiments.common.resultfiles import new_result_file

MODES = ("fp32", "bf16", "amp-bf16", "amp-fp16", "fp8")


def run_mode(mode: str, steps: int, out: Path, extra: list[str]) -> dict:
    precision, _, optimizer = mode.partition("/")
    cmd = [sys.executable, "-m", "jaxmem.train", "--precision", precision, "--steps", str(steps),
           "--optimizer", optimizer or "adamw",
           "--out", str(out), "--log-every", "1", "--eval-every", "0", "--sample-tokens", "0",
           "--no-progress", "--save-every", "0", *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    tail = recs[-20:]
    return {"mode": mode, "train_loss_last20": sum(r["loss"] for r in tail) / len(tail),
            "eval_loss": recs[-1]["eval_loss"], "skipped_steps": sum(r["skipped"] for r in recs),
            "final_loss_scale": recs[-1]["loss_scale"],
            "tokens_per_sec": recs[-1]["tokens_per_sec"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.tables.precision_curves",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--name", default="precision", help="results file prefix")
    p.add_argument("train_args", nargs="*", help="extra flags for jaxmem.train (after --)")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            results.append(run_mode(mode, args.steps, Path(tmp) / mode.replace("/", "_"),
                                    args.train_args))
            print(f"  {mode}: done", file=sys.stderr, flush=True)
    ref = next((r for r in results if r["mode"] == "fp32"), None)
    for r in results:
        if ref:
            r["train_gap_vs_fp32"] = r["train_loss_last20"] / ref["train_loss_last20"] - 1
            r["eval_gap_vs_fp32"] = r["eval_loss"] / ref["eval_loss"] - 1
        same = next((s for s in results if s["mode"] == r["mode"].partition("/")[0]), None)
        if same is not None and same is not r:
            r["eval_gap_vs_adamw"] = r["eval_loss"] / same["eval_loss"] - 1
    report = {"date": datetime.date.today().isoformat(), "device": str(jax.devices()[0].device_kind),
              "backend": jax.default_backend(), "jax": jax.__version__,
              "python": platform.python_version(), "steps": args.steps,
              "train_args": args.train_args, "results": results}
    out = new_result_file(args.name)  # a new dated file: never overwrites a tracked one
    out.write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print("| mode | train loss (last 20) | eval loss | train gap | eval gap | eval gap vs same "
              "precision + AdamW | skipped | tokens/s |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in results:
            vs_adamw = f"{100 * r['eval_gap_vs_adamw']:+.2f}%" if "eval_gap_vs_adamw" in r else ""
            print(f"| {r['mode']} | {r['train_loss_last20']:.4f} | {r['eval_loss']:.4f} | "
                  f"{100 * r.get('train_gap_vs_fp32', 0):+.2f}% | {100 * r.get('eval_gap_vs_fp32', 0):+.2f}% | "
                  f"{vs_adamw} | "
                  f"{r['skipped_steps']} | {r['tokens_per_sec']:,.0f} |")
        print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
