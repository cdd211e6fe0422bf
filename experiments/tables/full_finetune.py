"""A full fine-tune on one card, with and without its state in host memory: the table of
docs/memory.md "A full fine-tune on one card".

    python -m experiments.tables.full_finetune [--presets llama-3.2-1b,...] [--seq 2048]
                                               [--cards rtx4090,h100] [--timeout 1200]

Each cell is `python -m jaxmem.memory ... --target CARD --json` in a process of its own: the train
step compiled by the card's own XLA compiler without the card (deviceless: no autotuning, no
cuDNN / cuBLAS workspaces, no fragmentation), its device peak. A fine-tune starts from
`--init-from` weights, which go straight to where the state keeps them; the program that makes a
fresh random state (jaxmem.memory's "state" phase, one fp32 leaf at a time on the device) is not
what is judged here, nor are the evaluation and the end-of-run sample, which hold less than the
step (their analytic figures are in the JSON). The step: bf16-sr weights, 8-bit AdamW, remat
full, batch 1 x `--seq`, `--optimizer-in-backward`; the variants:

    on the card          nothing offloaded
    optimizer on host    --offload-optimizer host
    + weights on host    --offload-optimizer host --offload-params host

The 12 and 24 GB columns are judged on the RTX 4090's program, the 48 and 80 GB ones on the
H100's (the first two `--cards`): "yes" within jaxmem.xla.verdict.usable_bytes at XLA's default
share (.75), "pre-off" only with XLA_PYTHON_CLIENT_PREALLOCATE=false (the whole card less 0.5 GiB
of CUDA context), else "no". Beside them: the pinned host memory, the bytes over PCIe per step
(jaxmem.memory.transfers) and the predicted step time of the card's compiled step with its
seconds on the host link (jaxmem.memory.seconds). Prints markdown and writes experiments/results/full_finetune_<date>.json.
"""

from __future__ import annotations

import argparse
import json
import time

from experiments.common.resultfiles import new_result_file
from experiments.tables.what_fits import run_memory, verdict

GiB = 2**30
STEP = ["--precision", "bf16-sr", "--optimizer", "adamw8bit", "--remat", "full",
        "--optimizer-in-backward", "--batch-size", "1"]
VARIANTS = {"on the card": [],
            "optimizer on host": ["--offload-optimizer", "host"],
            "+ weights on host": ["--offload-optimizer", "host", "--offload-params", "host"]}
BUDGETS = {12: 0, 24: 0, 48: 1, 80: 1}  # GiB -> which of --cards' programs judges it


def cell(r: dict) -> dict:
    """One compiled run's figures: the largest phase, the step, the host and link figures."""
    if "error" in r:
        return {"error": r["error"]}
    t = r.get("transfers") or {}
    step = r["compiled"].get("device_peak_bytes", r["compiled"]["peak_bytes"])
    return {"peak_bytes": step, "phases_analytic": {
                p["name"]: p["analytic_bytes"] for p in r["phases"]["phases"]},
            "host_bytes": t.get("host_bytes", 0), "pcie_bytes": t.get("pcie_bytes", 0),
            "step_s": (r.get("time") or {}).get("seconds"),
            "transfer_s": ((r.get("time") or {}).get("busy_seconds") or {}).get("host transfer"),
            "seconds": r.get("seconds")}


def markdown(rows: list[dict], cards: list[str]) -> str:
    head = ("| model | state | " + " | ".join(f"{g} GB" for g in BUDGETS)
            + f" | step peak ({cards[0]} / {cards[1]}), GiB | host RAM | PCIe / step "
            f"| predicted step ({cards[0]} / {cards[1]}) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        c = row["cells"]
        if any("error" in c[k] for k in cards):
            err = next(c[k]["error"] for k in cards if "error" in c[k])
            lines.append(f"| {row['preset']} | {row['variant']} | error: {err} |")
            continue
        judged = [verdict(c[cards[i]]["peak_bytes"], g) for g, i in BUDGETS.items()]
        times = " / ".join(f"{c[k]['step_s']:.2f} s ({c[k]['transfer_s']:.2f} s on the link)"
                           if c[k]["step_s"] is not None else "-" for k in cards)
        lines.append(
            f"| {row['preset']} | {row['variant']} | " + " | ".join(judged)
            + f" | {c[cards[0]]['peak_bytes'] / GiB:.2f} / {c[cards[1]]['peak_bytes'] / GiB:.2f}"
            f" | {c[cards[1]]['host_bytes'] / GiB:.1f} GiB | {c[cards[1]]['pcie_bytes'] / 1e9:.1f}"
            f" GB | {times} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="llama-3.2-1b,llama-3.2-3b,llama-3.1-8b,llama-3.1-70b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--cards", default="rtx4090,h100",
                    help="the programs judged for 12 / 24 GB and for 48 / 80 GB")
    ap.add_argument("--timeout", type=float, default=1200)
    args = ap.parse_args(argv)
    cards = args.cards.split(",")
    if len(cards) != 2:
        ap.error("--cards takes two cards: the 12 / 24 GB judge and the 48 / 80 GB one")
    rows = []
    for preset in args.presets.split(","):
        for variant, flags in VARIANTS.items():
            row = {"preset": preset, "variant": variant, "flags": STEP + flags, "cells": {}}
            for card in cards:
                t = time.time()
                r = run_memory(["--preset", preset, "--seq-len", str(args.seq), *STEP, *flags,
                                "--target", card], args.timeout)
                row["cells"][card] = cell(r)
                print(f"{preset:<16} {variant:<20} {card:<8} "
                      f"{row['cells'][card].get('peak_bytes', 0) / GiB:7.2f} GiB "
                      f"({time.time() - t:.0f} s){' ' + r['error'] if 'error' in r else ''}",
                      flush=True)
            rows.append(row)
    table = markdown(rows, cards)
    print("\n" + table)
    path = new_result_file("full_finetune")
    path.write_text(json.dumps({"seq_len": args.seq, "cards": cards, "rows": rows,
                                "markdown": table}, indent=2))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
