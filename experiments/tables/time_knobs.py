"""The JAX GPU anchors' XLA knobs, each in the time model's prediction and the compiled peak:
the table of docs/results.md "The anchors' knobs, predicted".

    python -m experiments.tables.time_knobs [--card h100] [--timeout 900]

Each cell is `python -m jaxmem.memory <config> --target CARD --json` in a process of its own with
one knob in XLA_FLAGS (the flags must be set before jax starts): the step compiled by the card's
own compiler, deviceless, its predicted tok/s (jaxmem.memory.seconds) and its compiled peak.
What a deviceless compile cannot show is said beside each knob: a knob that acts at run time
(CUDA graphs) or through autotuning changes nothing here and must be measured on a GPU.

The knobs (NVIDIA JAX-Toolbox docs/GPU_performance.md, MaxText's GPU scripts; shared/DESIGN.md):
    --xla_gpu_enable_triton_gemm=false        cuBLAS GEMMs instead of Triton's (MaxText sets it)
    --xla_disable_hlo_passes=rematerialization XLA's own remat pass off (every MaxText GPU script)
    --xla_gpu_enable_latency_hiding_scheduler=true  the scheduler of jax_optimization_level O1
    --xla_gpu_enable_command_buffer=           CUDA graphs off (run time only: not visible here)
    JAX_OPTIMIZATION_LEVEL=O1                  jax's own level (the anchors' jax_optimization_level)
Prints markdown and writes experiments/results/time_knobs_<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os

from experiments.common.resultfiles import new_result_file
from experiments.tables.what_fits import predicted, run_memory

CONFIGS = {
    "1b amp-bf16 dots_no_batch 16x2048 AdamW": (
        "--preset", "llama-3.2-1b", "--precision", "amp-bf16", "--remat", "dots_no_batch",
        "--batch-size", "16", "--seq-len", "2048"),
    "8b bf16-sr adamw8bit full 8x2048": (
        "--preset", "llama-3-8b", "--precision", "bf16-sr", "--optimizer", "adamw8bit",
        "--remat", "full", "--batch-size", "8", "--seq-len", "2048"),
}
# knob -> (XLA_FLAGS, other environment variables): jax's own optimization level is a jax
# option (jax 0.10.2 has it too: `jax_optimization_level`), set through its variable
KNOBS = {
    "default": ("", {}),
    "cuBLAS GEMMs": ("--xla_gpu_enable_triton_gemm=false", {}),
    "XLA remat pass off": ("--xla_disable_hlo_passes=rematerialization", {}),
    "latency-hiding scheduler": ("--xla_gpu_enable_latency_hiding_scheduler=true", {}),
    "jax_optimization_level O1": ("", {"JAX_OPTIMIZATION_LEVEL": "O1"}),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--card", default="h100")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    rows, base = [], os.environ.get("XLA_FLAGS", "")
    for name, flags in CONFIGS.items():
        for knob, (xla, env) in KNOBS.items():
            os.environ["XLA_FLAGS"] = f"{base} {xla}".strip()
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                r = run_memory([*flags, "--target", args.card], args.timeout)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            row = {"config": name, "knob": knob, "xla_flags": xla, "env": env, **predicted(r)}
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("config", "knob", "tokens_per_s", "mfu",
                                                   "peak_bytes", "error")}), flush=True)
    os.environ["XLA_FLAGS"] = base
    lines = ["| config | knob | predicted tok/s | MFU | kernels | compiled peak GiB |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if r["error"] or r["tokens_per_s"] is None:
            lines.append(f"| {r['config']} | {r['knob']} | error: {r['error']} | | | |")
            continue
        lines.append(f"| {r['config']} | {r['knob']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['mfu']:.1%} | {r['kernels']:,} | {r['peak_bytes'] / 2**30:.2f} |")
    table = "\n".join(lines)
    print("\n" + table)
    path = new_result_file("time_knobs")
    path.write_text(json.dumps({"card": args.card, "rows": rows, "markdown": table}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
