"""The memory table of docs/memory.md: analytic, compiled, measured and rule-of-thumb peaks.

    python -m experiments.tables.memory_table [--presets tiny,small,...] [--timeout 180]

For presets tiny, small, llama-3.2-1b, llama-3.2-3b, llama-3-8b in precision fp32, amp-bf16 and
bf16, remat none and full, batch 1 x 2048 tokens, Adam mu in the params' dtype: the analytic
peak (jaxmem.memory.search), the full train step compiled ahead of time on the current backend from
abstract shapes (each compile in its own process, killed after --timeout seconds: "timeout" in
the table), the device's measured peak where the backend reports one (a GPU; one process per
configuration), and the rule of thumb (4 B/param fp32 weights, 16 B/param mixed-precision Adam).
Prints a markdown table and writes experiments/results/memory_table_<date>.json.

The tiny preset's max_position_embeddings (512) is raised to 2048 here: positions are RoPE, so
no parameter depends on it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from experiments.common.resultfiles import new_result_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRESETS = ["tiny", "small", "llama-3.2-1b", "llama-3.2-3b", "llama-3-8b"]
MODES = ["fp32", "amp-bf16", "bf16"]
REMATS = ["none", "full"]
SEQ = 2048


def spec_for(preset: str, precision: str, remat: str):
    from jaxmem.families import get_preset
    from jaxmem.memory.spec import StepSpec
    from jaxmem.model import RematPolicy
    from jaxmem.model.precision import get_precision
    model = get_preset(preset)
    if model.max_position_embeddings < SEQ:
        model = model.replace(max_position_embeddings=SEQ)
    return StepSpec.of(model, get_precision(precision), RematPolicy.parse(remat), 1, SEQ)


def one(preset: str, precision: str, remat: str, what: str) -> dict:
    """Child process: compile (or measure) one configuration, print JSON."""
    spec = spec_for(preset, precision, remat)
    if what == "measure":
        from jaxmem.memory.measure import measure_here
        return measure_here(spec)
    from jaxmem.memory.compiled import compile_step
    t = time.time()
    c = compile_step(spec)
    return {**c, "compile_s": round(time.time() - t, 1)}


def run_child(preset, precision, remat, what, timeout):
    # From the repository root, as a module: the child imports this checkout's jaxmem.
    cmd = [sys.executable, "-m", "experiments.tables.memory_table", "--one", preset, precision, remat,
           what]
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout} s"}
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def gib(n):
    return f"{n / 2**30:.2f}" if isinstance(n, (int, float)) else n


def main():
    ap = argparse.ArgumentParser(prog="python -m experiments.tables.memory_table")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--timeout", type=int, default=180, help="seconds per compile")
    ap.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(*args.one)))
        return
    import jax
    from jaxmem.memory.analytic import analytic_breakdown, rule_of_thumb
    from jaxmem.memory.measure import measure_available
    no_measure = measure_available()
    rows = []
    for preset in args.presets.split(","):
        for precision in args.modes.split(","):
            for remat in REMATS:
                spec = spec_for(preset, precision, remat)
                a = analytic_breakdown(spec)
                c = run_child(preset, precision, remat, "compile", args.timeout)
                m = ({"peak_bytes": None, "note": "not measured, no GPU in this session"}
                     if no_measure else run_child(preset, precision, remat, "measure", 1800))
                rot = rule_of_thumb(a["params"])
                row = {"preset": preset, "precision": precision, "remat": remat, "batch_size": 1,
                       "seq_len": SEQ, "params": a["params"], "analytic_bytes": a["total_bytes"],
                       "analytic": a["components"], "compiled": c, "measured": m,
                       "rule_4B": rot["fp32 weights (4 B/param)"],
                       "rule_16B": rot["mixed-precision Adam (16 B/param)"]}
                peak = c.get("peak_bytes")
                row["analytic_over_compiled"] = a["total_bytes"] / peak if peak else None
                rows.append(row)
                print(f"{preset} {precision} {remat}: analytic {gib(a['total_bytes'])} GiB, "
                      f"compiled {gib(peak) if peak else c.get('error')}", file=sys.stderr,
                      flush=True)
    print(f"\nbackend {jax.default_backend()}, jax {jax.__version__}, batch 1 x {SEQ} tokens, "
          f"GiB (2^30 bytes)\n")
    print("| preset | params | precision | remat | analytic | compiled | analytic/compiled | "
          "measured | 4 B/param | 16 B/param | 16 B/param / compiled |")
    print("|---|---:|---|---|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        peak = r["compiled"].get("peak_bytes")
        ratio = f"{r['analytic_over_compiled']:.3f}" if peak else "—"
        comp = gib(peak) if peak else r["compiled"]["error"]
        meas = gib(r["measured"]["peak_bytes"]) if r["measured"].get("peak_bytes") else \
            r["measured"]["note"]
        print(f"| {r['preset']} | {r['params'] / 1e6:,.1f}M | {r['precision']} | {r['remat']} | "
              f"{gib(r['analytic_bytes'])} | {comp} | {ratio} | {meas} | {gib(r['rule_4B'])} | "
              f"{gib(r['rule_16B'])} | {r['rule_16B'] / peak if peak else float('nan'):.2f} |")
    out = new_result_file("memory_table")  # a new dated file: never overwrites a tracked one
    with open(out, "w") as f:
        json.dump({"backend": jax.default_backend(), "jax_version": jax.__version__,
                   "rows": rows}, f, indent=1)
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
