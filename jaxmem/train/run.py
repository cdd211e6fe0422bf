"""What the train loop, generation and the planner build from a run config: step config, abstract
state, eval function."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem.config.model import ModelConfig
from jaxmem.train.loss import cross_entropy
from jaxmem.train.precision import cast_params
from jaxmem.train.step import StepConfig, create_train_state


def abstract_train_state(cfg: StepConfig, loss_scale, seed: int = 0):
    """The train state's shapes and dtypes (for Orbax restore), allocating nothing."""
    return jax.eval_shape(lambda: create_train_state(cfg, loss_scale, seed))


def make_eval_fn(cfg: StepConfig):
    """jit(params, batch) -> (sum of token losses, tokens), in the mode's compute dtype."""
    model = cfg.build_model()

    @jax.jit
    def eval_fn(params, batch):
        p = cast_params(params, cfg.precision.compute_dtype)
        logits = model.apply({"params": p}, batch["inputs"])
        return cross_entropy(logits, batch["targets"], batch["mask"])

    return eval_fn


def build_step_config(flags: dict):
    """(ModelConfig, StepConfig, loss scale) from a dict of train flags (argparse vars or config.json).

    One place that turns flags into the objects that fix the state's shapes, so a resumed run and
    `jaxmem.generate` rebuild exactly the state the run saved.
    """
    from jaxmem.config.model import model_config_from_args
    from jaxmem.train.loss_scale import parse_loss_scale
    from jaxmem.train.optim import OptimConfig
    from jaxmem.train.precision import get_precision
    from jaxmem.model.remat import RematPolicy

    model_cfg = model_config_from_args(flags)
    precision = get_precision(flags["precision"])
    optim = OptimConfig(lr=flags["lr"], min_lr=flags["min_lr"], warmup_steps=flags["warmup_steps"],
                        total_steps=flags["steps"], weight_decay=flags["weight_decay"],
                        clip=flags["clip"], mu_dtype=flags["mu_dtype"])
    loss_scale = parse_loss_scale(flags["loss_scale"] or precision.loss_scale,
                                  init_scale=flags["loss_scale_init"],
                                  growth_interval=flags["loss_scale_growth_interval"])
    step_cfg = StepConfig(model_cfg, precision, RematPolicy.parse(flags["remat"]), optim,
                          grad_accum=flags["grad_accum"])
    return model_cfg, step_cfg, loss_scale
