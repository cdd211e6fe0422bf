"""Optimizers that apply their own update: `update_and_apply`, and the wrappers that skip
non-finite steps and scale the loss around one.

    Optimizer(init, update_and_apply)
        init(params) -> state
        update_and_apply(grads, state, params, *, key=None, where=True) -> (new_params, new_state)

An optax GradientTransformation returns updates and leaves applying them to the caller; an
`Optimizer` returns the new params itself, so an implementation may fuse the update into the
application and write the donated params and state in place (jaxmem's trainer does so for 8-bit
AdamW: one loop per large leaf, no update-sized buffer). The contract:

    key     a PRNG key for implementations that draw random bits (stochastic rounding); others
            ignore it. The same key gives the same result.
    where   bool scalar. False: a skipped step: `params` and `state` come back bitwise as given,
            every leaf (integer counts and 8-bit codes included). The one exception is a
            wrapper's record of non-finite gradients (skip_nonfinite's skips_in_a_row,
            loss_scaled's backoff), which counts whatever `where` says: loss_scaled hands its
            inner optimizer where=False on an overflow.
            How is the implementation's choice; `as_optimizer`'s follows the compiler the
            program is built for (`_guard_form`), as each compiler updates in place:
              a GPU (any backend but the CPU): branch-free, the update computed either way and
                each leaf selected (`select_tree`), so the program has no conditional; a
                `lax.cond` whose branches return the whole state is what this avoids: XLA's
                GPU buffer assignment gives the cond's tuples their own copies of params and
                moments (1B amp-bf16 step, H100 compiler: 32.23 GiB with the cond, 20.04 with
                the select, the same as unguarded);
              XLA:CPU: one `lax.cond`, whose branch updates in place (the 1B step's 25.50 GiB,
                the same as unguarded). The select costs it update-sized buffers (31.74 GiB):
                its fusion recomputes the new moments inside both the params' and the
                moments' selects, so the donated moments are copied first.
            Either way an inf or NaN in the update of a skipped step never reaches the result.

Wrappers, each with a state that holds the inner state (as optax.apply_if_finite's):

    skip_nonfinite(opt)            SkipNonFiniteState(inner, applied, skips_in_a_row)
        finite = all_finite(grads); inner runs with where=finite & where
        applied += finite & where
        skips_in_a_row = skips_in_a_row + 1 if not finite else 0 if where else skips_in_a_row
    loss_scaled(opt, loss_scale)   LossScaledState(inner, loss_scale)
        grads = loss_scale.unscale(grads); finite = all_finite(grads)
        inner runs with where=finite & where
        if where or not finite: loss_scale = loss_scale.adjust(finite)

`loss_scaled(skip_nonfinite(as_optimizer(tx)), DynamicLossScale.create())` is what
torch.amp.GradScaler does around `optimizer.step()`: unscale, skip on inf/nan, adjust the scale.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxmem import target
from jaxmem.optim._loss_scale import LossScale, NoOpLossScale, all_finite, select_tree
from jaxmem.optim._stochastic import apply_updates_sr


class Optimizer(NamedTuple):
    """An optimizer that applies its own update (the contract is in the module docstring).

    init: params -> state (a pytree).
    update_and_apply: (grads, state, params, *, key=None, where=True) -> (new params, new
      state); grads and new params have params' structure; `where` False returns both inputs
      bitwise unchanged.
    """

    init: Callable[[Any], Any]
    update_and_apply: Callable[..., tuple[Any, Any]]


def as_optimizer(tx: optax.GradientTransformation, *,
                 stochastic_rounding: bool = False) -> Optimizer:
    """Any optax transformation as an `Optimizer`: `tx.update`, then `optax.apply_updates`, or
    `apply_updates_sr(params, updates, key)` with `stochastic_rounding` (bf16 params without an
    fp32 master: pass `key` on every call). A traced `where` skips the step in the form the
    compiler updates in place (`_guard_form`: a leafwise select for a GPU, a `lax.cond` on the
    CPU; the module docstring gives the figures).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> opt = as_optimizer(optax.sgd(0.5))
      >>> params = {"w": jnp.ones(3)}
      >>> params, state = opt.update_and_apply({"w": jnp.ones(3)}, opt.init(params), params)
      >>> params["w"].tolist()
      [0.5, 0.5, 0.5]
    """

    def update_and_apply(grads, state, params, *, key=None, where=True):
        def apply(_):
            updates, new_state = tx.update(grads, state, params)
            if stochastic_rounding:
                if key is None:
                    raise ValueError("as_optimizer(stochastic_rounding=True) needs a key")
                return apply_updates_sr(params, updates, key), new_state
            return optax.apply_updates(params, updates), new_state

        if where is True:
            return apply(None)
        if _guard_form() == "cond":  # the branch not taken never runs: params, state bitwise
            return jax.lax.cond(where, apply, lambda _: (params, state), None)
        # jnp.where reads only the selected operand's value: a skipped step's inf/nan updates
        # stay out, and where=False gives the inputs bitwise
        return select_tree(where, apply(None), (params, state))

    return Optimizer(tx.init, update_and_apply)


def _guard_form() -> str:
    """How `as_optimizer` skips a step, for the compiler the program is being traced for
    (`jaxmem.target.fuses_elementwise()`: a deviceless `--target` compile takes the GPU's
    form): "cond" on the CPU, "select" (leaf by leaf, no conditional) for any other backend.
    Each is the form whose skip costs that compiler no memory over the unguarded update (measured on
    XLA:CPU and the H100 compiler, not on a TPU; the module docstring has the figures)."""
    return "select" if target.fuses_elementwise() else "cond"


class SkipNonFiniteState(NamedTuple):
    """State of `skip_nonfinite`.

    inner: the wrapped optimizer's state (unchanged by a skipped step).
    applied: int32 scalar, steps applied (finite ones): e.g. a schedule's position.
    skips_in_a_row: int32 scalar, non-finite steps since the last applied one.
    """

    inner: Any
    applied: jax.Array
    skips_in_a_row: jax.Array


def skip_nonfinite(opt: Optimizer) -> Optimizer:
    """`opt`, run only where every gradient is finite; a step with an inf or NaN anywhere in
    `grads` leaves params and the inner state bitwise as they were and counts a skip (a finite
    step with `where` False changes nothing).

    Returns:
      An Optimizer with state `SkipNonFiniteState` (init: counters at 0).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> opt = skip_nonfinite(as_optimizer(optax.sgd(1.0)))
      >>> p = jnp.ones(2)
      >>> p, s = opt.update_and_apply(jnp.array([1.0, jnp.nan]), opt.init(p), p)
      >>> p.tolist(), int(s.applied), int(s.skips_in_a_row)
      ([1.0, 1.0], 0, 1)
    """

    def init(params):
        return SkipNonFiniteState(opt.init(params), jnp.zeros((), jnp.int32),
                                  jnp.zeros((), jnp.int32))

    def update_and_apply(grads, state, params, *, key=None, where=True):
        finite = all_finite(grads)
        apply = finite & where
        params, inner = opt.update_and_apply(grads, state.inner, params, key=key, where=apply)
        # a non-finite step counts as a skip whatever `where` says: loss_scaled hands its inner
        # optimizer where=False on an overflow
        kept = jnp.where(where, 0, state.skips_in_a_row)
        skips = jnp.where(finite, kept, state.skips_in_a_row + 1).astype(jnp.int32)
        return params, SkipNonFiniteState(inner, state.applied + apply.astype(jnp.int32), skips)

    return Optimizer(init, update_and_apply)


class LossScaledState(NamedTuple):
    """State of `loss_scaled`.

    inner: the wrapped optimizer's state.
    loss_scale: the loss scale (NoOpLossScale, StaticLossScale or DynamicLossScale) to multiply
      the next loss by: `state.loss_scale.scale(loss)` in the loss function.
    """

    inner: Any
    loss_scale: LossScale


def loss_scaled(opt: Optimizer, loss_scale: LossScale = NoOpLossScale()) -> Optimizer:
    """`opt` fed with gradients of a scaled loss: unscale them, run `opt` only where all are
    finite (where=finite), and adjust the scale (GradScaler's `unscale_`, `step`, `update`).

    Args:
      opt: the optimizer to wrap (skip_nonfinite(opt) to also count skipped steps).
      loss_scale: the initial scale (`init` puts it in the state), e.g.
        `DynamicLossScale.create()` for torch.amp.GradScaler()'s defaults.

    Returns:
      An Optimizer with state `LossScaledState`; `update_and_apply` takes the gradients of
      `state.loss_scale.scale(loss)`.

    Example (fp16 overflow: skipped, the scale halves):
      >>> import jax.numpy as jnp, optax
      >>> from jaxmem.optim import DynamicLossScale
      >>> opt = loss_scaled(as_optimizer(optax.sgd(1.0)), DynamicLossScale.create())
      >>> p = jnp.ones(2)
      >>> p, s = opt.update_and_apply(jnp.array([jnp.inf, 1.0]), opt.init(p), p)
      >>> p.tolist(), float(s.loss_scale.loss_scale)
      ([1.0, 1.0], 32768.0)
    """

    def init(params):
        return LossScaledState(opt.init(params), loss_scale)

    def update_and_apply(grads, state, params, *, key=None, where=True):
        grads = state.loss_scale.unscale(grads)
        finite = all_finite(grads)
        params, inner = opt.update_and_apply(grads, state.inner, params, key=key,
                                             where=finite & where)
        scale = state.loss_scale.adjust(finite)
        if where is not True:  # an overflow backs the scale off whatever `where` says
            scale = select_tree(where | ~finite, scale, state.loss_scale)
        return params, LossScaledState(inner, scale)

    return Optimizer(init, update_and_apply)
