"""Per-device memory of a train step on a mesh: the analytic breakdown on one device of it
(jaxmem.memory.analytic, counted under the sharding rules) and XLA's own numbers.

    mesh_report(spec, "fsdp=8")           both, for `python -m jaxmem.memory --mesh`
                                          (jaxmem.memory.compiled.compile_step on the mesh:
                                          memory_analysis() is per device)
"""

from __future__ import annotations


from jaxmem import target
from jaxmem.memory.analytic import analytic_breakdown
from jaxmem.xla.collectives import comm_line
from jaxmem.memory.compiled import compile_step, placement
from jaxmem.memory.spec import StepSpec
from jaxmem.parallel.mesh import MeshSpec


def resolve(spec: StepSpec, mesh_text: str | None, devices: int | None = None) -> MeshSpec:
    """The mesh spec for `devices` (default: this host's device count), checked for `spec`."""
    n = devices if devices is not None else target.device_count()
    mesh = MeshSpec.parse(mesh_text).resolve(n, mesh_text)
    mesh.check(spec.model, spec.batch_size, mesh_text, spec.seq_len)
    return mesh


def mesh_report(spec: StepSpec, mesh_text: str | None, compile: bool = True) -> dict:
    """Per-device analytic breakdown and compiled numbers of `spec` on the mesh over this host's
    devices (jaxmem.memory --mesh); with --offload-base host also the analytic figure without
    offload ("analytic_without_offload"). compile False: "compiled" is None."""
    mesh = resolve(spec, mesh_text)
    analytic = analytic_breakdown(spec, mesh)
    compiled = (compile_step(spec, mesh if target.device_count() > 1 else None)
                if compile else None)
    out = {"mesh": str(mesh), "devices": target.device_count(), "backend": target.platform(),
           "compiler": target.compiler(),
           "analytic": analytic, "compiled": compiled}
    if placement(spec, None).base_on_host:
        on_device = spec.replace(offload_base="none")
        out["analytic_without_offload"] = analytic_breakdown(on_device, mesh)["total_bytes"]
    return out


def format_mesh_report(r: dict) -> str:
    a, c = r["analytic"], r["compiled"]
    unit = "GiB" if a["total_bytes"] >= 2**30 else "MiB"
    mib = 2**30 if unit == "GiB" else 2**20
    what = "trained params"
    lines = [f"compiled by: {r['compiler']}",
             f"per device: mesh {r['mesh']} ({r['devices']} {r['backend']} devices), local batch "
             f"{a['local_batch']}, {100 * a['param_fraction']:.1f}% of the {what} on each device",
             "", f"{'analytic component':56s} {unit:>10s}  phase"]
    for comp in a["components"]:
        mark = "" if comp["in_peak"] else "  (not in peak)"
        lines.append(f"{comp['name']:56s} {comp['bytes'] / mib:10.2f}  {comp['phase']}{mark}")
    peak = f"analytic peak ({a['peak_phase']}), device"
    lines += [f"{peak:56s} {a['total_bytes'] / mib:10.2f}"]
    lines += format_host_lines(r, mib)
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
    return "\n".join(lines + format_compiled_host(c, mib, "analytic_without_offload" in r))


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


def format_host_lines(r: dict, div: int) -> list[str]:
    """The host lines of a per-device report (jaxmem.memory.mesh.mesh_report)."""
    a = r["analytic"]
    if not a.get("host_bytes"):
        return []
    unit = "MiB" if div == 2**20 else "GiB"
    return [f"{'analytic, host memory (pinned), per device':56s} {a['host_bytes'] / div:10.2f}",
            f"{'analytic peak without --offload-base host':56s} "
            f"{r['analytic_without_offload'] / div:10.2f}  ({unit}, device)"]


def format_compiled_host(c: dict, div: int, offload: bool = False) -> list[str]:
    """What the compiled program puts in host memory: its arguments marked with the host
    memory space in the entry layout (memory_analysis() on XLA:CPU counts them as device
    arguments; see jaxmem.xla.hlo.entry_argument_bytes). offload: --offload-base host was asked
    for; a program
    with no argument on the host is then said not to offload."""
    host = c.get("host_argument_bytes", 0)
    if not host:
        return ["note: the compiled step has no argument in host memory: its figures are those of "
                "the base on the device (this build does not offload it)"] if offload else []
    unit = "MiB" if div == 2**20 else "GiB"
    return [f"compiled arguments in host memory ({c['host_source']}): {host / div:.2f} {unit}; "
            f"device peak: {c['device_peak_bytes'] / div:.2f} {unit}"]
