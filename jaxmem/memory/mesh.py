"""Per-device memory of a train step on a mesh (`python -m jaxmem.memory --mesh`): the analytic
breakdown on one device of it and XLA's own numbers (memory_analysis() is per device)."""

from __future__ import annotations

from jaxmem import target
from jaxmem.memory.analytic import analytic_breakdown
from jaxmem.xla.collectives import comm_line
from jaxmem.memory.compiled import compile_step
from jaxmem.memory.spec import StepSpec
from jaxmem.parallel.mesh import MeshSpec


def resolve(spec: StepSpec, mesh_text: str | None, devices: int | None = None) -> MeshSpec:
    """The mesh spec for `devices` (default: this host's device count), checked for `spec`."""
    n = devices if devices is not None else target.device_count()
    mesh = MeshSpec.parse(mesh_text).resolve(n, mesh_text)
    mesh.check(spec.model, spec.rows, mesh_text, spec.seq_len)
    return mesh


def mesh_report(spec: StepSpec, mesh_text: str | None, compile: bool = True) -> dict:
    """Per-device analytic breakdown and compiled numbers of `spec` on the mesh over this host's
    devices (jaxmem.memory --mesh); with --offload-base or --offload-optimizer host also the
    analytic figure without offload ("analytic_without_offload"). compile False: "compiled" is
    None."""
    mesh = resolve(spec, mesh_text)
    analytic = analytic_breakdown(spec, mesh)
    compiled = (compile_step(spec, mesh if target.device_count() > 1 else None)
                if compile else None)
    out = {"mesh": str(mesh), "devices": target.device_count(), "backend": target.platform(),
           "compiler": target.compiler(), "analytic": analytic, "compiled": compiled}
    if spec.placement.base_on_host or spec.placement.state_on_host:
        out["analytic_without_offload"] = analytic_breakdown(
            spec.replace(offload_base="none", offload_optimizer="none"), mesh)["total_bytes"]
    return out


def format_mesh_report(r: dict) -> str:
    a, c = r["analytic"], r["compiled"]
    unit, mib = ("GiB", 2**30) if a["total_bytes"] >= 2**30 else ("MiB", 2**20)
    lines = [f"compiled by: {r['compiler']}",
             f"per device: mesh {r['mesh']} ({r['devices']} {r['backend']} devices), local batch "
             f"{a['local_batch']}, {100 * a['param_fraction']:.1f}% of the trained params on "
             "each device", "", f"{'analytic component':56s} {unit:>10s}  phase"]
    for comp in a["components"]:
        mark = "" if comp["in_peak"] else "  (not in peak)"
        lines.append(f"{comp['name']:56s} {comp['bytes'] / mib:10.2f}  {comp['phase']}{mark}")
    peak = f"analytic peak ({a['peak_phase']}), device"
    lines += [f"{peak:56s} {a['total_bytes'] / mib:10.2f}"]
    if a.get("host_bytes"):
        lines += [f"{'analytic, host memory (pinned), per device':56s} "
                  f"{a['host_bytes'] / mib:10.2f}"]
    if "analytic_without_offload" in r:  # a --remat offload policy alone has no such figure
        lines += [f"{'analytic peak without offload':56s} "
                  f"{r['analytic_without_offload'] / mib:10.2f}  ({unit}, device)"]
    if c is None:
        return "\n".join(lines + ["", "compiled: not compiled (--analytic-only)"])
    lines += ["", "compiled (memory_analysis, per device): " + ", ".join(
                  f"{k.replace('_bytes', '')} {c[k] / mib:.2f} {unit}"
                  for k in ("argument_bytes", "temp_bytes", "output_bytes", "alias_bytes",
                            "peak_bytes")),
              compare_line(r),
              "collectives in the step's HLO: " + ", ".join(
                  f"{k} {v}" for k, v in c["collectives"].items()),
              comm_line(c["communication"])]
    # the compiled program's arguments marked with the host memory space in the entry layout
    # (memory_analysis() on XLA:CPU counts them as device arguments: jaxmem.xla.hlo)
    host = c.get("host_argument_bytes", 0)
    if host:
        lines.append(f"compiled arguments in host memory ({c['host_source']}): "
                     f"{host / mib:.2f} {unit}; device peak: {c['device_peak_bytes'] / mib:.2f} "
                     f"{unit}")
    elif "analytic_without_offload" in r:  # offload asked for, nothing on the host
        lines.append("note: the compiled step has no argument in host memory: its figures are "
                     "those of the state and base on the device (a deviceless compile of a mesh "
                     "drops memory kinds on jax 0.10.2)")
    return "\n".join(lines)


def compare_line(r: dict) -> str:
    """analytic / compiled device peak of a per-device report: the compiled device peak (host
    arguments out), against the analytic figure of the program that was compiled (without
    offload when the compiled step keeps the base on the device)."""
    a, c = r["analytic"], r["compiled"]
    analytic, what = a["total_bytes"], ""
    if "analytic_without_offload" in r and not c.get("host_argument_bytes"):
        analytic, what = r["analytic_without_offload"], " (both without offload)"
    return (f"analytic / compiled peak: "
            f"{analytic / c.get('device_peak_bytes', c['peak_bytes']):.3f}{what}")
