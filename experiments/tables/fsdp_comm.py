"""What an FSDP train step sends between devices, per device per step, against FSDP's theory.

    python -m experiments.tables.fsdp_comm --preset llama-3-8b --precision bf16-sr --optimizer adamw8bit \
        --remat full --batch-size 8 --seq-len 2048 --mesh fsdp=8 [--target h100] [--devices 8]
    python -m experiments.tables.fsdp_comm --hlo DUMP_after_optimizations.txt --preset llama-3-8b \
        --num-layers 8 --precision bf16-sr --mesh fsdp=8        (a saved module; no compile)

The step is compiled as `python -m jaxmem.memory ... --mesh M --target CARD --devices N` compiles
it (jaxmem.memory.compiled.compile_step inside jaxmem.target.compiling_for: the card's own XLA
compiler, deviceless), or read from an optimized HLO text (`XLA_FLAGS=--xla_dump_to=DIR`,
`*jit_train_step*after_optimizations.txt`). jaxmem.xla.collectives reads its collectives:
bytes each device sends and receives per kind by the ring model, multiplied by the trip counts
of the loops they sit in, and the async pairs. The theory is FSDP's 3 x the parameter bytes in
the compute dtype (gathered for the forward, again for the backward, gradients scattered) x
(n-1)/n, n the fsdp axis (`--param-bytes` overrides the bytes).

Prints the markdown tables (per kind, then every collective by bytes per step) and writes the
JSON (the report with every op) to experiments/results/fsdp_comm_<date>.json or `--out`;
`--json` prints the JSON instead.
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxmem import target
from jaxmem.config.flags import add_run_flags, given_overrides, positive_int
from jaxmem.config.run import RunConfig
from jaxmem.xla.collectives import comm_report, format_comm_table, fsdp_volume
from jaxmem.memory.spec import StepSpec
from jaxmem.parallel.mesh import MeshSpec
from jaxmem.families.params import num_params

FLAGS = {"precision": ("mode",), "data": ("batch_size", "seq_len", "grad_accum"),
         "optim": ("mu_dtype", "optimizer"), "parallel": ("mesh",)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m experiments.tables.fsdp_comm",
                                description=__doc__.split("\n\n")[0])
    add_run_flags(p, ["model", "precision", "remat", "optim", "data", "parallel"], only=FLAGS)
    p.add_argument("--target", default="h100", choices=sorted(target.CARDS), metavar="GPU")
    p.add_argument("--devices", type=positive_int, default=8)
    p.add_argument("--hlo", default=None, metavar="FILE",
                   help="read this optimized HLO text instead of compiling")
    p.add_argument("--param-bytes", type=positive_int, default=None,
                   help="the parameter bytes of the theory (default: params x compute dtype)")
    p.add_argument("--save-hlo", default=None, metavar="FILE",
                   help="also write the compiled step's optimized HLO text here")
    p.add_argument("--out", default=None, help="JSON path (default: experiments/results/)")
    p.add_argument("--json", action="store_true", help="print the JSON instead of tables")
    return p


def param_bytes(spec: StepSpec) -> int:
    """The model's parameters in the compute dtype: what FSDP all-gathers each pass."""
    import jax.numpy as jnp
    return num_params(spec.model) * jnp.dtype(spec.precision.compute_dtype).itemsize


def compiled_hlo(spec: StepSpec, mesh: str, card: str, devices: int) -> str:
    """The optimized HLO of the step compiled for `devices` deviceless `card` GPUs on `mesh`,
    by the planner's own path."""
    from jaxmem.memory.compiled import compile_step
    target.prepare()
    with target.compiling_for(card, devices=devices):
        return compile_step(spec, mesh, keep_hlo=True)["hlo"]


def ops_table(report: dict, limit: int = 40) -> str:
    """Markdown: the collectives by bytes per step, largest first, with where they come from."""
    gib, mib = 2**30, 2**20
    rows = ["| op | kind | n | MiB per run | runs | GiB per step | compute between | from |",
            "|---|---|---|---|---|---|---|---|"]
    for c in sorted(report["ops"], key=lambda c: -c["bytes_per_step"])[:limit]:
        where = c["op_name"].replace("jit(train_step)/", "")[-70:]
        between = "sync" if not c["asynchronous"] else (
            "elsewhere" if c["compute_between"] is None else str(c["compute_between"]))
        between += " (is_sync)" if c["forced_sync"] else ""
        rows.append(f"| {c['name']} | {c['kind']} | {c['group_size']} | "
                    f"{c['bytes_per_run'] / mib:.1f} | {c['runs']} | "
                    f"{c['bytes_per_step'] / gib:.2f} | {between} | `{where}` |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = RunConfig().replace(given_overrides(args))
    spec = StepSpec.from_run_config(cfg)
    mesh = cfg.parallel.mesh or f"fsdp={args.devices}"
    n = MeshSpec.parse(mesh).resolve(args.devices).fsdp
    if args.hlo:
        with open(args.hlo) as f:
            text = f.read()
        source = args.hlo
    else:
        try:
            text = compiled_hlo(spec, mesh, args.target, args.devices)
        except target.TargetError as e:
            parser.error(str(e))
        source = f"compiled for {args.devices} x {args.target} (deviceless), mesh {mesh}"
        if args.save_hlo:
            with open(args.save_hlo, "w") as f:
                f.write(text)
    report = comm_report(text, ops=True)
    pbytes = args.param_bytes or param_bytes(spec)
    out = {"source": source, "preset": cfg.model.preset, "mesh": mesh, "fsdp": n,
           "param_bytes": pbytes, "fsdp_theory_bytes": fsdp_volume(pbytes, n),
           "ratio_to_theory": report["send_bytes"] / fsdp_volume(pbytes, n), **report}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{source}\n\n{format_comm_table(report, pbytes, n)}\n\n{ops_table(report)}")
    path = args.out
    if path is None:
        from experiments.common.resultfiles import new_result_file
        path = new_result_file("fsdp_comm")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
