"""A recipe's plan: the largest phase of its run (jaxmem.memory.phases) against its card, per
device (a recipe with `parallel.mesh`: the step's per-device figure on that mesh, the planner's
`--mesh` view). Analytic by default (no compile: what `python -m jaxmem.recipes` lists);
`compiled=True` compiles each phase with the card's own XLA compiler without the card
(jaxmem.target, the gpu-plan extra), as `python -m jaxmem.memory ... --target CARD --compile`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jaxmem import recipes, target
from jaxmem.errors import ConfigError
from jaxmem.memory.analytic import analytic_breakdown
from jaxmem.memory.compiled import compile_step
from jaxmem.memory.mesh import resolve
from jaxmem.memory.phases import SampleShape, run_phases
from jaxmem.memory.spec import GiB, StepSpec
from jaxmem.perf import usable_bytes


@dataclass(frozen=True)
class Plan:
    """One recipe's planned peak per device (`peak_bytes`, in `phase`; `source` "analytic",
    "compiled", or "compiled, host base taken out": `_mesh_step`) against its budget (`budget_bytes`: the card's memory as CUDA reports it, or the
    smaller size the recipe's name states; `usable_bytes`: what XLA may use of it by the
    planner's rule, jaxmem.perf.usable_bytes)."""

    name: str
    card: str
    peak_bytes: int
    phase: str
    source: str
    budget_bytes: int
    usable_bytes: int
    devices: int = 1

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.usable_bytes


def spec_of(name: str) -> StepSpec:
    """The recipe's train step as the planner plans it."""
    return StepSpec.from_run_config(recipes.run_config(name))


def card_of(name: str) -> str:
    """The recipe's `card`, checked against jaxmem.target's cards."""
    card = recipes.load(name)["card"]
    if card not in target.CARDS:
        raise ConfigError(f"recipe {name!r}: card {card!r} is not one of "
                          f"{', '.join(sorted(target.CARDS))}")
    return card


def budget_bytes(name: str) -> int:
    """The device size a recipe is planned against: its card's memory, or the size its name
    states where smaller (`qwen3-8b-qlora-12gb` on the RTX 4090's compiler: 12 GiB; a GB of a
    card's name is taken as a GiB, as the planner's --fit takes it)."""
    size = target.CARDS[card_of(name)].memory_bytes
    stated = re.search(r"(?:^|[-x])(\d+)gb(?:-|$)", name)
    return min(size, int(stated.group(1)) * GiB) if stated else size


def plan(name: str, compiled: bool = False) -> Plan:
    """The recipe's planned peak per device against its card. compiled=True must run inside
    `target.compiling_for(card, devices)` (see `compile_plan`)."""
    cfg, card = recipes.run_config(name), card_of(name)
    spec = StepSpec.from_run_config(cfg)
    size = budget_bytes(name)
    budget = usable_bytes(size / GiB)
    if cfg.parallel.mesh:  # the step per device on the mesh (the planner's --mesh view)
        devices = mesh_devices(cfg.parallel.mesh)
        peak, source = _mesh_step(spec, resolve(spec, cfg.parallel.mesh, devices=devices),
                                  compiled)
        return Plan(name, card, peak, "step", source, size, budget, devices)
    r = run_phases(spec, SampleShape.of(cfg), compile=compiled,
                   step_compiled=compile_step(spec) if compiled else None)
    return Plan(name, card, r["peak_bytes"], r["peak_phase"], r["peak_source"], size, budget)


def _mesh_step(spec: StepSpec, mesh, compiled: bool) -> tuple[int, str]:
    """(the step's peak per device on `mesh`, its source). Compiled with `--offload-base host`:
    jax 0.10.2's deviceless devices have no host memory, so a mesh program's pinned-host base
    compiles as device-resident (host_argument_bytes 0); the base the analytic count places on
    the host is taken out of the compiled peak, less the one layer's shard each device copies
    in (jaxmem.memory.counted), and the source says so."""
    a = analytic_breakdown(spec, mesh)
    if not compiled:
        return int(a["total_bytes"]), "analytic"
    c = compile_step(spec, mesh)
    peak = int(c.get("device_peak_bytes", c["peak_bytes"]))
    if spec.offload_base == "host" and not c.get("host_argument_bytes"):
        host = int(a.get("host_bytes") or 0)
        return peak - host + host // spec.model.num_layers, "compiled, host base taken out"
    return peak, "compiled"


def mesh_devices(mesh_text: str) -> int:
    """Devices a recipe's mesh names (the product of its AXIS=SIZE sizes; no -1 in a recipe)."""
    n = 1
    for part in mesh_text.split(","):
        n *= int(part.partition("=")[2])
    return n


def compile_plan(name: str) -> Plan:
    """`plan(name, compiled=True)` for the recipe's own card, without the card (needs the
    gpu-plan extra and `target.prepare()` before JAX starts)."""
    cfg = recipes.run_config(name)
    devices = mesh_devices(cfg.parallel.mesh) if cfg.parallel.mesh else 1
    with target.compiling_for(card_of(name), devices=devices):
        return plan(name, compiled=True)
