"""What host-resident state costs a step in memory and on the link: the pinned host memory it
takes and the bytes it moves over the card's PCIe link per optimizer step.

    t = transfer_plan(spec)     # None where nothing lives on the host
    format_transfers(t)         # the lines the planner prints

Bytes over the link per optimizer step, from the counted host-resident components
(jaxmem.memory.counted: `Where.HOST`) times the crossings the step states
(jaxmem.train.footprint):

    optimizer state (--offload-optimizer host)  in for its layer's update, out after: 2 x
    trained weights on the host                  in for the forward, in again for the backward's
                                                 recompute, out after the update:           3 x
    frozen base (--offload-base host)            in for the forward and the backward, per
                                                 micro-batch:                                 2 x
    activations (--remat offload)                out in the forward, in for the backward, per
                                                 micro-batch:                                 2 x

The seconds these transfers take, and how much of them the step's compute hides, come from the
card's compiled step (jaxmem.memory.seconds: each copy on the link's engine, overlapped as the
schedule places its start and done), not from these totals: the earlier estimate here, the
bytes at the link against the FLOPs at the peak, could not tell a prefetched copy from one the
update waits for.
"""

from __future__ import annotations

from jaxmem.memory.analytic import offloaded_activations
from jaxmem.memory.counted import Kind, Where, count_state
from jaxmem.memory.spec import StepSpec

# the step's name of each host-resident part (jaxmem.train.footprint states its crossings)
_PART = {Kind.OPTIMIZER: "optimizer", Kind.PARAMS: "params", Kind.FROZEN: "frozen",
         Kind.ACTIVATIONS: "activations"}


def transfer_plan(spec: StepSpec) -> dict | None:
    """Host bytes and PCIe bytes per step (the module docstring); None where the step keeps
    nothing on the host."""
    host = [x for x in count_state(spec) if x.where is Where.HOST]
    acts = offloaded_activations(spec)  # the analytic breakdown's own component
    if acts.bytes:
        host.append(acts)
    if not host:
        return None
    rows = []
    for x in host:
        times, what = spec.footprint.crossings(_PART[x.kind])
        rows.append({"name": x.label, "host_bytes": x.bytes, "crossings": times,
                     "pcie_bytes": x.bytes * times, "why": what})
    tokens = spec.rows * spec.seq_len * spec.grad_accum
    return {"host_bytes": sum(r["host_bytes"] for r in rows),
            "pcie_bytes": sum(r["pcie_bytes"] for r in rows), "parts": rows, "tokens": tokens}


def format_transfers(t: dict) -> list[str]:
    """The planner's lines for a `transfer_plan`."""
    div, unit = (2**30, "GiB") if t["host_bytes"] >= 2**30 else (2**20, "MiB")
    lines = ["host memory and transfers (per optimizer step)"]
    lines += [f"  {r['name']:<50}{r['host_bytes'] / div:8.2f} {unit} host, x{r['crossings']} "
              f"over PCIe = {r['pcie_bytes'] / 1e9:.3g} GB" for r in t["parts"]]
    lines += [f"  {'pinned host memory needed':<50}{t['host_bytes'] / div:8.2f} {unit}",
              f"  {'bytes over PCIe per step':<50}{t['pcie_bytes'] / 1e9:8.3g} GB"]
    return lines + ["  (the seconds: the predicted time below, with --target CARD)"]
