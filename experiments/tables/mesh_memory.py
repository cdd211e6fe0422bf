"""The per-device memory table and collective counts of docs/distributed.md.

    python -m experiments.tables.mesh_memory [--preset tiny] [--batch-size 16] [--seq-len 128]

For 1, 2, 4 and 8 simulated CPU devices (one subprocess per device count: the count must be set
before JAX starts) and the meshes fsdp=N, data=N, tensor=2 x fsdp=N/2 and data=2 x fsdp=N/2, the
full train step (fp32, AdamW, state donated) is compiled ahead of time for the mesh and its
per-device `memory_analysis()` is printed next to the planner's analytic per-device peak
(jaxmem.memory.mesh) and the count of all-gather / reduce-scatter / all-reduce ops in the
optimized HLO (a static count: ops inside the layer scan run once per layer). Prints a markdown
table and writes experiments/results/mesh_memory_<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 2**20


def meshes(n: int) -> list[str]:
    if n == 1:
        return ["(none)"]
    out = [f"fsdp={n}", f"data={n}"]
    if n >= 4:
        out += [f"tensor=2,fsdp={n // 2}", f"data=2,fsdp={n // 2}"]
    else:
        out += ["tensor=2"]
    return out


def worker(n: int, preset: str, batch: int, seq: int) -> list[dict]:
    import jax  # noqa: F401  (JAX_NUM_CPU_DEVICES is set by the parent)

    from jaxmem.config.run import RunConfig
    from jaxmem.memory.spec import StepSpec
    from jaxmem.memory.analytic import analytic_breakdown
    from jaxmem.memory.compiled import compile_step
    from jaxmem.memory.mesh import resolve

    spec = StepSpec.from_run_config(RunConfig().replace(
        {"model.preset": preset, "data.batch_size": batch, "data.seq_len": seq}))
    rows = []
    for m in meshes(n):
        text = None if m == "(none)" else m
        c = compile_step(spec, text)
        a = analytic_breakdown(spec, resolve(spec, text, n) if text else None)
        rows.append({"devices": n, "mesh": m, **{k: c[k] for k in (
            "argument_bytes", "temp_bytes", "output_bytes", "alias_bytes", "peak_bytes")},
            "analytic_bytes": a["total_bytes"], "collectives": c["collectives"]})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.tables.mesh_memory")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.preset, args.batch_size, args.seq_len)))
        return 0
    rows = []
    for n in (1, 2, 4, 8):
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(n))
        proc = subprocess.run([sys.executable, "-m", "experiments.tables.mesh_memory", "--worker", str(n),
                               "--preset", args.preset, "--batch-size", str(args.batch_size),
                               "--seq-len", str(args.seq_len)], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr[-2000:], file=sys.stderr)
            return 1
        rows += json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{args.preset}, fp32, batch {args.batch_size} x {args.seq_len}, per device (MiB)\n")
    print("| devices | mesh | argument | temp | peak | analytic | analytic/peak | all-gather | "
          "reduce-scatter | all-reduce |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = r["collectives"]
        print(f"| {r['devices']} | {r['mesh']} | {r['argument_bytes'] / MIB:.2f} | "
              f"{r['temp_bytes'] / MIB:.2f} | {r['peak_bytes'] / MIB:.2f} | "
              f"{r['analytic_bytes'] / MIB:.2f} | {r['analytic_bytes'] / r['peak_bytes']:.3f} | "
              f"{c['all-gather']} | {c['reduce-scatter']} | {c['all-reduce']} |")
    os.makedirs(os.path.join(ROOT, "experiments", "results"), exist_ok=True)
    path = os.path.join(ROOT, "experiments", "results",
                        f"mesh_memory_{datetime.date.today().isoformat()}.json")
    with open(path, "w") as f:
        json.dump({"preset": args.preset, "batch_size": args.batch_size, "seq_len": args.seq_len,
                   "rows": rows}, f, indent=1)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
