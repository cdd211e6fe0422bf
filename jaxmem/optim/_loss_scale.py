"""Loss scaling for fp16 training, with `torch.amp.GradScaler`'s semantics.

Three scales, all pytrees with one interface (as jmp's):

    NoOpLossScale      scale 1, nothing to adjust (fp32, bf16)
    StaticLossScale    a fixed scale
    DynamicLossScale   GradScaler's algorithm, below

    ls.loss_scale            fp32 scalar: the current scale
    ls.scale(tree)           tree * scale       (the loss, before differentiating)
    ls.unscale(tree)         tree / scale, in fp32, cast back to each leaf's dtype (the grads)
    ls.adjust(finite)        the next step's loss scale, given all_finite(unscaled grads)

Use in a step of your own (or let `loss_scaled` in jaxmem.optim do all of it):

    loss, grads = jax.value_and_grad(lambda p: ls.scale(loss_fn(p)))(params)
    grads = ls.unscale(grads)
    finite = all_finite(grads)
    new = optimizer step(grads, ...)
    params, opt_state = select_tree(finite, new, (params, opt_state))   # skip: bitwise unchanged
    ls = ls.adjust(finite)

DynamicLossScale.adjust, once per optimizer step:

    if finite:
        inf_run = 0
        good_steps += 1
        if good_steps == growth_interval:          # torch: the step that completes the interval
            new = scale * growth_factor
            scale = min(new if isfinite(new) else scale, max_scale)
            good_steps = 0
    else:                                          # the step itself is skipped by the caller
        good_steps = 0
        inf_run += 1
        if inf_run >= hysteresis:                  # hysteresis=1 is torch: back off at once
            scale = max(scale * backoff_factor, min_scale)
            inf_run = 0

Defaults are torch's: scale 2**16, growth 2.0 every 2000 finite steps, backoff 0.5. `min_scale`,
`max_scale` and `hysteresis` go beyond torch. The dynamic fields (`loss_scale`, `good_steps`,
`inf_run`) are pytree leaves; the constants are static pytree fields, so every field survives jit,
`tree_map` and a checkpoint round trip (jmp's DynamicLossScale drops `min_loss_scale` in
`tree_flatten`; here the constants are part of the treedef).

References: torch.amp.GradScaler; Micikevicius et al., Mixed Precision Training, ICLR 2018.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Union

import jax
import jax.numpy as jnp
from flax import struct

FP32_MAX = float(jnp.finfo(jnp.float32).max)
FP32_TINY = float(jnp.finfo(jnp.float32).tiny)  # default min_scale: no floor, as in torch


def all_finite(tree) -> jax.Array:
    """A bool scalar: every element of every leaf of `tree` is finite (True for no leaves)."""
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves:
        return jnp.array(True)
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()


def select_tree(pred: jax.Array, on_true, on_false):
    """Leafwise `jnp.where(pred, a, b)` over two trees of the same structure."""
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def _unscale(tree, scale):
    inv = 1.0 / scale
    return jax.tree_util.tree_map(lambda g: (g.astype(jnp.float32) * inv).astype(g.dtype), tree)


@struct.dataclass
class NoOpLossScale:
    """No scaling: scale 1, never adjusts. `NoOpLossScale()`; no leaves."""

    @property
    def loss_scale(self) -> jax.Array:
        return jnp.array(1.0, jnp.float32)

    def scale(self, x):
        return x

    def unscale(self, tree):
        return tree

    def adjust(self, finite: jax.Array) -> "NoOpLossScale":
        del finite
        return self


@struct.dataclass
class StaticLossScale:
    """A fixed scale; `adjust` keeps it. Non-finite steps are still the caller's to skip.

    loss_scale: fp32 scalar, e.g. `StaticLossScale(jnp.float32(1024.0))`.
    """

    loss_scale: jax.Array

    def scale(self, x):
        return jax.tree_util.tree_map(lambda v: v * self.loss_scale.astype(v.dtype), x)

    def unscale(self, tree):
        return _unscale(tree, self.loss_scale)

    def adjust(self, finite: jax.Array) -> "StaticLossScale":
        del finite
        return self


@struct.dataclass
class DynamicLossScale:
    """torch.amp.GradScaler's dynamic loss scale (algorithm in the module docstring).

    loss_scale: current scale (fp32 scalar).
    good_steps: finite steps since the last growth or backoff (torch's `_growth_tracker`).
    inf_run: non-finite steps in a row not yet acted on (always 0 when hysteresis == 1).
    growth_interval, growth_factor, backoff_factor: torch's, same defaults.
    min_scale, max_scale: clamps; the scale never reaches inf or drops below min_scale
        (default: fp32's smallest normal and largest value, i.e. no clamp beyond torch's).
    hysteresis: non-finite steps in a row needed before a backoff.
    """

    loss_scale: jax.Array
    good_steps: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.int32))
    inf_run: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.int32))
    growth_interval: int = struct.field(pytree_node=False, default=2000)
    growth_factor: float = struct.field(pytree_node=False, default=2.0)
    backoff_factor: float = struct.field(pytree_node=False, default=0.5)
    min_scale: float = struct.field(pytree_node=False, default=FP32_TINY)
    max_scale: float = struct.field(pytree_node=False, default=FP32_MAX)
    hysteresis: int = struct.field(pytree_node=False, default=1)

    @classmethod
    def create(cls, init_scale: float = 2.0**16, **kwargs) -> "DynamicLossScale":
        """A fresh scale: `init_scale`, no steps counted; kwargs are the static fields above.
        Raises ValueError naming the first invalid setting.

        >>> ls = DynamicLossScale.create()        # torch.amp.GradScaler()'s defaults
        >>> float(ls.loss_scale), ls.growth_interval, ls.backoff_factor
        (65536.0, 2000, 0.5)
        >>> float(ls.adjust(jnp.array(False)).loss_scale)   # an inf/nan step backs off
        32768.0
        """
        validate_dynamic(init_scale=init_scale, **kwargs)
        return cls(loss_scale=jnp.asarray(init_scale, jnp.float32), **kwargs)

    def scale(self, x):
        return jax.tree_util.tree_map(lambda v: v * self.loss_scale.astype(v.dtype), x)

    def unscale(self, tree):
        return _unscale(tree, self.loss_scale)

    def adjust(self, finite: jax.Array) -> "DynamicLossScale":
        good = self.good_steps + 1
        grow = finite & (good >= self.growth_interval)
        grown = self.loss_scale * self.growth_factor
        grown = jnp.minimum(jnp.where(jnp.isfinite(grown), grown, self.loss_scale), self.max_scale)

        inf_run = jnp.where(finite, 0, self.inf_run + 1)
        backoff = (~finite) & (inf_run >= self.hysteresis)
        shrunk = jnp.maximum(self.loss_scale * self.backoff_factor, self.min_scale)

        scale = jnp.where(grow, grown, jnp.where(backoff, shrunk, self.loss_scale))
        return self.replace(
            loss_scale=scale.astype(jnp.float32),
            good_steps=jnp.where(finite & ~grow, good, 0).astype(jnp.int32),
            inf_run=jnp.where(backoff, 0, inf_run).astype(jnp.int32),
        )


LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]


def validate_dynamic(init_scale=2.0**16, growth_interval=2000, growth_factor=2.0,
                     backoff_factor=0.5, min_scale=FP32_TINY, max_scale=FP32_MAX, hysteresis=1) -> None:
    """Raise ValueError naming the first invalid setting."""
    checks = [
        ("init_scale", init_scale, init_scale > 0 and math.isfinite(init_scale)),
        ("growth_interval", growth_interval, isinstance(growth_interval, int) and growth_interval > 0),
        ("growth_factor", growth_factor, growth_factor >= 1.0),
        ("backoff_factor", backoff_factor, 0.0 < backoff_factor < 1.0),
        ("min_scale", min_scale, 0.0 < min_scale <= max_scale),
        ("max_scale", max_scale, math.isfinite(max_scale)),
        ("hysteresis", hysteresis, isinstance(hysteresis, int) and hysteresis >= 1),
    ]
    for name, value, ok in checks:
        if not ok:
            raise ValueError(f"loss scale {name}={value!r} is invalid")
