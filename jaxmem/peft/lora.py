"""LoRA adapters as weight objects of the projection seam (jaxmem.model.projection).

    spec = LoraSpec(rank=8, alpha=16, targets=("q_proj", "v_proj"), quantize="nf4")
    adapters = spec.init_adapters(model_cfg, key)   # the trainable params: adapters only
    full = spec.full_params(base, adapters, dtype)  # base tree with LoraWeight objects in it
    logits = Llama(model_cfg).apply({"params": full}, tokens)
    merged = merge(base_16bit, adapters, spec, model_cfg)  # W + alpha/r * A B, fp32 numpy

A target projection's stored weight becomes LoraWeight(base, A, B): its `project` returns
einsum(x, W) + alpha/r * (dropout(x) A) B, where W is the plain array or an int8 / NF4
QuantizedWeight (jaxmem.peft.quant). A [in..., R] is initialised as peft does (kaiming uniform
with a = sqrt(5): U(-1/sqrt(In), 1/sqrt(In))), B [R, out...] is zero, so the first step computes
exactly the base model (y + 0). The model is not changed: Flax's scan slices every leaf of the
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

from jaxmem.config.lora import ALL_TARGETS, TARGETS, parse_targets  # noqa: F401 (re-exported)
from jaxmem.config.model import ModelConfig
from jaxmem.einsum import project

RANK = "R"  # the adapter rank's axis letter in einsum strings


def weight_axes(c: ModelConfig) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """name -> (einsum subscripts, per-layer weight shape, number of input axes)."""
    D, N, K, H, F = (c.hidden_size, c.num_heads, c.num_kv_heads, c.resolved_head_dim,
                     c.intermediate_size)
    return {"q": ("BTD,DNH->BTNH", (D, N, H), 1), "k": ("BTD,DKH->BTKH", (D, K, H), 1),
            "v": ("BTD,DKH->BTKH", (D, K, H), 1), "o": ("BTNH,NHD->BTD", (N, H, D), 2),
            "gate": ("BTD,DF->BTF", (D, F), 1), "up": ("BTD,DF->BTF", (D, F), 1),
            "down": ("BTF,FD->BTD", (F, D), 1)}


def _lora_subscripts(subscripts: str) -> tuple[str, str, str]:
    """'BTD,DNH->BTNH' -> ('BTD,DR->BTR', 'BTR,RNH->BTNH', 'DR,RNH->DNH')."""
    lhs, out = subscripts.split("->")
    xs, ws = lhs.split(",")
    ins = "".join(a for a in ws if a in xs)
    outs = "".join(a for a in ws if a not in xs)
    batch = "".join(a for a in xs if a not in ins)
    return (f"{xs},{ins}{RANK}->{batch}{RANK}", f"{batch}{RANK},{RANK}{outs}->{out}",
            f"{ins}{RANK},{RANK}{outs}->{ws}")


@jax.tree_util.register_pytree_node_class
class LoraWeight:
    """W (array or QuantizedWeight) plus a rank-R update scale * A B; see the module docstring.

    key: uint32 key data for dropout on the adapter's input (None: no dropout).
    """

    def __init__(self, base, a, b, key=None, scale: float = 1.0, dropout: float = 0.0):
        self.base, self.a, self.b, self.key = base, a, b, key
        self.scale, self.dropout = scale, dropout

    def tree_flatten(self):
        return (self.base, self.a, self.b, self.key), (self.scale, self.dropout)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        return cls(*leaves, *aux)

    def project(self, subscripts: str, x: jax.Array, einsum) -> jax.Array:
        y = project(subscripts, x, self.base, einsum)
        down, up, _ = _lora_subscripts(subscripts)
        if self.dropout > 0 and self.key is not None:
            keep = jax.random.bernoulli(jax.random.wrap_key_data(self.key), 1 - self.dropout,
                                        x.shape)
            x = jnp.where(keep, x / (1 - self.dropout), 0).astype(x.dtype)
        h = jnp.einsum(down, x, self.a.astype(x.dtype))  # [B, T, R]
        delta = jnp.einsum(up, h, self.b.astype(x.dtype))  # the projection's output shape
        return y + (self.scale * delta).astype(y.dtype)


@dataclass(frozen=True)
class LoraSpec:
    """What a LoRA / QLoRA run trains and how its frozen base is stored (static, hashable).

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
            group, pname = TARGETS[name]
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
            group, pname = TARGETS[name]
            ad = adapters["layers"][group][pname]
            a, b = ad["lora_a"], ad["lora_b"]
            if dtype is not None:
                a, b = a.astype(dtype), b.astype(dtype)
            layers[group][pname] = LoraWeight(layers[group][pname], a, b,
                                              None if keys is None else keys[i],
                                              self.scale, self.dropout)
        return {**base, "layers": layers}


def spec_of(section) -> LoraSpec | None:
    """The LoraSpec of a RunConfig's peft section (jaxmem.config.run.PeftSection), or None for a
    full fine-tune (lora_rank 0)."""
    if not section.lora_rank:
        return None
    return LoraSpec(section.lora_rank, section.lora_alpha, parse_targets(section.lora_targets),
                    section.lora_dropout, section.quantize_base, section.quant_block,
                    section.double_quant)


def merge(base, adapters, spec: LoraSpec, c: ModelConfig):
    """W + alpha/r * A B for each target, computed and returned in fp32 (the exporter's --dtype
    rounds it once, instead of a bf16 W rounding it here and again there).

    `base` must be the original (16- or 32-bit) weights, not the dequantized ones: merging into
    the dequantized weights would bake the 4-bit rounding error into every merged weight.
    Works on numpy or jax arrays; returns numpy arrays for the merged projections.
    """
    axes = weight_axes(c)
    layers = {g: dict(v) for g, v in base["layers"].items()}
    for name in spec.targets:
        group, pname = TARGETS[name]
        w = layers[group][pname]
        if not hasattr(w, "dtype") or not hasattr(w, "shape"):
            raise TypeError(f"merge needs the original dense weights; {group}/{pname} is a "
                            f"{type(w).__name__}")
        ad = adapters["layers"][group][pname]
        _, _, product = _lora_subscripts(axes[name][0])
        delta = np.einsum("L" + product.replace(",", ",L").replace("->", "->L"),
                          np.asarray(ad["lora_a"], np.float32), np.asarray(ad["lora_b"], np.float32))
        layers[group][pname] = np.asarray(w, np.float32) + spec.scale * delta
    return {**base, "layers": layers}
