"""Memory of fine-tuning: full vs LoRA vs QLoRA int8 vs QLoRA NF4, analytic and compiled.

    python -m experiments.tables.finetune_memory                      # analytic, all models
    python -m experiments.tables.finetune_memory --compile llama-3.2-1b llama-3-8b   # + XLA's numbers

Prints a markdown table (docs/finetune.md) for llama-3.2-1b, llama-3-8b and a Llama-3-70B shape
at batch 1 x seq 2048, amp-bf16 (fp32 master weights / adapters, bf16 compute), remat full,
LoRA r=16 on all seven projections. The analytic numbers (with XLA's attention, which the CPU
compile takes, and with cuDNN flash attention, which a GPU takes for bf16) are jaxmem.memory.analytic; the
compiled ones XLA's memory_analysis() of the real train step compiled ahead of time from
abstract shapes (nothing allocated; peak = temp + arguments + outputs - aliased). On the CPU
backend bf16 matmuls run on fp32 copies of their operands and fusions differ, so CPU-compiled
bytes are not a GPU's, nor a bound on them (docs/memory.md: the calibration).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from jaxmem.config.run import RunConfig
from jaxmem.memory.analytic import analytic_breakdown
from jaxmem.memory.spec import StepSpec

MODELS = {
    "llama-3.2-1b": {"model.preset": "llama-3.2-1b"},
    "llama-3-8b": {"model.preset": "llama-3-8b"},
    "llama-3-70b": {"model.preset": "llama-3-8b", "model.hidden_size": 8192,
                    "model.intermediate_size": 28672, "model.num_layers": 80,
                    "model.num_heads": 64},
}
LORA = {"peft.lora_rank": 16, "peft.lora_alpha": 32.0}
MODES = {
    "full fine-tune": {},
    "LoRA (bf16 base)": LORA,
    "QLoRA int8": {**LORA, "peft.quantize_base": "int8"},
    "QLoRA NF4 (double quant)": {**LORA, "peft.quantize_base": "nf4", "peft.double_quant": True},
}
COMMON = {"precision.mode": "amp-bf16", "remat.policy": "full", "data.batch_size": 1,
          "data.seq_len": 2048}


def spec_of(model: str, mode: str) -> StepSpec:
    return StepSpec.from_run_config(RunConfig().replace({**COMMON, **MODELS[model], **MODES[mode]}))


def row(model: str, mode: str, compile_it: bool) -> dict:
    spec = spec_of(model, mode)
    a = analytic_breakdown(spec)
    comps = {c["name"]: c["bytes"] for c in a["components"]}
    state = sum(b for n, b in comps.items() if n.startswith(("params (master)", "LoRA adapters",
                                                             "adam", "frozen base")))
    out = {"model": model, "mode": mode, "params": a["params"],
           "trainable": comps.get("LoRA adapters (master)", comps.get("params (master)", 0)) // 4,
           "state": state, "analytic": a["total_bytes"], "phase": a["peak_phase"],
           "analytic_gpu": analytic_breakdown(spec.replace(attention="cudnn"))[
               "total_bytes"]}
    if compile_it:
        from jaxmem.memory.compiled import compile_step
        t = time.time()
        c = compile_step(spec)
        out.update(compiled=c["peak_bytes"], arguments=c["argument_bytes"], temp=c["temp_bytes"],
                   compile_s=time.time() - t)
    return out


def gib(n) -> str:
    return "" if n is None else f"{n / 2**30:.2f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.tables.finetune_memory",
                                description=__doc__.splitlines()[0])
    p.add_argument("--compile", nargs="*", default=[], metavar="MODEL",
                   help="also compile these models' steps ahead of time (CPU: a minute or more each)")
    p.add_argument("--models", nargs="*", default=list(MODELS))
    args = p.parse_args(argv)
    print("| model | mode | trainable params | weights + optimizer state GiB | analytic peak GiB "
          "(XLA attention) | compiled peak GiB (CPU) | compiled arguments GiB | analytic peak GiB "
          "(cuDNN attention) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for model in args.models:
        for mode in MODES:
            r = row(model, mode, model in args.compile)
            print(f"| {model} | {mode} | {r['trainable']:,} | {gib(r['state'])} | "
                  f"{gib(r['analytic'])} | {gib(r.get('compiled'))} | {gib(r.get('arguments'))} | "
                  f"{gib(r['analytic_gpu'])} |",
                  flush=True)


if __name__ == "__main__":
    main()
