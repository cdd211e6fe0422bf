"""Per-device memory of a train step on a mesh: the analytic model split, and XLA's own numbers.

    analytic_per_device(spec, "fsdp=8")   the analytic breakdown (jaxmem.memory.analytic) as one
                                          device of the mesh holds it
    compile_per_device(spec, "fsdp=8")    the step compiled for the mesh: memory_analysis() is
                                          per device

How the analytic breakdown is split (jaxmem.parallel.rules decides what is split):
- everything shaped like the params (master params, the optimizer state, gradients, the accumulator,
  the update buffer, the compute copy) is the params' bytes on one device under the rules,
  exactly: each leaf's size divided by the mesh axes that split it, replicated leaves in full;
- activations, the logits group and the batch follow the local batch B / (data x fsdp): the
  model is evaluated at that batch size; with `tensor`, a block's activations are those of a
  model with N/t heads, K/t kv heads and MLP width F/t (the [B, T, D] residual stream stays whole);
- FSDP adds one layer's gathered weights in the compute dtype (the all-gather before a layer's
  matmuls), counted in the backward phase;
- LoRA / QLoRA: the adapters and their state split like the adapters' leaves, the frozen base
  leaf by leaf, one packed layer gathered, and with --offload-base host the block layers on the
  host ("host" phase, reported apart): jaxmem.memory.lora_mesh.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from jaxmem import target
from jaxmem.memory.analytic import analytic_breakdown
from jaxmem.xla.collectives import comm_line, comm_report
from jaxmem.memory.lora_mesh import (adapter_fraction, base_components as lora_base_components,
                                     compare_line, format_compiled_host, format_host_lines,
                                     host_split)
from jaxmem.memory.compiled import (abstract_frozen, abstract_state, abstract_step_batch,
                                    compiled_stats)
from jaxmem.memory.spec import StepSpec
from jaxmem.model.llama import abstract_params
from jaxmem.parallel.mesh import AXES, MeshSpec, run_mesh
from jaxmem.train.placement import Placement
from jaxmem.parallel.rules import batch_sharding, leaf_spec
from jaxmem.peft.offload import abstract_in_host_memory

PARAM_SHAPED = ("params (master)", "LoRA adapters (master)", "adam mu", "adam nu", "gradients",
                "grad accumulator", "optimizer update buffer", "params (compute copy)")


def resolve(spec: StepSpec, mesh_text: str | None, devices: int | None = None) -> MeshSpec:
    """The mesh spec for `devices` (default: this host's device count), checked for `spec`."""
    n = devices if devices is not None else target.device_count()
    mesh = MeshSpec.parse(mesh_text).resolve(n, mesh_text)
    mesh.check(spec.model, spec.batch_size, mesh_text, spec.seq_len)
    return mesh


def param_fraction(spec: StepSpec, mesh: MeshSpec) -> float:
    """Elements of the params one device holds under the rules, over all elements."""
    sizes = dict(zip(AXES, mesh.sizes))
    params = abstract_params(spec.model)
    total = local = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        split = math.prod(sizes[n] for a in leaf_spec(path, tuple(leaf.shape), sizes) if a
                          for n in ((a,) if isinstance(a, str) else a))
        total += leaf.size
        local += leaf.size // split
    return local / total


def analytic_per_device(spec: StepSpec, mesh_text: str | None, devices: int | None = None) -> dict:
    """analytic_breakdown as one device of the mesh holds it (see the module docstring)."""
    mesh = resolve(spec, mesh_text, devices) if (mesh_text or devices not in (None, 1)) \
        else MeshSpec(1, 1, 1)
    # context parallelism: each device holds T / context tokens of every activation
    local = dataclasses.replace(spec, batch_size=spec.batch_size // mesh.batch_shards,
                                seq_len=spec.seq_len // mesh.context)
    base = analytic_breakdown(local)
    # activations under tensor parallelism: a block's heads and MLP width are split, so model
    # them as the block of a model with N/t heads, K/t kv heads and width F/t (same head dim)
    m, t = spec.model, mesh.tensor
    narrow = m if t == 1 else m.replace(num_heads=m.num_heads // t, head_dim=m.resolved_head_dim,
                                        num_kv_heads=m.num_kv_heads // t,
                                        intermediate_size=m.intermediate_size // t)
    narrow_b = analytic_breakdown(dataclasses.replace(local, model=narrow))
    acts = narrow_b["components"]
    sizes = dict(zip(AXES, mesh.sizes))
    # LoRA: the state is the adapters'; the frozen base is split leaf by leaf (memory.lora_mesh)
    frac = spec.trainable.state_fraction(lambda: param_fraction(spec, mesh),
                                         lambda: adapter_fraction(spec, sizes))
    comps = []
    for c, a in zip(base["components"], acts):
        if c["name"].startswith("frozen "):  # LoRA's base: counted leaf by leaf below
            continue
        # another optimizer's state (adamw8bit codes and scales, adafactor, lion; named
        # "<optimizer> ..." by jaxmem.memory.optimizer_bytes) is split like the params it
        # belongs to: exact for leaves of the params' shapes, close for block scales / factors
        shaped = c["name"] in PARAM_SHAPED or c["name"].startswith(f"{spec.optimizer} ")
        c = dict(c) if shaped else dict(a)
        if shaped:
            c["bytes"] = int(round(c["bytes"] * frac))
        comps.append(c)
    comps += spec.trainable.per_device_weights(
        lambda: [{"name": n, "bytes": b, "dtype": d, "phase": ph, "in_peak": False}
                 for n, b, d, ph in lora_base_components(spec, sizes, narrow_b["transients"])],
        lambda: _gathered_layer(spec) if mesh.fsdp > 1 else [])
    phases = {ph: sum(c["bytes"] for c in comps if c["phase"] in ("both", ph))
              for ph in ("backward", "optimizer")}
    peak_phase = max(phases, key=phases.get)
    for c in comps:
        c["in_peak"] = c["phase"] in ("both", peak_phase)
    return {"mesh": str(mesh), "devices": math.prod(mesh.sizes), "param_fraction": frac,
            "local_batch": local.batch_size, "components": comps, "peak_phase": peak_phase,
            "total": phases[peak_phase],
            "host": sum(c["bytes"] for c in comps if c["phase"] == "host")}


def _gathered_layer(spec: StepSpec) -> list[dict]:
    """A full fine-tune under fsdp: one layer's weights gathered in the compute dtype."""
    m, cd = spec.model, jax.numpy.dtype(spec.precision.compute_dtype)
    layer = (m.num_params() - m.vocab_size * m.hidden_size * (1 if m.tie_embeddings else 2)
             ) // m.num_layers
    return [{"name": "one layer's gathered weights (fsdp)", "bytes": layer * cd.itemsize,
             "dtype": cd.name, "phase": "backward", "in_peak": False}]


def compile_per_device(spec: StepSpec, mesh_text: str | None, keep_hlo: bool = False) -> dict:
    """The train step compiled for the mesh over this host's devices (None, or one device:
    the single-device step); XLA's per-device memory numbers, the HLO's collectives (static
    ops per kind) and "communication": bytes per device per step (jaxmem.xla.collectives
    .comm_report). keep_hlo: also the optimized HLO text ("hlo")."""
    step_cfg, loss_scale = spec.step_config()
    state = abstract_state(spec)
    batch = abstract_step_batch(spec)
    frozen = abstract_frozen(spec)  # LoRA: the frozen base, the step's third argument
    base = spec.trainable.step_args(frozen)
    mesh = run_mesh(mesh_text, spec.model, spec.batch_size, seq_len=spec.seq_len) if mesh_text else None
    offload = spec.offload_base == "host"  # LoRA only: step_config() refuses it otherwise
    if mesh is None:
        par = Placement.single()
        if offload:  # the block layers in pinned host memory, as the run places them
            base = (abstract_in_host_memory(frozen),)
        lowered = par.train_step(step_cfg, state).lower(state, batch, *base)
    else:
        par = Placement.on(mesh, spec.offload_base)
        if offload:
            base = (jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                 frozen, par.base_shardings(step_cfg)),)
        state = par.abstract(state)
        bs = batch_sharding(mesh)
        batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=bs) for k, v in batch.items()}
        lowered = par.train_step(step_cfg, state).lower(state, batch, *base)
    compiled = lowered.compile()
    stats, flops = compiled_stats(compiled)
    hlo = compiled.as_text()
    comm = comm_report(hlo)
    return {**stats, "flops": flops,
            "collectives": {k: r["ops"] for k, r in comm["by_kind"].items()},
            "communication": comm, **host_split(compiled, stats, hlo),
            **({"hlo": hlo} if keep_hlo else {})}


