"""The trainer's optimizer (`--optimizer`) and loss scale (`--loss-scale`), built from the run's
config: linear warmup + cosine decay, clipping by global norm, and which of the decoder's params
decay and keep fp32 8-bit-AdamW moments.

    make_optimizer(cfg) -> optax.GradientTransformation   its state is the TrainState's
    build_optimizer(cfg, stochastic_rounding) -> RunOptimizer   the run's one optimizer: `tx`,
        and `apply` (a jaxmem.optim.Optimizer): adamw8bit's AdamW8bitInPlace, updated and
        applied in place; any other: tx's update + apply_updates[_sr] (as_optimizer);
        `split`: the same step part by part (--optimizer-in-backward)
    parse_loss_scale("dynamic" | "static:VALUE" | "none") -> a jaxmem.optim LossScale

Clipping is the first link of the chain, so it sees the *unscaled* gradients: the train step's
loss-scale wrapper unscales before calling the optimizer (as `scaler.unscale_(opt)` before
`clip_grad_norm_`). Skipping a non-finite step happens outside the optimizer
(jaxmem.optim.skip_nonfinite), which keeps every leaf of the optimizer state, the Adam count and
so the schedule position, bitwise as it was.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import jax
import jax.numpy as jnp
import optax

from jaxmem import target
from jaxmem.config.run import OptimConfig
from jaxmem.paths import in_layers, path_text
from jaxmem.model.roles import param_role
from jaxmem.sharding import weight_placement
from jaxmem.optim import (AdamW8bitInPlace, DynamicLossScale, LossScale, NoOpLossScale,
                          Optimizer, Parts, StaticLossScale, as_optimizer, keep_small_fp32,
                          row_chunks, split)

__all__ = ["LossScaleKind", "OptimConfig", "OptimizerName", "adamw8bit_in_place", "decay_mask",
           "keeps_fp32", "layer_axes", "make_optimizer", "parse_loss_scale", "schedule", "RunOptimizer",
           "build_optimizer"]


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
    """True for weights that decay: every matrix except norm scales and biases (and embeddings
    unless asked)."""
    def decays(path, x):
        role = param_role(path)  # jaxmem.model.roles: no parameter names matched here
        if role in ("norm", "bias"):
            return False
        if role == "embedding":
            return decay_embeddings
        return x.ndim >= 2
    return jax.tree_util.tree_map_with_path(decays, params)


def keeps_fp32(path, leaf) -> bool:
    """The trainer's `keep_fp32` rule for adamw_8bit: jaxmem.optim's default (non-float and
    < 4096-element leaves) plus embeddings (Dettmers et al.'s stable embedding finding)."""
    return keep_small_fp32(path, leaf) or param_role(path) == "embedding"


def layer_axes(path, leaf) -> int:
    """The trainer's `layer_axes` rule for adamw_8bit: a scanned block param ([L, ...] under
    "layers") is L tensors, and no 8-bit block spans two of them (as bitsandbytes sees each
    layer's tensor on its own)."""
    return 1 if leaf.ndim > 1 and in_layers(path) else 0


def _placement(path, shape):
    """Where a param leaf lives on the mesh (jaxmem.sharding's installed weight rule)."""
    return weight_placement(path_text(path), shape)


def adamw8bit_in_place(cfg: OptimConfig, stochastic_rounding: bool = False) -> AdamW8bitInPlace:
    """`--optimizer adamw8bit` with the run's schedule, clipping, decay mask and fp32 rule, updated
    in place shard by shard on a mesh; its `tx` is what make_optimizer(cfg) returns for it."""
    return AdamW8bitInPlace(schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                            weight_decay=cfg.weight_decay,
                            mask=lambda p: decay_mask(p, cfg.decay_embeddings),
                            clip_norm=cfg.clip, keep_fp32=keeps_fp32, layer_axes=layer_axes,
                            stochastic_moments=cfg.moment_rounding == "stochastic",
                            stochastic_rounding=stochastic_rounding, placement=_placement,
                            update_kernel=cfg.update_kernel)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """`cfg.optimizer` (adamw, adamw8bit, adafactor, lion) with the schedule, decoupled weight
    decay on `decay_mask`, and clipping first."""
    mu_dtype = {None: None, "fp32": jnp.float32, "float32": jnp.float32,
                "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16}[cfg.mu_dtype]
    name = OptimizerName(cfg.optimizer)
    if name == OptimizerName.ADAMW8BIT:
        return adamw8bit_in_place(cfg).tx
    mask = lambda p: decay_mask(p, cfg.decay_embeddings)  # noqa: E731
    if name == OptimizerName.LION:  # one moment; b2 here is Lion's (0.99 in the paper)
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


@dataclasses.dataclass(frozen=True)
class RunOptimizer:
    """A run's optimizer, built once from its config (`StepConfig.optimizer`); every part of the
    run uses this one object.

    tx: the optax transformation; its state is the TrainState's `opt_state` (`tx.init`).
    apply: the jaxmem.optim.Optimizer the step updates and applies with (in place for adamw8bit;
        else tx's update + apply_updates[_sr]).
    in_place: the AdamW8bitInPlace behind `apply` for adamw8bit, else None.
    stochastic_rounding: bf16 params rounded stochastically after the update (bf16-sr).
    """

    tx: optax.GradientTransformation
    apply: Optimizer
    in_place: AdamW8bitInPlace | None = None
    stochastic_rounding: bool = False

    # fp32 bytes per element the 8-bit update holds while it works on a leaf or a piece: the
    # gradient, the dequantized moments, the update and the new weight; fitted on CPU compiles
    # (docs/memory.md)
    IN_PLACE_BYTES = 20

    def split(self, params, state, key: jax.Array | None = None) -> Parts:
        """The next step part by part (jaxmem.optim.Parts: a leaf, or a layer of a stacked
        leaf), its numbers and random bits those of `apply`: adamw8bit's own pieces, any other
        optimizer through jaxmem.optim.split, which refuses (NotSplittable, naming it) a state
        type that is not element-wise. `key`: the step's rounding key (bf16-sr)."""
        if self.in_place is not None:
            return self.in_place.split(state, params, key=key)
        return split(self.tx, state, params, key=key,
                     stochastic_rounding=self.stochastic_rounding)

    def working_set(self, params, local_bytes) -> int:
        """Bytes the update holds beyond the state and the gradients, for abstract `params`
        (`local_bytes(tree)`: one device's bytes of a tree). optax's update: on XLA:CPU one
        params-sized buffer of updates (fp32 with stochastic rounding, else the params' dtype);
        a GPU's compiler fuses it into the donated params and moments, nothing more (the 1B
        amp-bf16 step at 1x2048, remat full, H100 compiler: 20.35 GiB compiled, 24.72 with a
        buffer counted, 20.12 without). The in-place
        8-bit update: a leaf of more than optim.CHUNK elements in row pieces, one piece's
        working set at a time; the smaller leaves updated whole and live together."""
        if self.in_place is None:
            if target.fuses_elementwise():  # a GPU fuses the update into its donated buffers
                return 0
            if self.stochastic_rounding:
                params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), params)
            return local_bytes(params)
        whole = piece = 0
        for leaf in jax.tree_util.tree_leaves(params):
            n = row_chunks(leaf.shape)
            if n == 1:
                whole += leaf.size
            else:
                piece = max(piece, leaf.size // n)
        fraction = local_bytes(params) / max(1, sum(
            x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(params)))
        return int(self.IN_PLACE_BYTES * (whole + piece) * fraction)


def build_optimizer(cfg: OptimConfig, stochastic_rounding: bool = False) -> RunOptimizer:
    """The run's optimizer for `cfg`. adamw8bit: `adamw8bit_in_place` (one in-place pass per
    leaf); any other: make_optimizer(cfg)'s update + apply, stochastically rounded to bf16 with
    `stochastic_rounding` (from the `key` passed on every step)."""
    if OptimizerName(cfg.optimizer) == OptimizerName.ADAMW8BIT:
        opt = adamw8bit_in_place(cfg, stochastic_rounding)
        return RunOptimizer(opt.tx, Optimizer(opt.init, opt.update_and_apply), opt,
                            stochastic_rounding)
    tx = make_optimizer(cfg)
    return RunOptimizer(tx, as_optimizer(tx, stochastic_rounding=stochastic_rounding), None,
                        stochastic_rounding)


class LossScaleKind(str, enum.Enum):
    """The kinds of loss scale a `--loss-scale` spec names (`static` takes `:VALUE`)."""

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
