"""LoRA / QLoRA on jaxmem's decoder: which projections, their adapters, the merged export.

    spec = LoraSpec(rank=8, alpha=16, targets=("q_proj", "v_proj"), quantize="nf4")
    adapters = spec.init_adapters(model_cfg, key)   # the trainable params: adapters only
    full = spec.full_params(base, adapters, dtype)  # base tree with LoraWeight objects in it
    logits = families.model(model_cfg).apply({"params": full}, tokens)

`LoraSpec` is the `Trainable` (jaxmem.peft.trainable) of a LoRA / QLoRA run: `trainable_of`
turns a RunConfig's peft section into it (or `FullFineTune()`); the merged export is
jaxmem.peft.export.merge.

A target projection's stored weight becomes a `jaxmem.lora.LoraWeight(base=W, a=A, b=B)` (the
public class, used as any user would): its `project` returns einsum(x, W) + alpha/r *
(dropout(x) A) B, where W is the plain array or an int8 / NF4 `jaxmem.quant.QuantizedWeight`.
A [in..., R] is initialised as peft does (kaiming uniform with a = sqrt(5):
U(-1/sqrt(In), 1/sqrt(In))), B [R, out...] is zero, so the first step computes exactly the base
model (y + 0). The model is not changed: Flax's scan slices every leaf of the
object over the layer axis like any other param.

Adapters live in a tree shaped like the params: params['layers']['self_attn']['q_proj'] ->
{'lora_a': [L, D, R], 'lora_b': [L, R, N, H]}, so parameter roles (jaxmem.model.roles), weight
decay and the planner treat them by the projection they adapt.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.config.lora import TARGETS, parse_targets
from jaxmem.families.names import PROJECTIONS
from jaxmem.errors import ConfigError
from jaxmem.families.config import ModelConfig
from jaxmem.lora import LoraWeight
from jaxmem.peft import export as _export
from jaxmem.peft import memory as _memory
from jaxmem.peft.base import abstract_base, weight_axes
from jaxmem.peft.trainable import FullFineTune, Trainable


@dataclass(frozen=True)
class LoraSpec(Trainable):
    """What a LoRA / QLoRA run trains and how its frozen base is stored (static, hashable): the
    `Trainable` (jaxmem.peft.trainable) of a run with adapters; QLoRA is `quantize` int8 / nf4.

    rank, alpha: the update is alpha/rank * A B. targets: short names (TARGETS).
    dropout: dropout on the adapters' input. quantize: "none", "int8", "nf4" (all seven block
    projections of the base; never the embedding or LM head). block: values per absmax (0: int8
    per output channel). double_quant: 8-bit absmax in blocks of 256.
    """

    rank: int
    alpha: float = 16.0
    targets: tuple[str, ...] = tuple(TARGETS)
    dropout: float = 0.0
    quantize: str = "none"
    block: int = 64
    double_quant: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    # the Trainable interface (jaxmem.peft.trainable): adapters train, the base is frozen
    def init_params(self, model_cfg, key, dtype, given=None):
        return self.init_adapters(model_cfg, jax.random.fold_in(key, 1))  # fp32 adapters

    def model_params(self, params, frozen, dtype, key=None):
        return self.full_params(frozen, params, dtype, key), None  # cast: adapters only

    def reference_params(self, params, frozen, dtype):
        return frozen, None  # the base alone: the adapters off, no second copy of any weight

    def abstract_frozen(self, model_cfg, dtype):
        return abstract_base(model_cfg, self, dtype)

    def prepare_frozen(self, cfg, model_cfg, step_cfg, record, init_from, shardings):
        # split over the mesh (if any), read shard by shard from an HF checkpoint
        from jaxmem.peft.slices import prepare_base_from_slices
        return prepare_base_from_slices(cfg, model_cfg, step_cfg, record, init_from, shardings)

    def step_args(self, frozen):
        return (frozen,)  # the step's third argument, never donated

    def params_from_checkpoint(self, read):
        return None  # the checkpoint is the frozen base (prepare_frozen reads it)

    def check_in_backward(self, flag: str) -> None:
        raise ConfigError(f"{flag} is for full fine-tunes; drop --lora-rank (LoRA's adapter "
                          f"gradients are small already)")

    def check_model(self, model_cfg) -> None:
        # a quantized base's blocks run along each projection's input (jaxmem.quant): every
        # input size must be a multiple of the block
        if self.quantize == "none" or not self.block:
            return
        for name, (_, shape, n_in) in weight_axes(model_cfg).items():
            size = int(np.prod(shape[:n_in]))
            if size % self.block:
                raise ConfigError(
                    f"--quantize-base {self.quantize}: the {name} projection's input size {size} "
                    f"(weight {shape}) is not a multiple of --quant-block {self.block}; pick a "
                    f"block that divides every projection's input size")

    def run_params(self, run):
        return _export.lora_params(run)

    def merged_params(self, run):
        return _export.merged_params(run)

    def export_adapters(self, run, out, args=None):
        return _export.export_adapters(run, out, args)

    params_name = "LoRA adapters"

    def mlp_tile(self, tile):
        return 0  # a target multiplies through LoraWeight.project: never tiled

    def activations(self, c, B, T, dtype, remat):
        # x A per adapter where the policy keeps the adapters' inputs (none under full remat or
        # a names / offload policy); the backward's dequantized layer and [B, T, Out] buffers
        saved = (_memory.lora_saved_per_layer(c, self, B, T, dtype) if remat.saves_dots
                 else [])
        return saved, (_memory.dequant_transient(c, self, dtype)
                       + _memory.adapter_backward_transient(c, self, B, T, dtype))

    def flags(self) -> dict:
        return {"peft.lora_rank": self.rank, "peft.lora_alpha": self.alpha,
                "peft.lora_targets": ",".join(self.targets), "peft.lora_dropout": self.dropout,
                "peft.quantize_base": self.quantize, "peft.quant_block": self.block,
                "peft.double_quant": self.double_quant}

    def describe(self, adapters) -> str:
        """One line for the run's start: what trains, on what base."""
        n = sum(int(x.size) for x in jax.tree_util.tree_leaves(adapters))
        base = "a frozen base" if self.quantize == "none" else (
            f"a frozen {self.quantize} base" + (" (double quant)" if self.double_quant else ""))
        return f"LoRA r={self.rank} alpha={self.alpha:g} on {','.join(self.targets)}: {n:,} " \
               f"trainable params, {base}"

    def init_adapters(self, c: ModelConfig, key: jax.Array):
        """{'layers': {group: {name: {'lora_a', 'lora_b'}}}} fp32: A ~ U(+-1/sqrt(In)), B = 0."""
        axes, tree = weight_axes(c), {}
        for i, name in enumerate(self.targets):
            _, shape, n_in = axes[name]
            fan_in = int(np.prod(shape[:n_in]))
            bound = fan_in ** -0.5
            a = jax.random.uniform(jax.random.fold_in(key, i), (c.num_layers, *shape[:n_in],
                                   self.rank), jnp.float32, -bound, bound)
            b = jnp.zeros((c.num_layers, self.rank, *shape[n_in:]), jnp.float32)
            group, pname = PROJECTIONS[name]
            tree.setdefault(group, {})[pname] = {"lora_a": a, "lora_b": b}
        return {"layers": tree}

    def full_params(self, base, adapters, dtype=None, key=None):
        """The base params with each target replaced by LoraWeight(base, A, B).

        dtype: cast the adapters to it (the compute dtype; the base is stored in it already).
        key: a PRNG key for dropout (None: no dropout, as in evaluation).
        """
        layers = {g: dict(v) for g, v in base["layers"].items()}
        L = jax.tree_util.tree_leaves(base["layers"])[0].shape[0]
        keys = None
        if key is not None and self.dropout > 0:
            keys = jax.random.key_data(jax.random.split(key, (len(self.targets), L)))
        for i, name in enumerate(self.targets):
            group, pname = PROJECTIONS[name]
            ad = adapters["layers"][group][pname]
            a, b = ad["lora_a"], ad["lora_b"]
            if dtype is not None:
                a, b = a.astype(dtype), b.astype(dtype)
            layers[group][pname] = LoraWeight(
                base=layers[group][pname], a=a, b=b, key=None if keys is None else keys[i],
                scale=self.scale, n_in=2 if name == "o" else 1, dropout=self.dropout)
        return {**base, "layers": layers}


def trainable_of(section) -> Trainable:
    """What a RunConfig's peft section (jaxmem.config.run.PeftSection) trains: its LoraSpec, or
    FullFineTune() for lora_rank 0."""
    if not section.lora_rank:
        return FullFineTune()
    return LoraSpec(section.lora_rank, section.lora_alpha, parse_targets(section.lora_targets),
                    section.lora_dropout, section.quantize_base, section.quant_block,
                    section.double_quant)
