"""What XLA plans for the programs of a run: compiled ahead of time from abstract shapes for a
placement (one device, or one device of a mesh), nothing allocated.

    compile_phase(name, spec, mesh)   the one function that compiles a program of the run:
                                      "step" (optimizer included, state donated), "state",
                                      "eval", "sample", "import"; XLA's memory numbers and FLOPs
    compile_step(spec, mesh)          the step, with its collectives and host arguments
    grad_step_report(...)             value_and_grad of the loss alone (fp32; docs/remat.md)

Each compiles the placement's own programs (jaxmem.train.placement, jaxmem.decode.sampling,
jaxmem.peft.base.import_programs) on the arguments the run passes, as abstract values: a number
here is a number of the real program, not of a look-alike.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmem import target
from jaxmem.families.config import ModelConfig
from jaxmem.xla.analysis import MemoryAnalysis
from jaxmem.xla.collectives import comm_report
from jaxmem.xla.hlo import entry_argument_bytes
from jaxmem.memory.counted import (abstract_frozen, abstract_state,  # noqa: F401
                                   abstract_step_batch, count_state, tree_bytes)
from jaxmem.memory.seconds import predict
from jaxmem.memory.spec import StepSpec
from jaxmem import families
from jaxmem.families.params import abstract_params, count_params
from jaxmem.model.remat import RematPolicy
from jaxmem.parallel.mesh import MeshSpec, run_mesh
from jaxmem.parallel.rules import batch_sharding
from jaxmem.decode.sampling import lower_sample
from jaxmem.peft.base import import_programs
from jaxmem.train import (Placement, abstract_batch, objective_batch, state_creation_fn,
                          state_programs, token_loss)


def compiled_stats(compiled) -> tuple[dict, float]:
    """(XLA's memory numbers as a plain dict, FLOPs) for a compiled executable: peak = temp +
    argument + output - alias (jaxmem.xla.analysis.MemoryAnalysis, as `analyze` gives them)."""
    analysis = MemoryAnalysis.of_compiled(compiled)
    return analysis.stats(), analysis.flops


def argument_bytes(spec: StepSpec) -> int:
    """Exact bytes of the step's arguments (counted): a lower bound of the compiled peak."""
    return sum(c.bytes for c in count_state(spec))


def placement(spec: StepSpec, mesh: MeshSpec | None) -> Placement:
    """The run's placement for `mesh` (None: one device) over this host's devices."""
    if mesh is None:
        return Placement(None, spec.offload_base, spec.offload_optimizer, spec.offload_params)
    return Placement.on(run_mesh(str(mesh), spec.model, spec.batch_size, seq_len=spec.seq_len),
                        spec.offload_base, spec.offload_optimizer)


def _host_resident(par: Placement) -> bool:
    """Whether one device's program holds values in host memory (then a target compiles it
    through jaxmem.target.lower: the deviceless devices have no host memory of their own)."""
    return par.mesh is None and bool(par.host_parts or par.base_on_host)


def _lower(par: Placement, jitted, *args):
    return target.lower(jitted, *args) if _host_resident(par) else jitted.lower(*args)


def _state(spec, par):
    """The abstract train state as the placement passes it (a mesh's shardings; one device's
    host-resident parts)."""
    state = abstract_state(spec)
    return par.abstract(state) if par.mesh is not None or _host_resident(par) else state


def _lower_step(spec, par, sample):
    """The train step on the run's abstract arguments, sharded as the placement puts them."""
    step_cfg = spec.step
    state, batch = _state(spec, par), abstract_step_batch(spec)
    if par.mesh is not None:
        bs = batch_sharding(par.mesh)
        batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=bs) for k, v in batch.items()}
    base = par.abstract_base(step_cfg, abstract_frozen(spec))
    return _lower(par, par.train_step(step_cfg, state), state, batch,
                  *spec.trainable.step_args(base))


def _lower_sample(spec, par, sample):
    limit = spec.model.max_position_embeddings
    # the trained weights where the run keeps them (--offload-params host: a full fine-tune,
    # whose sample takes the state's params)
    params = _state(spec, par).params if "params" in par.host_parts else sample_params(spec)
    return lower_sample(spec.model, params, sample.n_prompt(limit), sample.total(limit),
                        compute_dtype=sample.compute_dtype(spec.precision.compute_dtype),
                        temperature=sample.temperature,
                        top_k=min(sample.top_k, spec.model.vocab_size),
                        lower=target.lower if _host_resident(par) else None)


_LOWER = {"step": _lower_step, "sample": _lower_sample,
          "state": lambda spec, par, _: _lower(par, par.state_creation(*spec.step_config(),
                                                                       seed=0)),
          "eval": lambda spec, par, _: _lower(
              par, par.eval_fn(spec.step), _state(spec, par).params,
              objective_batch(spec.step, spec.batch_size, spec.seq_len),
              par.abstract_base(spec.step, abstract_frozen(spec)))}


def _compile_host_state(spec, par):
    """The state creation of a run with parts on the host (jaxmem.train.host_state): its
    device-leaf program, its largest row piece and its largest layer-by-layer params stack (on
    a mesh: its largest optimizer leaf), each compiled; the one with the largest peak (the
    others run before, on an empty device)."""
    fn = state_creation_fn(*spec.step_config(), seed=0)
    progs, _ = state_programs(fn, par._placed_shardings(jax.eval_shape(fn)),
                                   pieces=par.mesh is None)
    largest = {}
    for p in progs[:-1]:
        if p.kind not in largest or p.leaf.size > largest[p.kind].leaf.size:
            largest[p.kind] = p
    best = None
    for p in [*largest.values(), progs[-1]]:
        stats, flops = compiled_stats(p.lower(lower=functools.partial(_lower, par)).compile())
        if best is None or stats["peak_bytes"] > best[0]["peak_bytes"]:
            best = (stats, flops)
    return best


