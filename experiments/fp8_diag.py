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
  reason, where no trace could be taken or read;
- step_ms (median), tokens_per_s, and the same step in `--baseline` precision (amp-bf16) for the
  ratio the issue measured (fp8 0.66x of amp-bf16 on an H100, 2026-11-23).

With `--json` the last line of stdout is one JSON object (experiments.gpu_check reads it). Numbers
from a CPU say nothing about GPU speed (the CPU emulates bf16 and fp8); the counts are what the
CPU can check.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

import jax

from jaxmem.config.model import PRESETS, get_preset
from jaxmem.model.fp8 import count_traced
from jaxmem.model.remat import RematError, RematPolicy
from jaxmem.train.loss import abstract_batch, synthetic_batch
from jaxmem.train.precision import PRECISIONS, get_precision
from jaxmem.train.step import StepConfig, create_train_state, jit_train_step

F8_TARGET = "__cublas$lt$matmul$f8"
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")
# Ops the rewriter lets stand between a dequantized fp8 value and its dot (MatchFp8Param).
_PASS_THROUGH = {"convert", "multiply", "broadcast", "transpose", "reshape", "bitcast", "copy",
                 "slice", "pad", "select", "dynamic-slice"}

# ------------------------------------------------------------------------------ HLO text


_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([a-z][\w\-]*)\((.*)$")


def _split_call(rest: str) -> tuple[list[str], str]:
    """'a, f32[2] %b), attrs...' -> (['a', 'b'], 'attrs...'): operand names and what follows."""
    depth, i = 1, 0
    while i < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        i += 1
    inner, attrs = rest[:i - 1], rest[i:]
    names, depth, token = [], 0, ""
    for ch in inner + ",":
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            if token.strip():
                names.append(token.strip().split()[-1].lstrip("%"))
            token = ""
        else:
            token += ch
    return names, attrs


def parse_hlo(text: str) -> dict:
    """HLO module text -> {computation: {"root": name, "instrs": {name: instr}}}, where an instr
    is a dict with type, op, operands (names) and attrs (the text after the operands)."""
    comps, current = {}, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = comps.setdefault(m.group(1), {"root": None, "instrs": {}})
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            name, type_, op, rest = m.groups()
            operands, attrs = _split_call(rest)
            current["instrs"][name] = {"type": type_, "op": op, "operands": operands,
                                       "attrs": attrs}
            if line.lstrip().startswith("ROOT"):
                current["root"] = name
    return comps


def _is_f8(type_: str) -> bool:
    return type_.startswith("f8")


def _attr(attrs: str, key: str) -> str | None:
    m = re.search(rf'{key}=("[^"]*"|\{{[^}}]*\}}|[^,\s]+)', attrs)
    return m.group(1).strip('"') if m else None


def _fp8_fed(comps, comp, name, depth=0) -> bool:
    """Is `name` a dequantized fp8 value: an f8 tensor reached through convert/multiply/layout
    ops only (into fusions through their root)?"""
    instr = comps[comp]["instrs"].get(name)
    if instr is None or depth > 12:
        return False
    if _is_f8(instr["type"]):
        return True
    if instr["op"] == "fusion":
        called = (_attr(instr["attrs"], "calls") or "").lstrip("%")
        return called in comps and _fp8_fed(comps, called, comps[called]["root"], depth + 1)
    if instr["op"] not in _PASS_THROUGH:
        return False
    # A multiply is convert(f8) * broadcast(scale): follow both sides; the rest have one input.
    operands = instr["operands"] if instr["op"] in ("multiply", "select") else instr["operands"][:1]
    return any(_fp8_fed(comps, comp, o, depth + 1) for o in operands)


def _operand_type(comps, comp, name) -> str:
    instr = comps[comp]["instrs"].get(name)
    return instr["type"] if instr else "?"


def _short(type_: str) -> str:
    """'(bf16[64,32]{1,0}, s8[1024]{0})' -> 'bf16[64,32]': no layouts, no GEMM workspace."""
    type_ = re.sub(r"\{[^}]*\}", "", type_)
    if type_.startswith("("):  # a custom call's tuple: the result, then its workspace
        type_ = type_[1:].split("]")[0] + "]"
    return type_


def _rank(type_: str) -> int:
    """'bf16[128,64]{1,0}' -> 2."""
    dims = type_.partition("[")[2].partition("]")[0]
    return len(dims.split(",")) if dims else 0


def fp8_dots(comps) -> dict:
    """Dots whose two operands are dequantized fp8, and how many of them are plain 2-D GEMMs
    with the contracting axis minor on both operands ([M, K] x [N, K])."""
    total = plain = 0
    for comp, c in comps.items():
        for instr in c["instrs"].values():
            if instr["op"] != "dot" or not all(_fp8_fed(comps, comp, o) for o in instr["operands"]):
                continue
            total += 1
            ranks = [_rank(_operand_type(comps, comp, o)) for o in instr["operands"]]
            plain += (ranks == [2, 2] and _attr(instr["attrs"], "lhs_batch_dims") is None
                      and _attr(instr["attrs"], "lhs_contracting_dims") == "{1}"
                      and _attr(instr["attrs"], "rhs_contracting_dims") == "{1}")
    return {"fp8_dots": total, "fp8_dots_2d": plain}


def gemms(comps) -> dict:
    """The optimized module's GEMMs: f8 custom calls counted, every other dot / GEMM listed."""
    f8, others = 0, {}
    for comp, c in comps.items():
        for instr in c["instrs"].values():
            target = _attr(instr["attrs"], "custom_call_target") if instr["op"] == "custom-call" \
                else None
            if target == F8_TARGET:
                f8 += 1
                continue
            if instr["op"] != "dot" and target not in GEMM_TARGETS:
                continue
            operands = instr["operands"][:2]
            where = "/".join((_attr(instr["attrs"], "op_name") or "").split("/")[-2:])
            key = (target or "dot", _short(instr["type"]),
                   tuple(_short(_operand_type(comps, comp, o)) for o in operands),
                   all(_fp8_fed(comps, comp, o) for o in operands), where)
            others[key] = others.get(key, 0) + 1
    rows = [{"op": k[0], "result": k[1], "operands": list(k[2]), "fp8_intended": k[3],
             "where": k[4], "count": n} for k, n in others.items()]
    rows.sort(key=lambda r: (not r["fp8_intended"], -r["count"]))
    return {"f8_gemm_custom_calls": f8, "non_fp8_dots": rows}


# ------------------------------------------------------------------------------ profile


def top_kernels(trace_dir: str, steps: int, top: int = 15):
    """(rows [[name, ms per step]], source) from the newest `*.trace.json.gz` under trace_dir.

    Device events (processes named '/device:...', e.g. GPU kernels) when the trace has them; on
    CPU the XLA executor threads' ops."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not paths:
        return None, f"no *.trace.json.gz under {trace_dir}"
    with gzip.open(paths[-1], "rt") as f:
        events = json.load(f).get("traceEvents", [])
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device = {p for p, n in procs.items() if n.startswith("/device:")}
    if device:
        keep, source = (lambda e: e["pid"] in device), "device kernels"
    else:
        # XLA's ops, not the runtime's own scopes ('ThunkExecutor::Execute') or Python frames.
        keep, source = (lambda e: "XLA" in threads.get((e["pid"], e.get("tid")), "")
                        and not e["name"].startswith(("$", "end: ")) and "::" not in e["name"]), \
            "host XLA threads (no device events)"
    total = {}
    for e in events:
        if e.get("ph") == "X" and keep(e):
            total[e["name"]] = total.get(e["name"], 0.0) + float(e.get("dur", 0.0))
    rows = sorted(total.items(), key=lambda kv: -kv[1])[:top]
    return [[name, round(us / 1e3 / steps, 4)] for name, us in rows], source


# ------------------------------------------------------------------------------ the step


def lower_step(preset: str, precision: str, remat: str, batch_size: int, seq_len: int):
    """(step config, jitted step, lowered step, traced fp8 einsums) without allocating anything:
    the step is lowered for the state's and the batch's shapes (`jax.eval_shape`)."""
    cfg = StepConfig(get_preset(preset), get_precision(precision), RematPolicy.parse(remat))
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
    compiled = lowered.compile()
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
    if profile_dir is not None and args.profile_steps > 0:
        try:
            with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
                for _ in range(args.profile_steps):
                    state, metrics = compiled(state, batch)
                    jax.block_until_ready(metrics)
            row["top_kernels"], row["top_kernels_source"] = top_kernels(profile_dir,
                                                                        args.profile_steps)
        except Exception as e:  # noqa: BLE001: a missing profiler plugin must not lose the row
            row["top_kernels_source"] = f"profile failed ({type(e).__name__}: {e}); see step_ms"
    del state
    return row


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
            print(f"  top kernels, {label} ({row['top_kernels_source']}), ms per step:")
            for name, ms in row["top_kernels"][:10]:
                print(f"    {ms:9.3f}  {name[:100]}")
        elif row:
            print(f"  top kernels, {label}: none ({row['top_kernels_source']})")


if __name__ == "__main__":
    sys.exit(main())
