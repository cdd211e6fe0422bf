"""The train state and the one jitted, donated train step.

    train_step(state, batch) -> (state, metrics)

batch: dict of int32 arrays [K, B, T] (K = grad-accumulation micro-batches). Per step:

    for each micro-batch (a scan when K > 1):
        loss_k = sum of token losses / tokens in the whole step   (fp32)
        g += grad(scale(loss_k)) w.r.t. the stored params        (params cast to the compute
                                                                    dtype inside the loss)
    grad_norm = |unscale(g)|
    params, (opt_state, applied, skips_in_a_row, loss_scale) =
        loss_scaled(skip_nonfinite(optimizer)).update_and_apply(g, ...)   (jaxmem.optim)
            g = unscale(g); finite = all_finite(g)
            if finite: clip, optimizer update and apply   (cfg.optimizer.apply:             
                                                           in place for adamw8bit; bf16-sr:
                                                           stochastic rounding with step_key)
            else:      params and every optimizer leaf stay bitwise as they were
            loss_scale = loss_scale.adjust(finite)        (once per optimizer step)

Dividing every micro-batch by the token count of the whole step makes K micro-batches of B give
the same gradient as one batch of K*B.

With `cfg.optim.in_backward` (--optimizer-in-backward) the step is jaxmem.train.inbackward's
instead: the same state, batch and metrics, each layer updated inside the backward pass.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxmem.families.config import ModelConfig
from jaxmem.bits import key_data, tree_norm, wrap_key_data
from jaxmem import families
from jaxmem.model.fp8_compile import compiler_options as fp8_compiler_options
from jaxmem.einsum import default_einsum
from jaxmem.sharding import constrain_grads
from jaxmem.optim import (LossScale, LossScaledState, NoOpLossScale, Optimizer,
                          SkipNonFiniteState, loss_scaled, skip_nonfinite)
from jaxmem.objective import CausalLM, Objective
from jaxmem.objective.base import precomputed_reference, row_logps
from jaxmem.train.inbackward import make_train_step_in_backward
from jaxmem.train.optim import OptimConfig, RunOptimizer, build_optimizer, schedule
from jaxmem.model.precision import Precision, cast_floating
from jaxmem.model.remat import RematPolicy
from jaxmem.peft.trainable import FullFineTune, Trainable


@struct.dataclass
class TrainState:
    """Everything a run needs to continue exactly; all leaves are arrays.

    step: train steps taken, skipped ones included (int32).
    applied: optimizer updates applied, i.e. the schedule position (int32).
    skips_in_a_row: non-finite steps since the last applied one (int32).
    data_position: batches consumed from the data stream (int32).
    rng: raw key data (uint32) for stochastic layers and sampling.
    """

    step: jax.Array
    applied: jax.Array
    skips_in_a_row: jax.Array
    data_position: jax.Array
    rng: jax.Array
    params: Any
    opt_state: Any
    loss_scale: LossScale


@dataclass(frozen=True)
class StepConfig:
    """What the train step is built from (all static)."""

    model: ModelConfig
    precision: Precision
    remat: RematPolicy = RematPolicy()
    optim: OptimConfig = OptimConfig()
    grad_accum: int = 1
    # Right padding only (what jaxmem.data produces): the causal mask already hides padded keys
    # from every real query, so attention runs causal-only (cuDNN flash attention on GPU) and
    # padding is removed by the loss mask alone. Set True for left-padded batches.
    attention_padding: bool = False
    # What trains (jaxmem.peft.trainable): every weight, or LoRA / QLoRA adapters (a
    # LoraSpec: the state's params are the adapters and the step takes the frozen base third).
    trainable: Trainable = FullFineTune()
    # The LM head fused into the loss in sequence chunks (jaxmem.loss.chunked): None picks
    # (resolve_loss_chunk), 0 keeps the [B, T, V] logits, N > 0 uses chunks of N positions.
    loss_chunk: int | None = None
    # What the step minimises (jaxmem.objective): next-token cross-entropy, or a preference
    # objective (DPO / ORPO / SimPO) on pairs of rows. The step, the evaluation and the
    # in-backward step call it; none of them names a loss.
    objective: Objective = CausalLM()

    @functools.cached_property
    def optimizer(self) -> RunOptimizer:
        """The run's optimizer, built once per StepConfig: the state's init, the step and the
        layer-by-layer update all use this object (jaxmem.train.optim.build_optimizer)."""
        return build_optimizer(self.optim, self.precision.stochastic_rounding)

    def build_model(self, remat: RematPolicy | None = None):
        """The train step's model (`remat`: another policy, e.g. EVAL_REMAT)."""
        einsum = default_einsum
        if self.precision.fp8:
            from jaxmem.model.fp8 import fp8_einsum
            einsum = fp8_einsum
        return families.model(self.model, self.remat if remat is None else remat, einsum)


