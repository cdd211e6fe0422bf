"""The trainer's `--loss-scale` spec -> a loss scale (the scales themselves: jaxmem.optim).

    parse_loss_scale("dynamic" | "static:VALUE" | "none") -> DynamicLossScale | StaticLossScale
                                                           | NoOpLossScale
"""

from __future__ import annotations

import enum
import math

import jax.numpy as jnp

from jaxmem.optim._loss_scale import (FP32_MAX, FP32_TINY, DynamicLossScale, LossScale,
                                      NoOpLossScale, StaticLossScale, all_finite, select_tree,
                                      validate_dynamic)

__all__ = ["DynamicLossScale", "FP32_MAX", "FP32_TINY", "LossScale", "LossScaleKind",
           "NoOpLossScale", "StaticLossScale", "all_finite", "parse_loss_scale", "select_tree",
           "validate_dynamic"]


class LossScaleKind(str, enum.Enum):
    """The kinds of loss scale a spec names (`static` takes `:VALUE`)."""

    DYNAMIC = "dynamic"
    STATIC = "static"
    NONE = "none"


def parse_loss_scale(spec: str, init_scale: float = 2.0**16, growth_interval: int = 2000,
                     **kwargs) -> LossScale:
    """`dynamic`, `static:VALUE` or `none` -> a loss-scale state (ValueError naming the flag)."""
    if spec == LossScaleKind.NONE:
        return NoOpLossScale()
    if spec == LossScaleKind.DYNAMIC:
        return DynamicLossScale.create(init_scale, growth_interval=growth_interval, **kwargs)
    head, _, value = spec.partition(":")
    if head == LossScaleKind.STATIC:
        try:
            v = float(value)
        except ValueError:
            v = float("nan")
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"--loss-scale static:VALUE needs a positive finite VALUE, got {value!r}")
        return StaticLossScale(jnp.asarray(v, jnp.float32))
    raise ValueError(f"unknown --loss-scale {spec!r}; valid: dynamic, static:VALUE, none")
