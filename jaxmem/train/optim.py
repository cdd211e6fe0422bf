"""AdamW with linear warmup + cosine decay, clipping by global norm, and which params decay.

Clipping is the first link of the chain, so it sees the *unscaled* gradients: the train step
unscales before calling the optimizer (as `scaler.unscale_(opt)` before `clip_grad_norm_`).
Skipping a non-finite step happens outside the optimizer (jaxmem.train.step), which keeps every leaf of
the optimizer state, the Adam count and so the schedule position, bitwise as it was.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxmem.config.run import OptimConfig
from jaxmem.model.roles import param_role

__all__ = ["OptimConfig", "decay_mask", "make_optimizer", "schedule"]


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


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """`cfg.optimizer` (adamw, adamw8bit, adafactor, lion) with the schedule, decoupled weight
    decay on `decay_mask`, and clipping first."""
    mu_dtype = {None: None, "fp32": jnp.float32, "float32": jnp.float32,
                "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16}[cfg.mu_dtype]
    mask = lambda p: decay_mask(p, cfg.decay_embeddings)  # noqa: E731
    if cfg.optimizer == "adamw8bit":
        from jaxmem.train.optim8bit import adamw_8bit
        adamw = adamw_8bit(schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay, mask=mask)
    elif cfg.optimizer == "lion":  # one moment; b2 here is Lion's (0.99 in the paper)
        adamw = optax.lion(schedule(cfg), b1=cfg.b1, b2=0.99, mu_dtype=mu_dtype,
                           weight_decay=cfg.weight_decay, mask=mask)
    elif cfg.optimizer == "adafactor":  # factored second moment, no first moment
        adamw = optax.adafactor(schedule(cfg), multiply_by_parameter_scale=False,
                                weight_decay_rate=cfg.weight_decay or None,
                                weight_decay_mask=mask)
    else:
        adamw = optax.adamw(schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, mu_dtype=mu_dtype,
                            weight_decay=cfg.weight_decay, mask=mask)
    if cfg.clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.clip), adamw)
    return adamw
