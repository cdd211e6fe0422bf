"""fp8's GEMMs against bf16's, each with the weights it keeps: the table of docs/results.md
"fp8 on the 8B, predicted".

    python -m experiments.tables.fp8_speed [--card h100] [--batch-size 4] [--timeout 900]

The 8B (llama-3-8b, adamw8bit, remat full, 2048-token rows) in four precision modes, each
`python -m jaxmem.memory <config> --target CARD --json` in a process of its own (an fp8 mode sets
its XLA flags before jax starts): the step compiled deviceless by the card's own compiler, its
predicted tok/s (jaxmem.memory.seconds; a prediction, not a measurement) and compiled peak.
The pairs compared keep the same weights, so only the GEMMs differ:
    amp-bf16 -> fp8      fp32 master weights, bf16 / fp8 GEMMs
    bf16-sr  -> fp8-sr   bf16 weights rounded stochastically, bf16 / fp8 GEMMs
Prints markdown and writes experiments/results/fp8_speed_<date>.json.
"""

from __future__ import annotations

import argparse
import json

from experiments.common.resultfiles import new_result_file
from experiments.tables.what_fits import predicted, run_memory

MODES = {"amp-bf16": "fp32 master", "fp8": "fp32 master", "bf16-sr": "bf16 (SR)",
         "fp8-sr": "bf16 (SR)"}  # each mode and the weights it keeps
PAIRS = (("fp8", "amp-bf16"), ("fp8-sr", "bf16-sr"), ("fp8-sr", "amp-bf16"))


def config(mode: str, batch_size: int) -> tuple[str, ...]:
    return ("--preset", "llama-3-8b", "--precision", mode, "--optimizer", "adamw8bit",
            "--remat", "full", "--batch-size", str(batch_size), "--seq-len", "2048")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--card", default="h100", help="a jaxmem.target card (default h100)")
    ap.add_argument("--batch-size", type=int, default=4, help="rows of 2048 tokens (default 4)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per compile")
    args = ap.parse_args(argv)
    rows = {}
    for mode in MODES:
        argv = config(mode, args.batch_size)
        rows[mode] = {"mode": mode, "argv": list(argv),
                      **predicted(run_memory([*argv, "--target", args.card], args.timeout))}
        print(json.dumps({k: rows[mode][k] for k in ("mode", "tokens_per_s", "mfu",
                                                     "peak_bytes", "error")}), flush=True)
    lines = [f"llama-3-8b adamw8bit remat full {args.batch_size}x2048, {args.card} (deviceless, "
             "predicted)", "",
             "| mode | weights kept | predicted tok/s | MFU | busy s: gemm / fusion | "
             "compiled peak GiB |", "|---|---|---|---|---|---|"]
    for mode, r in rows.items():
        if r["error"] or r["tokens_per_s"] is None:
            lines.append(f"| {mode} | {MODES[mode]} | error: {r['error']} | | | |")
            continue
        b = r["busy"] or {}
        lines.append(f"| {mode} | {MODES[mode]} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
                     f"{b.get('gemm', 0):.3f} / {b.get('fusion', 0):.3f} | "
                     f"{r['peak_bytes'] / 2**30:.2f} |")
    lines.append("")
    ratios = {}
    for a, b in PAIRS:
        ta, tb = rows[a]["tokens_per_s"], rows[b]["tokens_per_s"]
        if ta and tb:
            ratios[f"{a} / {b}"] = ta / tb
            lines.append(f"- {a} / {b}: **{ta / tb:.2f}x**")
    table = "\n".join(lines)
    print("\n" + table)
    path = new_result_file("fp8_speed")
    path.write_text(json.dumps({"card": args.card, "batch_size": args.batch_size,
                                "rows": list(rows.values()), "ratios": ratios,
                                "markdown": table}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