def mesh_report(spec: StepSpec, mesh_text: str | None, compile: bool = True) -> dict:
    """Per-device analytic breakdown and compiled numbers of `spec` on the mesh over this host's
    devices (jaxmem.memory --mesh); with --offload-base host also the analytic figure without
    offload ("analytic_without_offload"). compile False: "compiled" is None."""
    mesh = resolve(spec, mesh_text)
    analytic = analytic_per_device(spec, mesh_text, target.device_count())
    compiled = (compile_per_device(spec, str(mesh) if target.device_count() > 1 else None)
                if compile else None)
    out = {"mesh": str(mesh), "devices": target.device_count(), "backend": target.platform(),
           "compiler": target.compiler(),
           "analytic": analytic, "compiled": compiled}
    if spec.offload_base == "host":
        on_device = dataclasses.replace(spec, offload_base="none")
        out["analytic_without_offload"] = analytic_per_device(on_device, mesh_text,
                                                              target.device_count())["total"]
    return out


def format_mesh_report(r: dict) -> str:
    a, c = r["analytic"], r["compiled"]
    unit = "GiB" if a["total"] >= 2**30 else "MiB"
    mib = 2**30 if unit == "GiB" else 2**20
    what = "params" if "LoRA adapters (master)" not in {x["name"] for x in a["components"]} \
        else "adapters"
    lines = [f"compiled by: {r['compiler']}",
             f"per device: mesh {r['mesh']} ({r['devices']} {r['backend']} devices), local batch "
             f"{a['local_batch']}, {100 * a['param_fraction']:.1f}% of the {what} on each device",
             "", f"{'analytic component':56s} {unit:>10s}  phase"]
    for comp in a["components"]:
        mark = "" if comp["in_peak"] else "  (not in peak)"
        lines.append(f"{comp['name']:56s} {comp['bytes'] / mib:10.2f}  {comp['phase']}{mark}")
    lines += [f"{'analytic peak (' + a['peak_phase'] + '), device':56s} {a['total'] / mib:10.2f}"]
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


