"""What the train loop, generation and the planner build from a RunConfig: the step config, the
loss scale, the abstract state, the eval function. `build_step_config` is the one place a
`StepConfig` is made from a run's configuration, so a resumed run, `jaxmem.generate` and the
planner rebuild exactly the state the run saved."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem.errors import ConfigError
from jaxmem.families.config import ModelConfig
from jaxmem.config.run import OptimConfig, PrecisionSection, RunConfig
from jaxmem.model.remat import RematPolicy
from jaxmem.optim import LossScale
from jaxmem.train.inbackward import check as check_in_backward
from jaxmem.train.loss import abstract_batch
from jaxmem.objective import CausalLM, Objective, objective_of
from jaxmem.train.optim import parse_loss_scale
from jaxmem.model.precision import Precision, get_precision
from jaxmem.peft.lora import trainable_of
from jaxmem.peft.trainable import FullFineTune, Trainable
from jaxmem.train.step import (EVAL_REMAT, StepConfig, jit_train_step, reference_sums,
                               state_creation_fn)


def build_step_config(cfg: RunConfig) -> tuple[ModelConfig, StepConfig, LossScale]:
    """(ModelConfig, StepConfig, initial loss scale) of `cfg`, validated (`make_step_config`).

    Raises ConfigError (or RematError / PrecisionError, both ValueErrors) naming the flag.
    """
    model_cfg, p = cfg.model_config(), cfg.precision
    cfg.objective.resolved_reference(bool(cfg.peft.lora_rank))  # a ConfigError where none fits
    step_cfg, loss_scale = make_step_config(
        model_cfg, get_precision(p.mode), RematPolicy.parse(cfg.remat.policy), cfg.optim,
        cfg.data.seq_len, grad_accum=cfg.data.grad_accum, trainable=trainable_of(cfg.peft),
        loss_chunk=cfg.remat.loss_chunk, loss_scale=p, objective=objective_of(cfg.objective))
    return model_cfg, step_cfg, loss_scale


def preference_options(cfg: RunConfig, step_cfg: StepConfig) -> dict:
    """load_corpus's options for a preference objective's rows (jaxmem.data.preference): the
    tokenization style and --max-prompt-length; {} for causal LM (the trainer's and the eval
    command's data alike)."""
    style = step_cfg.objective.preference
    return {} if style is None else {"preference": style,
                                     "max_prompt_length": cfg.objective.max_prompt_length}


def step_tokens(cfg: RunConfig, step_cfg: StepConfig) -> int:
    """Tokens a step trains on: micro-batches of `--batch-size` examples (a preference pair is
    two sequences) x `--seq-len`, `--grad-accum` of them."""
    d = cfg.data
    return d.batch_size * step_cfg.objective.rows_per_example * d.seq_len * d.grad_accum


def make_step_config(model_cfg: ModelConfig, precision: Precision, remat: RematPolicy,
                     optim: OptimConfig, seq_len: int, grad_accum: int = 1,
                     trainable: Trainable = FullFineTune(), loss_chunk: int | None = None,
                     loss_scale: PrecisionSection = PrecisionSection(),
                     objective: Objective = CausalLM()) -> tuple[StepConfig, LossScale]:
    """(StepConfig, initial loss scale) from the parts a step is made of, validated: the one
    place a StepConfig is made, for a run (`build_step_config`) and for the planner's StepSpec
    alike. `loss_scale`: the precision section's `--loss-scale` spec, initial scale and growth
    interval (its defaults: the precision mode's own scale)."""
    if remat.kind == "offload":
        remat.jax_policy()  # a clear error where the backend cannot offload
    trainable.check_model(model_cfg)
    if seq_len > model_cfg.max_position_embeddings:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's "
                          f"max_position_embeddings {model_cfg.max_position_embeddings}")
    p = loss_scale
    scale = parse_loss_scale(p.loss_scale or precision.loss_scale, init_scale=p.loss_scale_init,
                             growth_interval=p.loss_scale_growth_interval)
    step_cfg = StepConfig(model_cfg, precision, remat, optim, grad_accum=grad_accum,
                          trainable=trainable, loss_chunk=loss_chunk, objective=objective)
    if optim.in_backward:
        check_in_backward(step_cfg, scale)
    return step_cfg, scale


