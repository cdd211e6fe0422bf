"""The trainer's optimizer (`--optimizer`): linear warmup + cosine decay, clipping by global
norm, and which of jaxmem's Llama params decay and keep fp32 8-bit-AdamW moments.

Clipping is the first link of the chain, so it sees the *unscaled* gradients: the train step's
loss-scale wrapper unscales before calling the optimizer (as `scaler.unscale_(opt)` before
`clip_grad_norm_`). Skipping a non-finite step happens outside the optimizer
(jaxmem.optim.skip_nonfinite), which keeps every leaf of the optimizer state, the Adam count and
so the schedule position, bitwise as it was.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import optax

from jaxmem.config.run import OptimConfig
from jaxmem.model.roles import param_role
from jaxmem.optim import adamw_8bit, keep_small_fp32

__all__ = ["OptimConfig", "OptimizerName", "decay_mask", "keeps_fp32", "make_optimizer",
           "schedule"]


class OptimizerName(str, enum.Enum):
    """`OptimConfig.optimizer`'s choices; `OptimizerName("lion")` accepts the plain string."""

    ADAMW = "adamw"
    ADAMW8BIT = "adamw8bit"
    ADAFACTOR = "adafactor"
    LION = "lion"


def schedule(cfg: OptimConfig) -> optax.Schedule:
    """Linear warmup from 0 to `lr`, then cosine decay to `min_lr` at `total_steps`."""
    warmup = min(cfg.warmup_steps, cfg.total_steps - 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(cfg.total_steps, warmup + 1), end_value=min(cfg.min_lr, cfg.lr))


def decay_mask(params, decay_embeddings: bool = False):
    """True for weights that decay: every matrix except norm scales (and embeddings unless asked)."""
    def decays(path, x):
        role = param_role(path)  # jaxmem.model.roles: no parameter names matched here
        if role == "norm":
            return False
        if role == "embedding":
            return decay_embeddings
        return x.ndim >= 2
    return jax.tree_util.tree_map_with_path(decays, params)


def keeps_fp32(path, leaf) -> bool:
    """The trainer's `keep_fp32` rule for adamw_8bit: jaxmem.optim's default (non-float and
    < 4096-element leaves) plus embeddings (Dettmers et al.'s stable embedding finding)."""
    return keep_small_fp32(path, leaf) or param_role(path) == "embedding"


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """`cfg.optimizer` (adamw, adamw8bit, adafactor, lion) with the schedule, decoupled weight
    decay on `decay_mask`, and clipping first."""
    mu_dtype = {None: None, "fp32": jnp.float32, "float32": jnp.float32,
                "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16}[cfg.mu_dtype]
    mask = lambda p: decay_mask(p, cfg.decay_embeddings)  # noqa: E731
    name = OptimizerName(cfg.optimizer)
    if name == OptimizerName.ADAMW8BIT:
        adamw = adamw_8bit(schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay, mask=mask, keep_fp32=keeps_fp32)
    elif name == OptimizerName.LION:  # one moment; b2 here is Lion's (0.99 in the paper)
        adamw = optax.lion(schedule(cfg), b1=cfg.b1, b2=0.99, mu_dtype=mu_dtype,
                           weight_decay=cfg.weight_decay, mask=mask)
    elif name == OptimizerName.ADAFACTOR:  # factored second moment, no first moment
        adamw = optax.adafactor(schedule(cfg), multiply_by_parameter_scale=False,
                                weight_decay_rate=cfg.weight_decay or None,
                                weight_decay_mask=mask)
    else:
        adamw = optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, mu_dtype=mu_dtype,
                            weight_decay=cfg.weight_decay, mask=mask)
    if cfg.clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.clip), adamw)
    return adamw