def compile_phase(name: str, spec: StepSpec, mesh: MeshSpec | None = None, sample=None,
                  keep_hlo: bool = False) -> dict:
    """XLA's memory numbers (and "flops") of phase `name`'s program for a placement (`mesh`: per
    device; eval, sample and import on one device); sample: the run's SampleShape. The step also
    gives "collectives", "communication" (jaxmem.xla.collectives.comm_report), its host
    arguments apart (`host_split`) and, compiled for a GPU the planner knows, its predicted
    "time" (jaxmem.memory.seconds.predict); keep_hlo: the optimized HLO text ("hlo")."""
    if name == "import":
        return _compile_import(spec)
    if mesh is not None and name in ("sample", "eval"):
        raise ValueError(f"the {name} phase is planned on one device")
    par = placement(spec, mesh)
    if name == "state" and par.state_on_host:
        stats, flops = _compile_host_state(spec, par)
        return {**stats, "flops": flops}
    compiled = _LOWER[name](spec, par, sample).compile()
    stats, flops = compiled_stats(compiled)
    out = {**stats, "flops": flops}
    if name != "step":
        return out
    hlo = compiled.as_text()
    comm = comm_report(hlo)
    card = target.card_here()
    return {**out, "collectives": {k: r["ops"] for k, r in comm["by_kind"].items()},
            "communication": comm, **host_split(compiled, stats, hlo),
            **({"time": predict(hlo, card)} if card is not None else {}),
            **({"hlo": hlo} if keep_hlo else {})}


def compile_step(spec: StepSpec, mesh: MeshSpec | None = None, keep_hlo: bool = False) -> dict:
    """The full train step for a placement: `compile_phase("step", ...)`."""
    return compile_phase("step", spec, mesh, keep_hlo=keep_hlo)


def host_split(compiled, stats: dict, hlo_text: str) -> dict:
    """{"host_argument_bytes", "host_temp_bytes", "device_peak_bytes"} of a compiled step: the
    host arguments as memory_analysis() reports them apart (GPU), else as the entry layout marks
    them (XLA:CPU, where they are inside argument_size_in_bytes and so taken out of the device
    peak); host_temp_bytes: host memory XLA allocates for the step itself (GPU; 0 where not
    reported), e.g. a copy of a whole host-resident stack."""
    ma = compiled.memory_analysis()
    reported = int(getattr(ma, "host_argument_size_in_bytes", 0) or 0)
    marked = 0 if reported else entry_argument_bytes(hlo_text)[0]
    return {"host_argument_bytes": reported or marked,
            "host_temp_bytes": int(getattr(ma, "host_temp_size_in_bytes", 0) or 0),
            "host_source": "memory_analysis" if reported else "entry layout S(5)",
            "device_peak_bytes": stats["peak_bytes"] - marked}


def grad_step_report(config: ModelConfig, remat: RematPolicy | str, batch_size: int,
                     seq_len: int) -> dict:
    """Compile value_and_grad of the train step's loss (fp32: `token_loss` over the token count)
    ahead of time: memory and FLOPs."""
    remat = RematPolicy.parse(remat)
    model = families.model(config, remat)
    params = abstract_params(config)

    def loss(p, batch):
        total, count = token_loss(model, p, batch)
        return total / jnp.maximum(count, 1.0)

    compiled = jax.jit(jax.value_and_grad(loss)).lower(
        params, abstract_batch(batch_size, seq_len)).compile()
    stats, flops = compiled_stats(compiled)
    return {"backend": target.platform(), "compiler": target.compiler(),
            "jax_version": jax.__version__, "remat": str(remat), "batch_size": batch_size,
            "seq_len": seq_len, "num_layers": config.num_layers,
            "hidden_size": config.hidden_size, "params": count_params(params),
            "compiled": stats, "flops": flops}


def sample_params(spec: StepSpec):
    """The params the end-of-run sample is given (jaxmem.train.loop), as ShapeDtypeStructs: the
    state's; for LoRA / QLoRA the base as the step holds it, each target wrapped with its
    adapters."""
    return jax.eval_shape(lambda f, a: spec.trainable.model_params(a, f, None)[0],
                          abstract_frozen(spec), abstract_state(spec).params)


def _compile_import(spec: StepSpec) -> dict:
    """XLA's memory numbers of a LoRA run's import of its frozen base (the one-device import's
    programs, jaxmem.peft.base.import_programs: per projection, one fp32 layer quantized into
    the donated stacked result): {"peak_bytes": the largest (program peak - its stacked
    result's bytes), what the import needs beyond the finished base (0 where nothing is
    quantized), "roles": {role: the program's stats}}."""
    roles, extra = {}, 0
    for prog in import_programs(spec.model, spec.trainable):
        stats = compiled_stats(prog["fn"].lower(*prog["args"]).compile())[0]
        roles[prog["role"]] = {**stats, "stacked_bytes": prog["stacked_bytes"]}
        extra = max(extra, stats["peak_bytes"] - prog["stacked_bytes"])
    return {"peak_bytes": int(extra), "roles": roles}
