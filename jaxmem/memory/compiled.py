"""What XLA plans for a step: compiled ahead of time from abstract shapes, nothing allocated.

    compile_step(spec)         the full train step (optimizer included, state donated):
                               XLA's memory_analysis() and FLOPs
    argument_bytes(spec)       exact bytes of the step's arguments (state + batch): a lower bound
                               of the compiled peak, which lets the planner reject a candidate
                               without compiling it
    grad_step_report(...)      the gradient of the train step's loss alone (fp32), for the remat
                               measurements (docs/remat.md)
    compile_state(spec)        the program that makes the train state (jaxmem.memory.phases)
    compile_eval(spec)         the eval function of a run (make_eval_fn: the fused loss)
    compile_sample(spec, ...)  the end-of-run sampler (jaxmem.decode.sampling.lower_sample)
    compile_import(spec)       a QLoRA run's import: its base quantized layer by layer
                               (jaxmem.peft.base.import_programs)

Both compile the code that trains: `jaxmem.train.step.jit_train_step` on
`jaxmem.train.run.abstract_step_args` (the step's own arguments) and
`jaxmem.train.loss.token_loss` (causal-only attention, padding removed by the loss mask), so a
number here is a number of the real step, not of a look-alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem import target
from jaxmem.config.model import ModelConfig
from jaxmem.xla.analysis import MemoryAnalysis, analyze
from jaxmem.memory.counted import (abstract_frozen, abstract_state,  # noqa: F401
                                   abstract_step_batch, count_state, tree_bytes)
from jaxmem.memory.spec import StepSpec
from jaxmem.model.llama import Llama, abstract_params, count_params
from jaxmem.model.remat import RematPolicy, check_offload_supported
from jaxmem.train.loss import abstract_batch, token_loss
from jaxmem.train.run import abstract_step_args, make_eval_fn
from jaxmem.train.step import jit_train_step, state_creation_fn


def compiled_stats(compiled) -> tuple[dict, float]:
    """(XLA's memory numbers as a plain dict, FLOPs) for a compiled executable.

    peak = temp + argument + output - alias: what the executable needs at once, with donated
    (aliased) outputs written over their inputs. The figures are `MemoryAnalysis.of_compiled`'s
    (jaxmem.xla.analysis), the ones `jaxmem.memory.analyze` gives for any function.
    """
    analysis = MemoryAnalysis.of_compiled(compiled)
    return analysis.stats(), analysis.flops


def argument_bytes(spec: StepSpec) -> int:
    """Exact bytes of the step's arguments (jaxmem.memory.counted); a lower bound of the
    compiled peak."""
    return sum(c.bytes for c in count_state(spec))


def compile_step(spec: StepSpec) -> dict:
    """Compile the full train step ahead of time; XLA's memory and FLOP numbers (no allocation)."""
    if spec.remat.kind == "offload":
        check_offload_supported()
    step_cfg, loss_scale = spec.step_config()
    analysis = analyze(jit_train_step(step_cfg), *abstract_step_args(
        step_cfg, loss_scale, spec.batch_size, spec.seq_len, spec.grad_accum))
    return {**analysis.stats(), "flops": analysis.flops}


def grad_step_report(config: ModelConfig, remat: RematPolicy | str, batch_size: int,
                     seq_len: int) -> dict:
    """Compile value_and_grad of the train step's loss (fp32) ahead of time: memory and FLOPs.

    The loss is the step's: `token_loss` (causal-only attention) divided by the token count.
    """
    remat = RematPolicy.parse(remat)
    model = Llama(config, remat)
    params = abstract_params(config)

    def loss(p, batch):
        total, count = token_loss(model, p, batch)
        return total / jnp.maximum(count, 1.0)

    compiled = jax.jit(jax.value_and_grad(loss)).lower(
        params, abstract_batch(batch_size, seq_len)).compile()
    stats, flops = compiled_stats(compiled)
    return {
        "backend": target.platform(),
        "compiler": target.compiler(),
        "jax_version": jax.__version__,
        "remat": str(remat),
        "batch_size": batch_size,
        "seq_len": seq_len,
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "params": count_params(params),
        "compiled": stats,
        "flops": flops,
    }


def state_program(step_cfg, loss_scale, seed: int = 0, out_shardings=None):
    """The program a run makes its train state with, jitted (`out_shardings` under a mesh):
    `jaxmem.train.step.state_creation_fn`, the function `create_train_state` and
    `Placement.init_state` jit too, so the state phase plans what the run executes."""
    return jax.jit(state_creation_fn(step_cfg, loss_scale, seed), out_shardings=out_shardings)


def compile_state(spec: StepSpec, seed: int = 0) -> dict:
    """XLA's memory numbers of making the train state (output: the state; no arguments)."""
    return compiled_stats(state_program(*spec.step_config(), seed).lower().compile())[0]


def compile_eval(spec: StepSpec) -> dict:
    """XLA's memory numbers of the run's eval function on one [B, T] batch (make_eval_fn)."""
    fn = make_eval_fn(spec.step_config()[0])
    lowered = fn.lower(abstract_state(spec).params, abstract_batch(spec.batch_size, spec.seq_len),
                       abstract_frozen(spec))
    return compiled_stats(lowered.compile())[0]


def sample_params(spec: StepSpec):
    """The params the end-of-run sample is given, as ShapeDtypeStructs: the state's params; for
    LoRA / QLoRA what the run passes (jaxmem.train.loop): `peft.full_params(frozen base,
    adapters)`, the quantized base (as the step holds it) with each target wrapped with its
    adapters as stored."""
    params = abstract_state(spec).params
    return jax.eval_shape(lambda f, a: spec.trainable.model_params(a, f, None)[0],
                          abstract_frozen(spec), params)


def compile_sample(spec: StepSpec, n_prompt: int, total: int, temperature: float = 0.0,
                   top_k: int = 0, dtype: str | None = None) -> dict:
    """XLA's memory numbers of the end-of-run sampler for `total` positions (arguments: the
    params as the run passes them (`sample_params`), the token buffer, the key), computing in
    the dtype the run samples in: jaxmem.decode.stopping.sample_dtype(dtype, the compute dtype)
    (`dtype`: the run's --dtype, None: bf16 on a GPU (fp16 for an fp16 run), else the compute
    dtype)."""
    from jaxmem.decode.sampling import lower_sample
    from jaxmem.decode.stopping import sample_dtype
    lowered = lower_sample(spec.model, sample_params(spec), n_prompt, total,
                           compute_dtype=sample_dtype(dtype, spec.precision.compute_dtype),
                           temperature=temperature, top_k=min(top_k, spec.model.vocab_size))
    return compiled_stats(lowered.compile())[0]


def compile_import(spec: StepSpec) -> dict:
    """XLA's memory numbers of a LoRA run's import of its frozen base, from the programs the
    one-device import runs (jaxmem.peft.base.import_programs: per projection, one layer
    quantized into the donated stacked result; the layer read in fp32, a seed's init; a 16-bit
    checkpoint's layer is half of it).

    Returns {"peak_bytes": the largest over the projections of (program peak - its stacked
    result's bytes): what the import needs beyond the finished base, "roles": {role: the
    program's stats}}; peak_bytes 0 for a base that is not quantized (its leaves are only put).
    """
    from jaxmem.peft.base import import_programs
    roles, extra = {}, 0
    for prog in import_programs(spec.model, spec.trainable):
        stats = compiled_stats(prog["fn"].lower(*prog["args"]).compile())[0]
        roles[prog["role"]] = {**stats, "stacked_bytes": prog["stacked_bytes"]}
        extra = max(extra, stats["peak_bytes"] - prog["stacked_bytes"])
    return {"peak_bytes": int(extra), "roles": roles}