def mesh_candidates(spec: StepSpec, devices: int) -> list[MeshSpec]:
    """Meshes for `devices`, from the least communication to the least memory per device:
    pure data parallel, then more and more of the devices on fsdp, then tensor=2 with fsdp.
    Only meshes the model and batch can be split by (MeshSpec.check) are listed."""
    divisors = [d for d in range(devices, 0, -1) if devices % d == 0]
    out = [MeshSpec(d, devices // d, 1) for d in divisors]
    if devices % 2 == 0:
        out += [MeshSpec(1, devices // 2, 2)]
    ok = []
    for m in out:
        try:
            m.check(spec.model, spec.batch_size)
        except ValueError:
            continue
        ok.append(m)
    return ok


def fit_mesh(spec: StepSpec, budget_bytes: int, log=None) -> dict:
    """The first mesh of `mesh_candidates` (over this host's devices) whose per-device compiled
    peak fits in `budget_bytes`; every candidate tried with its peak. The step itself (batch,
    remat, precision) stays as given: this chooses the mesh only."""
    tried = []
    for m in mesh_candidates(spec, target.device_count()):
        compiled = compile_per_device(spec, str(m))
        fits = compiled["peak_bytes"] <= budget_bytes
        t = {"mesh": str(m), "peak_bytes": compiled["peak_bytes"], "fits": fits,
             "collectives": compiled["collectives"]}
        tried.append(t)
        if log:
            log(t)
        if fits:
            return {"chosen": t, "tried": tried}
    return {"chosen": None, "tried": tried}
