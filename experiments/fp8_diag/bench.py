"""fp8 vs bf16 projection matmuls: does XLA lower them to fp8 cuBLASLt GEMMs, and how fast?

    python -m experiments.fp8_diag.bench                    # GPU: hidden 2048, 4096, 8192
    python -m experiments.fp8_diag.bench --quick            # CPU smoke run: small sizes, few reps

For each hidden size D it times forward + backward of an MLP-shaped projection
x[B*T, D] @ w[D, 4D] through `jaxmem.model.fp8.fp8_einsum` and through a plain bf16 einsum (median of
`--reps` runs after warmup, `block_until_ready`), and reads the compiled HLO: an fp8 GEMM on
Hopper appears as a cuBLASLt custom call whose operands are f8e4m3fn / f8e5m2
(`__cublas$lt$matmul$f8`). Prints a table; writes experiments/results/fp8_bench_<date>.json with
date, device and versions. On CPU the fp8 path is emulated (converted to fp32), so its timing
says nothing about GPUs; the script reports what it found either way.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from experiments.common.resultfiles import new_result_file
from jaxmem.model.fp8 import fp8_einsum


def _time(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench(d: int, tokens: int, reps: int) -> dict:
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (tokens, d), jnp.bfloat16)
    w = (jax.random.normal(kw, (d, 4 * d), jnp.float32) * d ** -0.5).astype(jnp.bfloat16)

    def loss_fp8(x, w):
        return jnp.sum(fp8_einsum("TD,DF->TF", x, w).astype(jnp.float32) ** 2)

    def loss_bf16(x, w):
        return jnp.sum(jnp.einsum("TD,DF->TF", x, w).astype(jnp.float32) ** 2)

    row = {"hidden": d, "tokens": tokens, "flops_fwd_bwd": 3 * 2 * tokens * d * 4 * d}
    for name, f in (("fp8", loss_fp8), ("bf16", loss_bf16)):
        step = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
        hlo = step.lower(x, w).compile().as_text()
        row[f"{name}_seconds"] = _time(step, x, w, reps=reps)
        row[f"{name}_tflops"] = row["flops_fwd_bwd"] / row[f"{name}_seconds"] / 1e12
        row[f"{name}_fp8_gemms"] = len(re.findall(r"custom_call_target=\"__cublas\$lt\$matmul\$f8\"", hlo))
        row[f"{name}_f8_operand_dots"] = len(re.findall(r"dot\([^)]*f8e[45]m[23]", hlo))
    row["speedup_fp8_vs_bf16"] = row["bf16_seconds"] / row["fp8_seconds"]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.fp8_diag.bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", default="2048,4096,8192", help="comma-separated hidden sizes")
    p.add_argument("--tokens", type=int, default=8192, help="B*T rows of x")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="CPU smoke run: hidden 128,256, 256 tokens")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.tokens, args.reps = "128,256", 256, 3
    rows = [bench(int(d), args.tokens, args.reps) for d in args.hidden.split(",")]
    dev = jax.devices()[0]
    report = {"date": datetime.date.today().isoformat(), "device": dev.device_kind,
              "backend": jax.default_backend(), "jax": jax.__version__, "rows": rows}
    out = new_result_file(f"fp8_bench_{jax.default_backend()}")  # never overwrites a tracked file
    out.write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['device']} ({report['backend']}, jax {report['jax']})")
    print("| hidden | fp8 ms | bf16 ms | fp8/bf16 speedup | fp8 TFLOP/s | bf16 TFLOP/s | cuBLASLt fp8 GEMMs |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['hidden']} | {1e3 * r['fp8_seconds']:.3f} | {1e3 * r['bf16_seconds']:.3f} | "
              f"{r['speedup_fp8_vs_bf16']:.2f}x | {r['fp8_tflops']:.1f} | {r['bf16_tflops']:.1f} | "
              f"{r['fp8_fp8_gemms']} |")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
