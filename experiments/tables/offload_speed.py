"""The 8B in-backward step with its optimizer state, or its state and weights, on the host against
the same step on the card, predicted at several tokens per step on each card's own compiler: the
table of docs/results.md "Offload's speed by tokens per step" (issue 51's offload targets).

    python -m experiments.tables.offload_speed [--cards h100 rtx4090] [--batches 1 4 8 16]

Each cell is `python -m jaxmem.memory <config> --target CARD --json` in a process of its own: the
step compiled deviceless by the card's compiler (jax's CUDA plugin, the gpu-plan extra), its
predicted tok/s (jaxmem.memory.seconds: the kernels' times and the host transfers' overlap read
from the program's own schedule) and its compiled peak. The ratio is a row's predicted tok/s
over the ordinary on-card step's (no in-backward, no offload) at the same tokens per step on the
same card. Where the on-card step does not fit the card (the 8B on a 24 GB card), its predicted
time is still the card's compute for that step, and the table says it does not fit. All figures are predictions,
not measurements. Prints markdown and writes experiments/results/offload_speed_<date>.json.
"""

from __future__ import annotations

import argparse
import json

from experiments.common.resultfiles import new_result_file
from experiments.tables.what_fits import predicted, run_memory, verdict

BASE = ("--preset", "llama-3-8b", "--precision", "bf16-sr", "--optimizer", "adamw8bit",
        "--remat", "full", "--seq-len", "2048")
OIB = ("--optimizer-in-backward", "--clip", "0")  # as experiments.gpu_check's host rows
# "on card" is the ordinary step (the gpu_check row 8b-1x2048 and its batch sizes): the issue's
# reference for the offloaded rows; the in-backward step on the card is shown beside it
MODES = {
    "on card": (),
    "in-backward on card": OIB,
    "state on host": (*OIB, "--offload-optimizer", "host"),
    "state and weights on host": (*OIB, "--offload-optimizer", "host", "--offload-params", "host"),
}


def cell(card: str, batch: int, mode: str, timeout: float) -> dict:
    """One configuration's step on `card`: predicted tok/s and MFU, the step's compiled peak and
    whether it fits (what_fits.verdict: yes at XLA's default 75% of the card, pre-off at 95%)."""
    from jaxmem.target import CARDS
    p = predicted(run_memory([*BASE, *MODES[mode], "--batch-size", str(batch), "--target", card],
                             timeout))
    peak = p["peak_bytes"]
    return {"card": card, "batch": batch, "tokens": batch * 2048, "mode": mode, **p,
            "fits": verdict(peak, CARDS[card].memory_gib) if peak else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cards", nargs="+", default=["h100", "rtx4090"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8, 16])
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    rows = []
    for card in args.cards:
        for batch in args.batches:
            for mode in MODES:
                row = cell(card, batch, mode, args.timeout)
                rows.append(row)
                print(json.dumps(row), flush=True)
    on = {(r["card"], r["batch"]): r for r in rows if r["mode"] == "on card"}
    lines = ["| card | tokens per step | mode | predicted tok/s | x on card | MFU | "
             "compiled peak GiB | fits |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["error"] or r["tokens_per_s"] is None:
            lines.append(f"| {r['card']} | {r['tokens']:,} | {r['mode']} | error: {r['error']} "
                         "| | | | |")
            continue
        ref = on.get((r["card"], r["batch"])) or {}
        ratio = (f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}"
                 if ref.get("tokens_per_s") else "")
        peak = f"{r['peak_bytes'] / 2**30:.2f}" if r["peak_bytes"] else ""
        lines.append(f"| {r['card']} | {r['tokens']:,} | {r['mode']} | "
                     f"{r['tokens_per_s']:,.0f} | {ratio} | {r['mfu']:.1%} | {peak} | "
                     f"{r['fits']} |")
    table = "\n".join(lines)
    print("\n" + table)
    path = new_result_file("offload_speed")
    path.write_text(json.dumps({"config": list(BASE), "rows": rows, "markdown": table},
                               indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