# The evaluation's model (jaxmem.train.run.make_eval_fn) differentiates nothing, so it is built
# under `full` remat whatever the step's --remat: in a forward pass remat keeps and recomputes
# nothing (the same values), and under it the MLP runs in sequence tiles
# (jaxmem.model.tiled.tiles_under) wherever a tile is shorter than T, so the eval never holds a
# [B, T, F] activation. The planner's analytic eval phase asks the same policy.
EVAL_REMAT = RematPolicy("full")


def state_creation_fn(cfg: StepConfig, loss_scale: LossScale | None = None, seed: int = 0,
                      with_params: bool = False):
    """The function `jax.jit` compiles to make a fresh train state: `() -> TrainState`, or
    `(params) -> TrainState` with `with_params` (step-0 weights given, e.g. from --init-from).

    The trainer (`create_train_state`, jaxmem.train.placement) and the planner compile this
    same function, so the planned and the run's state creation are one program:

        fn = state_creation_fn(cfg, loss_scale, seed)
        jax.jit(fn).lower().compile().memory_analysis()   # llama-3-8b bf16-sr + adamw8bit, CPU:
                                                          # 33.09 GiB out, 0.58 GiB temp

    Each param is initialised straight into its storage dtype (jaxmem.model.typed_init: no fp32
    copy of a bf16 model) and the optimizer state is made from shapes and dtypes only (fp32 for
    bf16-sr's moments), never from a full-precision copy of the params.
    """
    precision = cfg.precision

    def create(params=None) -> TrainState:
        key = jax.random.PRNGKey(seed)
        init_key, state_key = jax.random.split(key)
        params = cfg.trainable.init_params(cfg.model, init_key, precision.param_dtype, params)
        params = cast_floating(params, precision.param_dtype)
        # The optimizer's init reads shapes and dtypes only: give it zeros of those (dead code
        # to XLA), fp32 for bf16-sr, whose moments are fp32 (no master copy of the params).
        like_dtype = jnp.float32 if precision.stochastic_rounding else None
        opt_like = jax.tree.map(lambda p: jnp.zeros(p.shape, like_dtype if like_dtype and
                                                    jnp.issubdtype(p.dtype, jnp.floating)
                                                    else p.dtype), params)

        def zero():  # separate buffers: the state is donated, one buffer cannot be donated twice
            return jnp.zeros((), jnp.int32)

        return TrainState(step=zero(), applied=zero(), skips_in_a_row=zero(),
                          data_position=zero(),
                          rng=key_data(state_key),
                          params=params, opt_state=cfg.optimizer.tx.init(opt_like),
                          loss_scale=loss_scale if loss_scale is not None else NoOpLossScale())

    return create if with_params else (lambda: create())


def create_train_state(cfg: StepConfig, loss_scale: LossScale | None = None,
                       seed: int = 0, params=None) -> TrainState:
    """A fresh state on the default device: `state_creation_fn` under `jax.jit`, so XLA plans
    its memory (peak = the state + at most one layer's fp32 temporaries), instead of op by op.

    params: step-0 weights to start from (e.g. a Hugging Face checkpoint's), host arrays
    ideally already in the storage dtype: each is put on the device as it is and donated to the
    jit, so no device copy in another dtype is made. Device arrays given are not donated.
    """
    if params is None:
        return jax.jit(state_creation_fn(cfg, loss_scale, seed))()
    leaves = jax.tree_util.tree_leaves(params)
    donate = not any(isinstance(x, jax.Array) for x in leaves)
    placed = jax.device_put(params) if donate else params
    fn = state_creation_fn(cfg, loss_scale, seed, with_params=True)
    return jax.jit(fn, donate_argnums=(0,) if donate else ())(placed)


SR_STREAM = 0x5352  # "SR": keeps the rounding bits apart from other users of fold_in(rng, step)


def step_key(rng: jax.Array, step: jax.Array) -> jax.Array:
    """The stochastic-rounding key of one step: the state's raw key data folded with the step
    number, then with SR_STREAM (LoRA dropout draws from fold_in(rng, step) itself). From the
    state, so a resumed run draws the same bits and stays bitwise equal to an uninterrupted one."""
    return jax.random.fold_in(jax.random.fold_in(wrap_key_data(rng), step), SR_STREAM)


def reference_sums(cfg: StepConfig, model, params, frozen, mb):
    """The reference's per-row log-prob sums [rows] of one micro-batch, or None where the
    objective needs none: the batch's precomputed `ref_logps` (summed over T: jaxmem.train.
    reference), else the frozen base with the adapters off (LoRA / QLoRA: the trainable's
    `reference_params`), run forward only, outside the gradient."""
    if not cfg.objective.reference:
        return None
    if "ref_logps" in mb:
        return precomputed_reference(mb)
    ref_params, dtype = cfg.trainable.reference_params(params, frozen, cfg.precision.compute_dtype)
    return jax.lax.stop_gradient(row_logps(model, ref_params, mb, cfg.attention_padding, dtype,
                                           cfg.loss_chunk))


