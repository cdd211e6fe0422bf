"""What fits on an 80 GB H100 and on a 24 GB card: the tables of docs/memory.md "What fits".

    python -m experiments.tables.what_fits [--presets llama-3.2-1b,llama-3.1-8b] [--seqs 2048,8192,32768]
                                    [--cards h100] [--judge rtx4090] [--big] [--timeout 900]

Each row is `python -m jaxmem.memory ... --target CARD --compile --json` in a process of its own:
every phase of the run (state creation, step, evaluation, the end-of-run sample) compiled by the
card's own XLA compiler on this machine, without the card (deviceless: no autotuning, no cuDNN /
cuBLAS workspaces, no fragmentation; docs/memory.md "Plan for a GPU you do not have"). Batch 1,
remat full, per preset x method x sequence length. The methods, with their exact flags:

    full AdamW      --precision amp-bf16 --optimizer adamw          (fp32 weights and moments)
    full 8-bit      --precision bf16-sr --optimizer adamw8bit       (bf16 weights, 8-bit moments)
    LoRA r16        --precision amp-bf16 --lora-rank 16             (bf16 base, fp32 adapters)
    QLoRA r16       ... --quantize-base nf4 --double-quant          (NF4 base)

A cell is the run's largest compiled phase and whether it fits: "yes" within
jaxmem.xla.verdict.usable_bytes at XLA's default share (.75 of the card), "pre-off" only with
XLA_PYTHON_CLIENT_PREALLOCATE=false (the whole card less 0.5 GiB of CUDA context), else "no".
`--judge` cards (default: rtx4090, the 24 GB card) get a column judged on the first card's
program, not compiled again: on 2026-11-25 the 1B AdamW step compiled within 0.4% on both (21.35
vs 21.44 GiB at 32k); `--cards h100,rtx4090` compiles for each instead (twice the time). A row the
first card puts above twice a later card's size is not compiled for it; its cell says so.

`--big` adds the FSDP-QLoRA plans of llama-3.1-70b and llama-3.1-405b on 2 and 8 cards (`--mesh
fsdp=N --devices N`, batch N x 2048, the step compiled per device; with `--offload-base host`
where the base does not fit). Prints markdown tables and writes
experiments/results/what_fits_<date>.json.
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
GiB = 2**30

METHODS = {
    "full AdamW": ["--precision", "amp-bf16", "--optimizer", "adamw"],
    "full 8-bit": ["--precision", "bf16-sr", "--optimizer", "adamw8bit"],
    "LoRA r16": ["--precision", "amp-bf16", "--lora-rank", "16"],
    "QLoRA r16": ["--precision", "amp-bf16", "--lora-rank", "16", "--quantize-base", "nf4",
                  "--double-quant"],
}
QLORA = METHODS["QLoRA r16"]
# (preset, devices, offload): the FSDP-QLoRA plans of --big
BIG = [("llama-3.1-70b", 2, "none"), ("llama-3.1-70b", 8, "none"),
       ("llama-3.1-405b", 2, "host"), ("llama-3.1-405b", 8, "none")]


def run_memory(flags: list[str], timeout: float) -> dict:
    """One `python -m jaxmem.memory ... --json` in its own process: its JSON, or {"error": ...}."""
    cmd = [sys.executable, "-m", "jaxmem.memory", *flags, "--json"]
    t = time.time()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:g} s", "flags": flags}
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.splitlines() if "error" in ln.lower()] or \
            p.stderr.splitlines()[-1:]
        return {"error": (lines[-1] if lines else f"exit {p.returncode}")[:300], "flags": flags}
    out = json.loads(p.stdout)
    out["seconds"] = round(time.time() - t, 1)
    out["flags"] = flags
    return out


def predicted(r: dict) -> dict:
    """A `run_memory` answer's predicted time (jaxmem.memory.seconds, under "time") and compiled
    peak, the fields the speed tables print; None where the answer has none (an error)."""
    t = r.get("time") or {}
    return {"error": r.get("error"), "tokens_per_s": t.get("tokens_per_s"), "mfu": t.get("mfu"),
            "step_s": t.get("seconds"), "busy": t.get("busy_seconds"),
            "kernels": t.get("kernels"), "peak_bytes": (r.get("compiled") or {}).get("peak_bytes")}


def verdict(peak: int, card_gib: float) -> str:
    from jaxmem.xla.verdict import usable_bytes
    if peak <= usable_bytes(card_gib, 0.75):
        return "yes"
    return "pre-off" if peak <= usable_bytes(card_gib, 1.0) else "no"


def single(presets, methods, seqs, cards, judge, timeout, log) -> list[dict]:
    from jaxmem.target import CARDS
    rows = []
    for preset in presets:
        for method in methods:
            mflags = METHODS[method]
            for seq in seqs:
                row = {"preset": preset, "method": method, "seq_len": seq, "cards": {},
                       "judged": {}}
                for i, card in enumerate(cards):
                    first = row["cards"].get(cards[0]) if i else None
                    gib = CARDS[card].memory_gib
                    if first and "peak_bytes" in first and first["peak_bytes"] > 2 * gib * GiB:
                        row["cards"][card] = {"skipped": f"{cards[0]} peak "
                                              f"{first['peak_bytes'] / GiB:.1f} GiB > 2 x {gib:.1f}"}
                        continue
                    r = run_memory(["--preset", preset, *mflags, "--remat", "full",
                                    "--batch-size", "1", "--seq-len", str(seq),
                                    "--target", card, "--compile"], timeout)
                    if "error" in r:
                        cell = {"error": r["error"]}
                    else:
                        ph = r["phases"]
                        cell = {"peak_bytes": ph["peak_bytes"], "peak_phase": ph["peak_phase"],
                                "step_peak_bytes": r["compiled"]["peak_bytes"],
                                "phases": {p["name"]: p["compiled_bytes"] for p in ph["phases"]},
                                "compiler": r["compiler"], "seconds": r["seconds"],
                                "fits": verdict(ph["peak_bytes"], gib)}
                    row["cards"][card] = cell
                    if i == 0 and "peak_bytes" in cell:
                        row["judged"] = {j: verdict(cell["peak_bytes"], CARDS[j].memory_gib)
                                         for j in judge}
                    log(f"{preset} {method} {seq} {card}: " + (
                        f"{cell['peak_bytes'] / GiB:.2f} GiB ({cell['peak_phase']}) {cell['fits']}"
                        if "peak_bytes" in cell else cell.get("error", "")))
                rows.append(row)
    return rows


def big(timeout, log) -> list[dict]:
    from jaxmem.target import CARDS
    rows = []
    for preset, n, offload in BIG:
        flags = ["--preset", preset, *QLORA, "--remat", "full", "--batch-size", str(n),
                 "--seq-len", "2048", "--devices", str(n), "--mesh", f"fsdp={n}",
                 "--offload-base", offload, "--target", "h100"]
        r = run_memory(flags, timeout)
        row = {"preset": preset, "devices": n, "offload_base": offload}
        if "error" in r:
            row["error"] = r["error"]
        else:
            c = r["compiled"]
            row.update(peak_bytes=c["peak_bytes"], argument_bytes=c["argument_bytes"],
                       temp_bytes=c["temp_bytes"], host_bytes=c.get("host_argument_bytes", 0),
                       collectives=c["collectives"], compiler=r["compiler"],
                       seconds=r["seconds"], fits=verdict(c["peak_bytes"],
                                                          CARDS["h100"].memory_gib))
        rows.append(row)
        log(f"{preset} fsdp={n} offload {offload}: " + (
            f"{row['peak_bytes'] / GiB:.2f} GiB per device" if "peak_bytes" in row
            else row["error"]))
    return rows


def format_single(rows, cards, judge) -> str:
    from jaxmem.target import CARDS
    head = "| preset | method | tokens | " + " | ".join(
        f"{c} ({CARDS[c].memory_gib:.1f} GiB): largest phase" for c in cards) + "".join(
        f" | fits {j} ({CARDS[j].memory_gib:.1f} GiB)?" for j in judge) + " |"
    out = [head, "|" + "---|" * (3 + len(cards) + len(judge))]
    for r in rows:
        cells = []
        for c in cards:
            x = r["cards"].get(c, {})
            if "peak_bytes" in x:
                cells.append(f"{x['peak_bytes'] / GiB:.2f} ({x['peak_phase']}): **{x['fits']}**")
            else:
                cells.append(x.get("skipped") or x.get("error") or "")
        cells += [f"**{r['judged'][j]}**" if j in r["judged"] else "" for j in judge]
        out.append(f"| {r['preset']} | {r['method']} | {r['seq_len']:,} | " +
                   " | ".join(cells) + " |")
    return "\n".join(out)


def format_big(rows) -> str:
    out = ["| QLoRA r16 NF4+DQ, batch 1x2048 per device | per-device argument | temp | peak "
           "| host per device | fits an 80 GB H100 |", "|---|---|---|---|---|---|"]
    for r in rows:
        name = f"{r['preset']} fsdp={r['devices']}, offload {r['offload_base']}"
        if "error" in r:
            out.append(f"| {name} | {r['error']} | | | | |")
            continue
        out.append(f"| {name} | {r['argument_bytes'] / GiB:.2f} | {r['temp_bytes'] / GiB:.2f} | "
                   f"{r['peak_bytes'] / GiB:.2f} | {r['host_bytes'] / GiB:.2f} | {r['fits']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.tables.what_fits", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="llama-3.2-1b,llama-3.2-3b,llama-3.1-8b")
    p.add_argument("--seqs", default="2048,8192,32768")
    p.add_argument("--cards", default="h100", help="cards to compile for (the first judges "
                   "--judge)")
    p.add_argument("--judge", default="rtx4090", help="cards judged on the first card's "
                   "program ('' for none)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated subset of: " + ", ".join(METHODS))
    p.add_argument("--big", action="store_true", help="also the 70B / 405B FSDP-QLoRA plans")
    p.add_argument("--only-big", action="store_true", help="only the 70B / 405B plans")
    p.add_argument("--timeout", type=float, default=900, help="seconds per compile process")
    args = p.parse_args(argv)
    from jaxmem.target import CARDS, check_installed, TargetError
    try:
        check_installed()
    except TargetError as e:
        p.error(str(e))
    cards = args.cards.split(",")
    judge = [j for j in args.judge.split(",") if j and j not in cards]
    for c in cards + judge:
        if c not in CARDS:
            p.error(f"--cards/--judge: unknown card {c!r}; known: {', '.join(CARDS)}")
    methods = args.methods.split(",")
    for m in methods:
        if m not in METHODS:
            p.error(f"--methods: unknown method {m!r}; known: {', '.join(METHODS)}")
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    result = {"cards": cards, "judged_on_first_card": judge, "single": [], "big": []}
    if not args.only_big:
        result["single"] = single(args.presets.split(","), methods,
                                  [int(s) for s in args.seqs.split(",")], cards, judge, args.timeout, log)
        print(format_single(result["single"], cards, judge) + "\n")
    if args.big or args.only_big:
        result["big"] = big(args.timeout, log)
        print(format_big(result["big"]))
    path = new_result_file("what_fits")
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
