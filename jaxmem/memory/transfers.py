"""What host-resident state costs a step: the pinned host memory it takes, the bytes it moves over
the card's PCIe link, and whether those transfers can hide behind the step's compute.

    t = transfer_plan(spec, card)     # None where nothing lives on the host
    format_transfers(t)               # the lines the planner prints

Bytes over the link per optimizer step, from the counted host-resident components
(jaxmem.memory.counted: `Where.HOST`):

    optimizer state (--offload-optimizer host)  in for its layer's update, out after: 2 x
    trained weights on the host                  in for the forward, in again for the backward's
                                                 recompute, out after the update:           3 x
    frozen base (--offload-base host)            in for the forward and the backward, per
                                                 micro-batch:                                 2 x
    activations (--remat offload)                out in the forward, in for the backward, per
                                                 micro-batch:                                 2 x

Time: the transfers at the link's one-way bandwidth (`HostLink`, both directions summed, as if
the link carried one at a time: PCIe is full duplex, so this is the pessimistic side), against
the step's compute at the card's dense bf16 peak (`Card.peak_tflops`, the optimistic side:
training FLOPs of jaxmem.perf.flops_per_token, x 4/3 under --remat full or
--optimizer-in-backward, which recompute the forward; other policies' partial recompute is not
counted, nor that a LoRA step computes no gradient of its frozen weights).

What overlaps: with the weights on the host (`--offload-params host`) the in-backward loop
fetches layer l - 1's weights and state during layer l (a prefetch), and every copy can hide
behind compute. With only the optimizer state there, each part's state comes a sub-piece at a
time right before that sub-piece's update (a layer of it would not fit beside the backward on
the cards this is for: jaxmem.optim Parts.layer), so its inbound bytes are exposed: added to
the compute, not hidden by it; the write-backs still overlap. The step takes at least
max(compute + exposed, transfers); the transfers hide from `min_tokens` tokens per step on.
"""

from __future__ import annotations

import math

from jaxmem.memory.analytic import offloaded_activations
from jaxmem.memory.counted import Kind, Where, count_state
from jaxmem.memory.spec import StepSpec
from jaxmem.perf import flops_per_token

# how many times a host-resident component crosses the link per optimizer step
_CROSSINGS = {Kind.OPTIMIZER: (2, "optimizer state: in and out once"),
              Kind.PARAMS: (3, "weights: in for the forward and the backward, out once"),
              Kind.FROZEN: (2, "frozen base: in for the forward and the backward, per "
                               "micro-batch"),
              Kind.ACTIVATIONS: (2, "activations: out in the forward, in for the backward, per "
                                    "micro-batch")}


def transfer_plan(spec: StepSpec, card=None) -> dict | None:
    """Host bytes, PCIe bytes per step and (with a `card`: jaxmem.target.Card) the time
    estimate of the module docstring; None where the step keeps nothing on the host."""
    host = [x for x in count_state(spec) if x.where is Where.HOST]
    acts = offloaded_activations(spec)  # the analytic breakdown's own component
    if acts.bytes:
        host.append(acts)
    if not host:
        return None
    rows = []
    for x in host:
        times, what = _CROSSINGS[x.kind]
        times *= spec.grad_accum if x.kind in (Kind.FROZEN, Kind.ACTIVATIONS) else 1
        rows.append({"name": x.label, "host_bytes": x.bytes, "crossings": times,
                     "pcie_bytes": x.bytes * times, "why": what})
    tokens = spec.batch_size * spec.seq_len * spec.grad_accum
    out = {"host_bytes": sum(r["host_bytes"] for r in rows),
           "pcie_bytes": sum(r["pcie_bytes"] for r in rows), "parts": rows, "tokens": tokens}
    if card is None:
        return out
    # remat full and --optimizer-in-backward recompute each layer's forward in the backward
    recompute = 4 / 3 if spec.remat.kind == "full" or spec.in_backward else 1.0
    per_token = flops_per_token(spec.model, spec.seq_len) * recompute
    peak = card.peak_tflops[0] * 1e12
    bw = card.host_link.bandwidth
    compute_s, transfer_s = tokens * per_token / peak, out["pcie_bytes"] / bw
    # the optimizer state's fetches, made right before each update where no weights are
    # prefetched with them (the module docstring)
    exposed = 0 if spec.step.optim.params_on_host else sum(
        x.bytes for x in host if x.kind is Kind.OPTIMIZER)
    exposed_s = exposed / bw
    return {**out, "card": card.name, "link": card.host_link.describe(),
            "link_bytes_per_s": bw, "peak_flops": peak,
            "flops_per_token": per_token, "compute_s": compute_s, "transfer_s": transfer_s,
            "exposed_bytes": exposed, "exposed_s": exposed_s,
            "step_s": max(compute_s + exposed_s, transfer_s),
            "bound": "transfers" if transfer_s > compute_s + exposed_s else "compute",
            "min_tokens": math.ceil((transfer_s - exposed_s) * peak / per_token)}


def format_transfers(t: dict) -> list[str]:
    """The planner's lines for a `transfer_plan`."""
    div, unit = (2**30, "GiB") if t["host_bytes"] >= 2**30 else (2**20, "MiB")
    lines = ["host memory and transfers (per optimizer step)"]
    lines += [f"  {r['name']:<50}{r['host_bytes'] / div:8.2f} {unit} host, x{r['crossings']} "
              f"over PCIe = {r['pcie_bytes'] / 1e9:.3g} GB" for r in t["parts"]]
    lines += [f"  {'pinned host memory needed':<50}{t['host_bytes'] / div:8.2f} {unit}",
              f"  {'bytes over PCIe per step':<50}{t['pcie_bytes'] / 1e9:8.3g} GB"]
    if "card" not in t:
        return lines + ["  (no time estimate: pass --target to name the card and its link)"]
    return lines + [
        f"  {'transfers at the link':<50}{t['transfer_s']:8.2f} s  ({t['link']})",
        f"  {'compute at the card':<50}{t['compute_s']:8.2f} s  ({t['tokens']:,} tokens x "
        f"{t['flops_per_token'] / 1e9:.1f} GFLOP at {t['peak_flops'] / 1e12:g} TFLOP/s)",
        *([f"  {'not overlapped: state fetched before its update':<50}{t['exposed_s']:8.2f} s"
           f"  ({t['exposed_bytes'] / 1e9:.3g} GB; only weights on the host are prefetched)"]
          if t.get("exposed_bytes") else []),
        f"  {'estimated step time':<50}{t['step_s']:8.2f} s  ({t['bound']}-bound)",
        f"  {'tokens per step from which transfers hide':<50}{t['min_tokens']:>8,}",
        "  assumed: both directions summed at the one-way bandwidth (pessimistic), compute at "
        "the dense bf16 peak (optimistic): a real step is slower than both"]
