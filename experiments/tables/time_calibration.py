"""The time model against every GPU row measured so far: the table of docs/results.md
"Predicted against measured".

    python -m experiments.tables.time_calibration [--rows NAME ...] [--timeout 900]
        [--at COMMIT]

Each row is `python -m jaxmem.memory <the row's flags> --target CARD --json` in a process of its
own (the gpu-plan extra): the step compiled by the card's own XLA compiler, deviceless, and its
predicted tok/s (jaxmem.memory.seconds, one set of constants for every row), set beside the
tok/s measured on that card. The programs compiled are TODAY's: a row measured at an older commit
ran an older program (the commit is printed with it), which the table says rather than hides.
`--at COMMIT` compiles each row with that commit's own planner instead (a git worktree of it,
XLA dumping the optimized step), and runs today's time model on the program that commit made:
the program a row measured at COMMIT ran. A commit whose planner has no `--target` (before
4a55a87, e.g. 25ec38c, the first GPU session's) is run through old_planner_on_card.py, which
compiles its planner's programs for the deviceless card as `--target` does today.
`--at own` compiles each row at the commit it was measured at.

Measured rows (docs/results.md, experiments/results/gpu_check_h200_2026-11-27*.md):
- H100 80GB HBM3, 2026-11-23, commit 25ec38c, jax 0.11.2: the first GPU session (DESIGN.md);
  the 8B rows there made the state under jax.jit by hand (`jaxmem.train` ran out of memory then);
  the compare rows are `experiments.compare` amp-bf16 4x2048.
- H200, 2026-11-27, commits 4a55a87 / 27cf40f, jax 0.11.2: `experiments.gpu_check`.
Prints markdown and writes experiments/results/time_calibration_<date>.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.common.resultfiles import new_result_file
from experiments.tables.what_fits import run_memory

_1B = ("--preset", "llama-3.2-1b", "--seq-len", "2048")
_8B = ("--preset", "llama-3-8b", "--seq-len", "2048", "--precision", "bf16-sr",
       "--optimizer", "adamw8bit", "--remat", "full")
_AMP = ("--precision", "amp-bf16")
_LORA = (*_1B, *_AMP, "--remat", "full", "--batch-size", "1", "--lora-rank", "16",
         "--lora-alpha", "32")
_IB = ("--optimizer-in-backward", "--offload-optimizer", "host")
_SELECTIVE = "names:query,key,value,attn_context,mlp_gate,mlp_up"

# name, card, measured tok/s, commit, where it was measured, the planner's flags
ROWS = [
    ("1b-adamw", "h100", 39_316, "25ec38c", "DESIGN.md H100 table",
     (*_1B, *_AMP, "--remat", "full", "--batch-size", "8")),
    ("1b-adamw8bit", "h100", 36_509, "25ec38c", "DESIGN.md H100 table",
     (*_1B, *_AMP, "--remat", "full", "--batch-size", "8", "--optimizer", "adamw8bit")),
    ("1b-fp8", "h100", 25_783, "25ec38c", "DESIGN.md H100 table",
     (*_1B, "--precision", "fp8", "--remat", "full", "--batch-size", "8")),
    ("8b-1x2048", "h100", 2_926, "25ec38c", "DESIGN.md H100 table (state made by hand)",
     (*_8B, "--batch-size", "1")),
    ("8b-4x2048", "h100", 5_461, "25ec38c", "DESIGN.md H100 table (state made by hand)",
     (*_8B, "--batch-size", "4")),
    ("qlora-nf4", "h100", 40_734, "25ec38c", "DESIGN.md H100 table",
     (*_LORA, "--quantize-base", "nf4", "--double-quant")),
    ("lora-bf16", "h100", 45_552, "25ec38c", "DESIGN.md H100 table",
     (*_LORA, "--quantize-base", "none")),
    ("compare-none", "h100", 45_403, "25ec38c", "experiments.compare log, DESIGN.md",
     (*_1B, *_AMP, "--remat", "none", "--batch-size", "4")),
    ("compare-full", "h100", 37_072, "25ec38c", "experiments.compare log, DESIGN.md",
     (*_1B, *_AMP, "--remat", "full", "--batch-size", "4")),
    ("compare-selective", "h100", 45_169, "25ec38c", "experiments.compare log, DESIGN.md",
     (*_1B, *_AMP, "--remat", _SELECTIVE, "--batch-size", "4")),
    ("1b-adamw", "h200", 42_442, "4a55a87", "gpu_check_h200_2026-11-27.md",
     (*_1B, *_AMP, "--remat", "full", "--batch-size", "8")),
    ("8b-1x2048", "h200", 3_463, "27cf40f", "gpu_check_h200_2026-11-27-3.md",
     (*_8B, "--batch-size", "1")),
    ("8b-opt-host", "h200", 1_392, "27cf40f", "gpu_check_h200_2026-11-27-3.md",
     (*_8B, "--batch-size", "1", *_IB)),
    ("8b-both-host", "h200", 895, "27cf40f", "gpu_check_h200_2026-11-27-3.md",
     (*_8B, "--batch-size", "1", *_IB, "--offload-params", "host")),
    ("8b-both-host-4x", "h200", 2_864, "27cf40f", "gpu_check_h200_2026-11-27-4.md",
     (*_8B, "--batch-size", "4", *_IB, "--offload-params", "host")),
]


def _worktree(commit: str) -> Path:
    """A git worktree of `commit` under the temporary directory (made once, reused)."""
    root = Path(__file__).resolve().parents[2]
    path = Path(tempfile.gettempdir()) / f"jaxmem-at-{commit}"
    if not path.exists():
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(path), commit],
                       check=True, capture_output=True)
    return path


def run_at(commit: str, flags: list[str], card: str, timeout: float) -> dict:
    """`python -m jaxmem.memory FLAGS --target CARD` by `commit`'s own code, its optimized step
    dumped by XLA, and today's time model (jaxmem.memory.seconds) on that program: predict()'s
    dict with tokens_per_s and mfu, or {"error": ...}."""
    from jaxmem.memory.seconds import predict
    from jaxmem.families import get_preset
    from jaxmem.families.params import model_flops
    from jaxmem.target import CARDS, target_config

    tree = _worktree(commit)
    with tempfile.TemporaryDirectory(prefix="jaxmem-at-dump-") as dump:
        env = {**os.environ, "PYTHONPATH": str(tree),
               "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} "
                            "--xla_dump_hlo_as_text --xla_dump_hlo_pass_re=NONE".strip()}
        if (tree / "jaxmem" / "target").exists():
            command = [sys.executable, "-m", "jaxmem.memory", *flags, "--target", card]
        else:  # no --target at that commit: its planner inside a deviceless card's compile
            config = Path(dump) / "card.txtpb"
            config.write_text(target_config(CARDS[card]))
            env["JAXMEM_CARD_CONFIG"] = str(config)
            command = [sys.executable, str(Path(__file__).with_name("old_planner_on_card.py")),
                       *flags]
        try:
            p = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True,
                               timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timeout after {timeout:g} s"}
        # the step is the largest optimized module the planner compiled
        hlo = sorted(glob.glob(f"{dump}/*after_optimizations.txt"), key=os.path.getsize)
        if p.returncode != 0 or not hlo:
            return {"error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1][:300]}
        t = predict(Path(hlo[-1]).read_text(), CARDS[card])
    value = lambda flag: flags[flags.index(flag) + 1]  # noqa: E731
    seq = int(value("--seq-len"))
    tok_s = int(value("--batch-size")) * seq / t["seconds"]
    mfu = model_flops(get_preset(value("--preset")), seq) * tok_s / t["machine"]["flops"]
    return {**t, "tokens_per_s": tok_s, "mfu": mfu}


def markdown(rows: list[dict]) -> str:
    lines = ["| row | card | measured tok/s (commit) | predicted tok/s | predicted / measured | "
             "predicted MFU | busy s: gemm / attention / fusion / copy / host | costliest class | "
             "arithmetic beyond (s) | predicted / measured were it a bound |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | {r['card']} | {r['measured']:,} ({r['commit']}) | "
                         f"error: {r['error']} | | | | | | |")
            continue
        b = r["busy"]
        busy = " / ".join(f"{b.get(k, 0):.3f}" for k in ("gemm", "attention", "fusion", "copy",
                                                           "host transfer"))
        lines.append(
            f"| {r['row']} | {r['card']} | {r['measured']:,} ({r['commit']}) | "
            f"{r['predicted']:,.0f} | {r['ratio']:.2f} | {r['mfu']:.1%} | {busy} | "
            f"{max(b, key=b.get)} | {r['arithmetic_beyond']:.3f} | "
            f"{r['ratio_with_arithmetic']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", help="row names (default: every row)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--at", metavar="COMMIT",
                    help="compile each row with this commit's planner (today's time model); "
                         "'own': each row at the commit it was measured at")
    args = ap.parse_args(argv)
    from jaxmem import target
    target.prepare()  # this process compiles nothing: JAX on the CPU, not probing for a GPU
    rows = []
    for name, card, measured, commit, source, flags in ROWS:
        if args.rows and name not in args.rows:
            continue
        t0 = time.time()
        at = commit if args.at == "own" else args.at
        if at:
            r = run_at(at, list(flags), card, args.timeout)
            r = r if "error" in r else {"time": r, "compiler": f"the planner at {at}"}
        else:
            r = run_memory([*flags, "--target", card], args.timeout)
        row = {"row": name, "card": card, "measured": measured, "commit": commit,
               "source": source, "flags": list(flags), "compiled_at": at or "today"}
        if "error" in r or not r.get("time"):
            row["error"] = r.get("error", "no predicted time")
        else:
            t = r["time"]
            # jaxmem.xla.alu's arithmetic at the card's full issue rate, had it bounded each
            # kernel it exceeds (not in the prediction: docs/results.md says why)
            beyond = t.get("arithmetic_beyond_seconds", 0.0)
            with_arith = t["tokens_per_s"] * t["seconds"] / (t["seconds"] + beyond)
            row.update(arithmetic_beyond=beyond, ratio_with_arithmetic=with_arith / measured)
            row.update(predicted=t["tokens_per_s"], ratio=t["tokens_per_s"] / measured,
                       mfu=t["mfu"], seconds=t["seconds"], busy=t["busy_seconds"],
                       costliest=t["costliest"][:3], kernels=t["kernels"],
                       unknown_loops=t["unknown_loops"], compiler=r.get("compiler"))
        rows.append(row)
        print(f"{name:<18} {card:<5} measured {measured:>7,}  predicted "
              f"{row.get('predicted', float('nan')):>9,.0f}  ratio {row.get('ratio', float('nan')):.2f}"
              f"  ({time.time() - t0:.0f} s){' ' + row['error'] if 'error' in row else ''}",
              flush=True)
    table = markdown(rows)
    print("\n" + table)
    ok = [r for r in rows if "ratio" in r]
    if ok:
        within = sum(0.8 <= r["ratio"] <= 1.2 for r in ok)
        print(f"\n{within} of {len(ok)} rows within +-20% of their measured tok/s")
    path = new_result_file("time_calibration" + (f"_at_{args.at}" if args.at else ""))
    path.write_text(json.dumps({"rows": rows, "markdown": table}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
