"""Why is fp8 not faster? One call that shows where an fp8 train step's time and GEMMs go.

    python -m experiments.fp8_diag --preset llama-3.2-1b --batch-size 8 --seq-len 2048 --json
    python -m experiments.fp8_diag            # CPU smoke run: tiny preset, 2 x 64, a few seconds

It builds jaxmem's train step with `--precision fp8` (remat `full` by default) and reports:

- fp8_einsums_traced: `fp8_einsum` calls traced (jaxmem.model.fp8.count_traced; a scanned
  block's body is traced a few times whatever the layer count);
- fp8_dots_lowered: dots in the lowered (pre-optimization) HLO whose two operands are
  dequantized fp8 (convert(f8) * broadcast(scale), through transposes/reshapes): the GEMMs XLA is
  asked to make fp8, counted in the program text (a loop body once). fp8_dots_lowered_2d: those
  with no batch axis and the contracting axis minor on both operands, the form cuBLASLt's fp8
  GEMM takes;
- f8_gemm_custom_calls: `__cublas$lt$matmul$f8` calls in the optimized HLO (GPU only; null on
  another backend, with the reason), to hold against fp8_dots_lowered: fewer means XLA's gemm
  rewriter left some fp8 dots as wider GEMMs;
- non_fp8_dots: every other dot / GEMM of the optimized HLO with its types, `fp8_intended` when
  its operands are still dequantized fp8 (a dot the rewriter did not take);
- top_kernels: the kernels (GPU) or XLA ops (CPU) that took the most time in a `jax.profiler`
  trace of a few steps, ms per step, parsed from the trace's `*.trace.json.gz`; null, with the
  reason, where no trace could be taken or read; kernel_ms_by_kind: the same time summed by a
  kind guessed from the names (fp8 gemm, gemm, attention, other);
- step_ms (median), tokens_per_s, and the same step in `--baseline` precision (amp-bf16) for the
  ratio the issue measured (fp8 0.66x of amp-bf16 on an H100, 2026-11-23).

With `--target h100` nothing runs: the steps are compiled by XLA's GPU compiler for that card
(jaxmem.target, no GPU needed) and the report is a table read from their optimized HLO
(experiments.fp8_diag.table.step_table): for amp-bf16 and fp8, each in the forms that matter (XLA's
default, Triton GEMMs, and `--xla_gpu_enable_triton_gemm=false`; fp8 also with jaxmem's flags,
jaxmem.model.fp8_compile.COMPILER_OPTIONS_FP8), GEMMs per step by backend and dtype (cublasLt f8,
cublasLt bf16, Triton), non-GEMM fusions and the bytes they move (operands read plus results
written, from the HLO text: a deviceless compile has no cost_analysis), the passes fp8 scaling
adds (amax reductions, quantize converts), and a roofline estimate (every GEMM at the card's
published peak for its dtype, every non-GEMM byte at its bandwidth, no overlap). The step is
compiled with `--layers` and `--layers` + 1 layers; the difference is one layer, and the table
is scaled to the preset's layer count.

With `--json` the last line of stdout is one JSON object (experiments.gpu_check reads it). Numbers
from a CPU say nothing about GPU speed (the CPU emulates bf16 and fp8); the counts are what the
CPU can check.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
import time

import jax

from experiments.fp8_diag.hlo import F8_TARGET, fp8_dots, gemms, parse_hlo, top_kernels
from experiments.fp8_diag.table import roofline_ms, step_table
from jaxmem import target
from jaxmem.model.fp8_compile import COMPILER_OPTIONS_FP8
from jaxmem.families import PRESETS, get_preset
from jaxmem.model.fp8 import count_traced
from jaxmem.model.remat import RematPolicy
from jaxmem.remat import RematError
from jaxmem.train.loss import abstract_batch, synthetic_batch
from jaxmem.model.precision import PRECISIONS, get_precision
from jaxmem.train.step import StepConfig, create_train_state, jit_train_step

# ------------------------------------------------------------------------------ the step


def lower_step(preset: str, precision: str, remat: str, batch_size: int, seq_len: int,
               num_layers: int | None = None):
    """(step config, jitted step, lowered step, traced fp8 einsums) without allocating anything:
    the step is lowered for the state's and the batch's shapes (`jax.eval_shape`)."""
    model = get_preset(preset)
    if num_layers is not None:
        model = dataclasses.replace(model, num_layers=num_layers)
    cfg = StepConfig(model, get_precision(precision), RematPolicy.parse(remat))
    state = jax.eval_shape(lambda: create_train_state(cfg))
    batch = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct((1, *s.shape), s.dtype),
                                   abstract_batch(batch_size, seq_len))  # [K=1, B, T]
    step = jit_train_step(cfg)
    with count_traced() as traced:
        lowered = step.lower(state, batch)
    return cfg, step, lowered, traced


def inspect_lowered(lowered, traced) -> dict:
    """The counts the CPU can check: traced fp8 einsums and fp8 dots of the lowered HLO."""
    pre = fp8_dots(parse_hlo(lowered.as_text(dialect="hlo")))
    return {"fp8_einsums_traced": sum(traced.values()), "fp8_einsums_by_subscripts": dict(traced),
            "fp8_dots_lowered": pre["fp8_dots"], "fp8_dots_lowered_2d": pre["fp8_dots_2d"]}


def _measure(args, precision: str, profile_dir: str | None, inspect: bool) -> dict:
    cfg, _, lowered, traced = lower_step(args.preset, precision, args.remat, args.batch_size,
                                            args.seq_len)
    # on a GPU, fp8 is compiled as jaxmem.train's CLI compiles it (jaxmem.model.fp8's flags)
    gpu_fp8 = precision == "fp8" and jax.default_backend() == "gpu"
    compiled = lowered.compile(compiler_options=dict(COMPILER_OPTIONS_FP8) if gpu_fp8 else None)
    row = {"precision": precision}
    if inspect:
        row.update(inspect_lowered(lowered, traced))
        optimized = compiled.as_text()
        if args.dump:
            with open(os.path.join(args.dump, f"{precision}.optimized.hlo.txt"), "w") as f:
                f.write(optimized)
        found = gemms(parse_hlo(optimized))
        row["non_fp8_dots"] = found["non_fp8_dots"]
        row["non_fp8_dots_fp8_intended"] = sum(r["count"] for r in found["non_fp8_dots"]
                                               if r["fp8_intended"])
        row["f8_converts_optimized"] = len(re.findall(r"= f8e[45]m[23]\w*\[[^\]]*\]\S* convert\(",
                                                      optimized))
        if jax.default_backend() == "gpu":
            row["f8_gemm_custom_calls"], row["f8_gemm_custom_calls_reason"] = \
                found["f8_gemm_custom_calls"], None
        else:
            row["f8_gemm_custom_calls"] = None
            row["f8_gemm_custom_calls_reason"] = (
                f"backend {jax.default_backend()!r}: XLA makes cuBLASLt fp8 GEMMs on CUDA GPUs "
                f"(compute capability >= 8.9) only")
    memory = compiled.memory_analysis()
    row["temp_bytes"] = int(memory.temp_size_in_bytes) if memory is not None else None

    # Made under jit, as XLA plans it (op by op, an 8B state fragments the GPU's allocator).
    state = jax.jit(lambda: create_train_state(cfg))()
    batch = synthetic_batch(jax.random.PRNGKey(1), args.batch_size, args.seq_len,
                            cfg.model.vocab_size)
    batch = jax.tree_util.tree_map(lambda x: x[None], batch)  # [K=1, B, T]
    state, metrics = compiled(state, batch)  # warm up (the step donates its state)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
    row["step_ms"] = round(1e3 * statistics.median(times), 3)
    row["tokens_per_s"] = round(args.batch_size * args.seq_len / statistics.median(times), 1)
    row["loss"] = float(metrics["loss"])
    row["top_kernels"], row["top_kernels_source"] = None, "not profiled (--profile-steps 0)"
    row["kernel_ms_by_kind"] = None
    if profile_dir is not None and args.profile_steps > 0:
        try:
            with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
                for _ in range(args.profile_steps):
                    state, metrics = compiled(state, batch)
                    jax.block_until_ready(metrics)
            row["top_kernels"], row["top_kernels_source"], row["kernel_ms_by_kind"] = \
                top_kernels(profile_dir, args.profile_steps)
        except Exception as e:  # noqa: BLE001: a missing profiler plugin must not lose the row
            row["top_kernels_source"] = f"profile failed ({type(e).__name__}: {e}); see step_ms"
    del state
    return row


# ------------------------------------------------------------------------------ --target

# (precision, form, compiler options): the programs the --target table compares.
TARGET_FORMS = (
    ("amp-bf16", "default (Triton GEMMs)", {}),
    ("amp-bf16", "triton_gemm=false", {"xla_gpu_enable_triton_gemm": False}),
    ("fp8", "default (Triton GEMMs)", {}),
    ("fp8", "triton_gemm=false", {"xla_gpu_enable_triton_gemm": False}),
    ("fp8", "jaxmem (COMPILER_OPTIONS_FP8)", COMPILER_OPTIONS_FP8),
)


def _combine(a, b, f):
    """f(a, b) on every number of two step tables (keys of either; a missing one is 0)."""
    if isinstance(a, dict) or isinstance(b, dict):
        a, b = a or {}, b or {}
        return {k: _combine(a.get(k), b.get(k), f) for k in {**a, **b}}
    if isinstance(a, list) or isinstance(b, list):
        return (a or []) + (b or [])
    return f(a or 0, b or 0)


def _round(t):
    return _combine(t, None, lambda x, _: round(x, 3) if isinstance(x, float) else x)


def target_table(args, card) -> list[dict]:
    """One row per TARGET_FORMS entry: per-layer, outside-the-layers and whole-step tables
    (scaled to the preset's layers) and the roofline estimate of the whole step."""
    n = args.layers
    layers = get_preset(args.preset).num_layers
    tflops = {"bf16": card.peak_tflops[0], "f16": card.peak_tflops[0],
              "f32": card.peak_tflops[0] / 2, "f8": card.peak_tflops[1]}
    rows = []
    for precision, form, options in TARGET_FORMS:
        tables = []
        for count in (n, n + 1):
            _, _, lowered, _ = lower_step(args.preset, precision, args.remat, args.batch_size,
                                          args.seq_len, num_layers=count)
            text = lowered.compile(compiler_options=dict(options)).as_text()
            if args.dump:
                name = f"{precision}.{form.split()[0]}.{count}layers.optimized.hlo.txt"
                with open(os.path.join(args.dump, name), "w") as f:
                    f.write(text)
            tables.append(step_table(text))
        layer = _combine(tables[1], tables[0], lambda b, a: b - a)
        outside = _combine(tables[0], layer, lambda t, l: t - n * l)
        step = _combine(outside, layer, lambda o, l: o + layers * l)
        rows.append({"precision": precision, "form": form, "compiler_options": dict(options),
                     "per_layer": _round(layer), "outside_layers": _round(outside),
                     "step": _round(step), "estimate_ms": roofline_ms(step, tflops,
                                                                      card.bandwidth)})
        print(f"  compiled {precision}, {form}", file=sys.stderr, flush=True)
    return rows


def _gemm_counts(t: dict) -> dict:
    g = t["gemms"]
    pick = lambda pred: round(sum(r["count"] for k, r in g.items() if pred(k)), 1)  # noqa: E731
    return {"cublasLt f8": pick(lambda k: k == "cublasLt f8"),
            "cublas(Lt) wider": pick(lambda k: k.startswith("cublas") and k != "cublasLt f8"),
            "triton f8": pick(lambda k: k == "triton f8"),
            "triton wider": pick(lambda k: k.startswith("triton") and k != "triton f8")}


def _print_target(r: dict) -> None:
    print(f"fp8 on {r['device']}: {r['compiler']}; {r['preset']} ({r['num_layers']} layers, "
          f"compiled with {r['layers_compiled']} and {r['layers_compiled'] + 1}: one layer is the "
          f"difference) {r['batch_size']}x{r['seq_len']} remat {r['remat']}")
    print("  per step (whole model); GEMMs per layer in brackets; bytes: non-GEMM fusions' "
          "operands + results from the optimized HLO")
    print(f"  {'precision / form':44s} {'Lt f8':>9s} {'Lt wider':>9s} {'tri f8':>7s} "
          f"{'tri wider':>9s} {'fusions':>8s} {'GB':>7s} {'scaling passes (GB)':>34s} "
          f"{'estimate ms':>11s}")
    for row in r["rows"]:
        step, layer = _gemm_counts(row["step"]), _gemm_counts(row["per_layer"])
        scaling = ", ".join(f"{k} {v['count']:.0f} ({v['bytes'] / 1e9:.2f})"
                            for k, v in row["step"]["scaling"].items()) or "-"
        cells = " ".join(f"{f'{step[k]:.0f} [{layer[k]:.0f}]':>9s}" for k in step)
        print(f"  {row['precision'] + ' / ' + row['form']:44s} {cells} "
              f"{row['step']['fusions']['count']:8.0f} "
              f"{row['step']['fusions']['bytes'] / 1e9:7.2f} {scaling:>34s} "
              f"{row['estimate_ms']['total_ms']:11.2f}")
    print("  estimate: a roofline, not a measurement: GEMM FLOPs at the published peak of their "
          "dtype + cuDNN attention at the bf16 peak + non-GEMM bytes at the memory bandwidth, no "
          "overlap, no launch cost")
    for row in r["rows"]:
        e = row["estimate_ms"]
        print(f"    {row['precision'] + ' / ' + row['form']:44s} GEMM {e['gemm_ms']:.2f} + "
              f"attention {e['attention_ms']:.2f} + non-GEMM {e['non_gemm_ms']:.2f} = "
              f"{e['total_ms']:.2f} ms")


def target_main(args, p) -> int:
    target.prepare()
    try:
        with target.compiling_for(args.target) as t:
            print(f"compiling for {t.describe()}", file=sys.stderr, flush=True)
            rows = target_table(args, t.card)
            report = {"target": args.target, "device": t.card.device_name,
                      "compiler": t.describe(), "preset": args.preset,
                      "num_layers": get_preset(args.preset).num_layers,
                      "layers_compiled": args.layers, "batch_size": args.batch_size,
                      "seq_len": args.seq_len, "remat": args.remat, "rows": rows}
    except target.TargetError as e:
        p.error(str(e).splitlines()[0])
    _print_target(report)
    if args.json:
        print(json.dumps(report))
    return 0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _steps(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fp8_diag", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", choices=list(PRESETS))
    p.add_argument("--batch-size", type=_positive, default=2)
    p.add_argument("--seq-len", type=_positive, default=64)
    p.add_argument("--steps", type=_positive, default=3, help="timed steps (median)")
    p.add_argument("--profile-steps", type=_steps, default=2, help="steps in the profile (0: none)")
    p.add_argument("--remat", default="full", help="remat policy (as jaxmem.train's --remat)")
    p.add_argument("--baseline", default="amp-bf16",
                   help="precision to time beside fp8, or 'none'")
    p.add_argument("--dump", default=None, help="directory to write the optimized HLO texts into")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.add_argument("--target", default=None, choices=sorted(target.CARDS), metavar="GPU",
                   help="compile for this GPU with XLA's GPU compiler (no GPU needed, nothing "
                        "runs) and report the step's GEMMs, fusions and bytes: "
                        + ", ".join(sorted(target.CARDS)))
    p.add_argument("--layers", type=_positive, default=2,
                   help="with --target: compile with this many layers and one more (default 2)")
    args = p.parse_args(argv)
    if args.baseline != "none" and args.baseline not in PRECISIONS:
        p.error(f"--baseline: unknown precision {args.baseline!r}; choose one of: "
                f"{', '.join(PRECISIONS)}, none")
    try:
        RematPolicy.parse(args.remat)
    except RematError as e:
        p.error(f"--remat: {e}")
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    if args.target is not None:
        return target_main(args, p)

    with tempfile.TemporaryDirectory() as tmp:
        report = _measure(args, "fp8", os.path.join(tmp, "fp8"), inspect=True)
        if args.baseline != "none":
            base = _measure(args, args.baseline, os.path.join(tmp, "base"), inspect=False)
            report["baseline"] = base
            report["speedup_vs_baseline"] = round(base["step_ms"] / report["step_ms"], 4)
    report.update(backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                  jax=jax.__version__, preset=args.preset, batch_size=args.batch_size,
                  seq_len=args.seq_len, remat=args.remat)
    _print(report)
    if args.json:
        print(json.dumps(report))
    return 0


def _print(r: dict) -> None:
    print(f"fp8 diagnosis: {r['preset']} {r['batch_size']}x{r['seq_len']} remat {r['remat']} on "
          f"{r['device']} ({r['backend']}, jax {r['jax']})")
    print(f"  fp8 einsums traced {r['fp8_einsums_traced']}; fp8 dots in the lowered HLO "
          f"{r['fp8_dots_lowered']} ({r['fp8_dots_lowered_2d']} plain 2-D [M,K]x[N,K])")
    calls = r["f8_gemm_custom_calls"]
    print(f"  {F8_TARGET} custom calls: "
          f"{calls if calls is not None else 'n/a: ' + r['f8_gemm_custom_calls_reason']}")
    print(f"  other dots/GEMMs: {sum(d['count'] for d in r['non_fp8_dots'])}, of which still on "
          f"dequantized fp8 operands: {r['non_fp8_dots_fp8_intended']}")
    for d in r["non_fp8_dots"][:12]:
        print(f"    {d['count']:3d} x {d['op']} {d['result']} <- {', '.join(d['operands'])}"
              f"{'  [fp8 intended]' if d['fp8_intended'] else ''}  {d['where']}")
    line = f"  step {r['step_ms']:.1f} ms, {r['tokens_per_s']:.0f} tok/s"
    if "baseline" in r:
        b = r["baseline"]
        line += (f"; {b['precision']} {b['step_ms']:.1f} ms: fp8 is {r['speedup_vs_baseline']:.2f}x"
                 f" of {b['precision']}")
    print(line)
    for label, row in (("fp8", r), ("baseline", r.get("baseline"))):
        if row and row["top_kernels"]:
            print(f"  top kernels, {label} ({row['top_kernels_source']}), ms per step; by kind "
                  f"(from the names): {row['kernel_ms_by_kind']}")
            for name, ms in row["top_kernels"][:10]:
                print(f"    {ms:9.3f}  {name[:100]}")
        elif row:
            print(f"  top kernels, {label}: none ({row['top_kernels_source']})")