def abstract_train_state(cfg: StepConfig, loss_scale, seed: int = 0):
    """The train state's shapes and dtypes (for Orbax restore), allocating nothing: the shapes
    of the program that creates it (`state_creation_fn`)."""
    return jax.eval_shape(state_creation_fn(cfg, loss_scale, seed))


def abstract_step_args(step_cfg: StepConfig, loss_scale, batch_size: int, seq_len: int,
                       grad_accum: int = 1, seed: int = 0, packed: bool = False) -> tuple:
    """(state, batch [K, B, T], frozen base or None) as ShapeDtypeStructs: the train step's
    arguments, nothing allocated (packed: the batch has segment_ids and positions)."""
    batch = {k: jax.ShapeDtypeStruct((grad_accum,) + v.shape, v.dtype)
             for k, v in objective_batch(step_cfg, batch_size, seq_len, packed).items()}
    frozen = step_cfg.trainable.abstract_frozen(step_cfg.model, step_cfg.precision.compute_dtype)
    return abstract_train_state(step_cfg, loss_scale, seed), batch, frozen


def objective_batch(step_cfg: StepConfig, batch_size: int, seq_len: int, packed: bool = False):
    """One micro-batch's shapes for the step's objective: `batch_size` examples of
    `rows_per_example` rows each (a preference pair: 2), its extra fields (ORPO's `real`), and
    a full fine-tune's precomputed reference log-probs (`ref_logps`, fp32)."""
    obj = step_cfg.objective
    rows = batch_size * obj.rows_per_example
    batch = abstract_batch(rows, seq_len, packed)
    s = jax.ShapeDtypeStruct((rows, seq_len), jnp.int32)
    batch.update({k: s for k in obj.batch_keys if k not in batch})
    if obj.reference and step_cfg.trainable.abstract_frozen(step_cfg.model, None) is None:
        batch["ref_logps"] = jax.ShapeDtypeStruct((rows, seq_len), jnp.float32)
    return batch


def compile_run_step(step_cfg: StepConfig, loss_scale, batch_size: int, seq_len: int,
                     grad_accum: int = 1, seed: int = 0, packed: bool = False):
    """The train step compiled ahead of time on abstract shapes (one device, nothing allocated):
    `compile_run_step(...).memory_analysis()` is what the step needs. The planner's compiled
    figures (jaxmem.memory.compiled.compile_step) and the out-of-memory help of `jaxmem.train`
    (jaxmem.train.failures) both come from here."""
    args = abstract_step_args(step_cfg, loss_scale, batch_size, seq_len, grad_accum, seed, packed)
    return jit_train_step(step_cfg).lower(*args).compile()


def make_eval_fn(cfg: StepConfig):
    """jit(params, batch[, frozen base]) -> (the objective's sums, its counts): dicts of fp32
    scalars, which `jaxmem.train.evaluate.evaluate` adds over the batches (causal LM: the sum
    of token losses and the tokens).

    The loss is the train step's own call, `cfg.objective.sums(model, params, batch,
    cfg.attention_padding, compute_dtype, cfg.loss_chunk)`: the LM head fused into the loss
    (jaxmem.loss.chunked) with the run's `--loss-chunk`, so evaluation never holds the
    [B, T, V] fp32 logits (llama-3.2-1b at 8 x 2048: 8.4 GB) and its peak stays under the
    step's (tests/test_phases.py); the whole batch dict goes in, as in the step, so whatever
    the loss reads from it (packed batches' segment ids and positions) reaches the model.
    The model is built under EVAL_REMAT (jaxmem.train.step): the MLP in sequence tiles
    whatever the step's --remat, since nothing is differentiated here.
    """
    model = cfg.build_model(EVAL_REMAT)
    compute_dtype = cfg.precision.compute_dtype

    objective = cfg.objective

    @jax.jit
    def eval_fn(params, batch, frozen=None):
        ref = reference_sums(cfg, model, params, frozen, batch)
        params, dtype = cfg.trainable.model_params(params, frozen, compute_dtype)  # no dropout
        return (objective.sums(model, params, batch, cfg.attention_padding, dtype,
                               cfg.loss_chunk, ref), objective.counts(batch))

    return eval_fn