def _scaled_gradients(cfg: StepConfig, model, state: TrainState, batch, frozen, counts):
    """(the loss-scaled gradients of the step's objective, summed over the `cfg.grad_accum`
    micro-batches of `batch` (a scan), on a mesh split like the params; the unscaled loss and
    the objective's metrics). `counts`: the objective's normalisers over the whole step, so
    the micro-batches' losses add up to the step's. The params are cast to the compute dtype
    inside grad: fp32 gradients for fp32 masters."""
    compute_dtype = cfg.precision.compute_dtype
    objective = cfg.objective

    def micro_loss(params, mb):
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)  # dropout
        ref = reference_sums(cfg, model, params, frozen, mb)
        params, dtype = cfg.trainable.model_params(params, frozen, compute_dtype, key)
        sums = objective.sums(model, params, mb, cfg.attention_padding, dtype, cfg.loss_chunk,
                              ref)
        loss, metrics = objective.value(sums, counts)
        return state.loss_scale.scale(loss), (loss, metrics)

    grad_fn = jax.grad(micro_loss, has_aux=True)

    def sharded_grad(params, mb):  # on a mesh: gradients split like the params
        g, aux = grad_fn(params, mb)
        return constrain_grads(g), aux

    def accumulate(carry, mb):
        g_sum, aux_sum = carry
        g, aux = sharded_grad(state.params, mb)
        return (jax.tree_util.tree_map(jnp.add, g_sum, g),
                jax.tree_util.tree_map(jnp.add, aux_sum, aux)), None

    if cfg.grad_accum == 1:
        grads, (loss, metrics) = sharded_grad(state.params,
                                              jax.tree_util.tree_map(lambda x: x[0], batch))
        return grads, loss, metrics
    zeros = constrain_grads(jax.tree_util.tree_map(jnp.zeros_like, state.params))
    aux0 = jax.eval_shape(lambda: sharded_grad(state.params,
                                               jax.tree_util.tree_map(lambda x: x[0], batch))[1])
    aux0 = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), aux0)
    (grads, (loss, metrics)), _ = jax.lax.scan(accumulate, (zeros, aux0), batch)
    return grads, loss, metrics


def make_train_step(cfg: StepConfig, optimizer: Optimizer | None = None):
    """The pure train step for `cfg` (un-jitted; see `jit_train_step`).

    optimizer: what updates and applies (the jaxmem.optim.Optimizer contract), its state the
    TrainState's `opt_state`; None: the run's `cfg.optimizer.apply`, whose state is the one
    `state_creation_fn` makes. The step wraps it in skip_nonfinite and loss_scaled.
    """
    if cfg.optim.in_backward:  # --optimizer-in-backward: the gradient tree never whole
        if optimizer is not None:
            raise ValueError("optimizer_in_backward applies the run's own optimizer "
                             "(RunOptimizer.split); it takes no `optimizer`")
        return make_train_step_in_backward(cfg, step_key)
    model = cfg.build_model()
    if optimizer is None:
        optimizer = cfg.optimizer.apply
    update = loss_scaled(skip_nonfinite(optimizer)).update_and_apply
    lr_at = schedule(cfg.optim)

    def train_step(state: TrainState, batch, frozen=None):
        counts = cfg.objective.counts(batch)
        total_tokens = jnp.maximum(jnp.sum(batch["mask"]).astype(jnp.float32), 1.0)
        grads, loss, objective_metrics = _scaled_gradients(cfg, model, state, batch, frozen,
                                                           counts)
        # the wrapper unscales the same way; XLA computes the unscaled gradients once
        grad_norm = tree_norm(state.loss_scale.unscale(grads))
        wrapped = LossScaledState(
            SkipNonFiniteState(state.opt_state, state.applied, state.skips_in_a_row),
            state.loss_scale)
        params, wrapped = update(grads, wrapped, state.params,
                                 key=step_key(state.rng, state.step))
        new_state = state.replace(
            step=state.step + 1,
            applied=wrapped.inner.applied,
            skips_in_a_row=wrapped.inner.skips_in_a_row,
            data_position=state.data_position + cfg.grad_accum,
            params=params, opt_state=wrapped.inner.inner,
            loss_scale=wrapped.loss_scale)
        metrics = {"loss": loss, "grad_norm": grad_norm, "loss_scale": state.loss_scale.loss_scale,
                   "skipped": new_state.skips_in_a_row > 0, "lr": lr_at(state.applied),
                   "tokens": total_tokens, "skips_in_a_row": new_state.skips_in_a_row,
                   **objective_metrics}
        return new_state, metrics

    return train_step


def jit_train_step(cfg: StepConfig, state_shardings=None):
    """`make_train_step` under jit with the state donated (updated in place); an fp8 step for a
    GPU compiles with the options that make its projections fp8 GEMMs
    (`jaxmem.model.fp8_compile.compiler_options`). state_shardings: the state's, in and out
    (--offload-optimizer / --offload-params host: their arrays stay in pinned host memory;
    a LoRA base, the third argument, keeps its own)."""
    given = {} if state_shardings is None else dict(
        in_shardings=(state_shardings, None) + cfg.trainable.step_args(None),
        out_shardings=(state_shardings, None))
    return jax.jit(make_train_step(cfg), donate_argnums=0,
                   compiler_options=fp8_compiler_options(cfg.precision), **given)
