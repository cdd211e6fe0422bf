"""LoRA on any model's weights, over a dense or NF4 / int8 base (public API: docs/api.md).

    params = jaxmem.quant.quantize(params, "nf4")                 # optional: a 4-bit base
    params = jaxmem.lora.wrap(params, rank=8, key=key)            # kernels -> LoraWeight
    adapters, frozen = jaxmem.lora.split(params)                  # train `adapters` only
    loss = lambda adapters: ...model.apply({"params": jaxmem.lora.combine(adapters, frozen)}...)

A `LoraWeight` stands for W + scale * A B (W [in..., out...], A [in..., R], B [R, out...]) and
multiplies through `project(subscripts, x, einsum)` = einsum(x, W) + scale * (x A) B, never
forming the dense product; a quantized W is dequantized in the forward and again in the backward
(jaxmem.quant). jaxmem's own trainer puts the same object in its decoder's params (jaxmem.peft).

Flax layers multiply a kernel with `lax.dot_general`, which needs an array, so a layer whose
kernel is a weight object needs one line of adaptation:
  - Linen `nn.Dense` / `nn.DenseGeneral`: apply the model inside `with jaxmem.lora.linen():`
    (a Flax method interceptor: those layers call `project` when their kernel is a weight
    object; other layers, and array kernels, run unchanged). No change to the model's code.
  - NNX `nnx.Linear`: construct it with `promote_dtype=jaxmem.lora.promote_dtype,
    dot_general=jaxmem.lora.dot_general`, then `layer.kernel.set_value(lora_weight)`.
  - Your own code: `jaxmem.lora.dense(x, w)` in place of `x @ w`.

References: Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"
(arXiv:2106.09685); gemma `gm.nn.LoRADense` (swappable initialisers); peft `LoraConfig`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.einsum import project
from jaxmem.quant import QuantizedWeight, is_kernel, path_text

__all__ = ["LoraWeight", "adapter_subscripts", "combine", "dense", "dot_general", "linen",
           "promote_dtype", "split", "wrap"]

Initializer = Callable[[jax.Array, tuple, Any], jax.Array]  # init(key, shape, dtype) -> array
# peft's default for A (kaiming uniform, a = sqrt(5)): U(-1/sqrt(In), 1/sqrt(In)) on A [In, R]
peft_a_init = jax.nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform")


RANK = "R"  # the adapter rank's axis letter in einsum strings


def adapter_subscripts(subscripts: str) -> tuple[str, str, str]:
    """A weight's einsum -> (x A, (x A) B, A B) einsums, with R the rank's axis letter:
    'BTD,DNH->BTNH' -> ('BTD,DR->BTR', 'BTR,RNH->BTNH', 'DR,RNH->DNH')."""
    lhs, out = subscripts.split("->")
    xs, ws = lhs.split(",")
    ins = "".join(a for a in ws if a in xs)
    outs = "".join(a for a in ws if a not in xs)
    batch = "".join(a for a in xs if a not in ins)
    return (f"{xs},{ins}{RANK}->{batch}{RANK}", f"{batch}{RANK},{RANK}{outs}->{out}",
            f"{ins}{RANK},{RANK}{outs}->{ws}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraWeight:
    """W + scale * A B as a pytree; `base`, `a`, `b`, `key` are its children, the rest static.

    base: the frozen W [in..., out...]: an array or a `QuantizedWeight` (None in the trainable
        half of `split`). a: [in..., R], b: [R, out...] (None in the frozen half).
    key: uint32 key data (`jax.random.key_data`) for dropout on the adapter's input; None (the
        default): no dropout.
    scale: alpha / rank. n_in: how many leading axes of W are input axes.
    dropout: the probability of zeroing an input value of the adapter (used with `key`).
    """

    base: Any
    a: Any
    b: Any
    key: Any = None
    scale: float = 1.0
    n_in: int = 1
    dropout: float = 0.0

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense weight's shape [in..., out...]."""
        return tuple(self.base.shape)

    def project(self, subscripts: str, x: jax.Array, einsum) -> jax.Array:
        """einsum(subscripts, x, W + scale * A B), computed as
        einsum(x, W) + scale * (dropout(x) A) B, never forming A B."""
        y = project(subscripts, x, self.base, einsum)
        down, up, _ = adapter_subscripts(subscripts)
        if self.dropout > 0 and self.key is not None:
            keep = jax.random.bernoulli(jax.random.wrap_key_data(self.key), 1 - self.dropout,
                                        x.shape)
            x = jnp.where(keep, x / (1 - self.dropout), 0).astype(x.dtype)
        h = jnp.einsum(down, x, self.a.astype(x.dtype))  # [..., R]
        delta = jnp.einsum(up, h, self.b.astype(x.dtype))  # the projection's output shape
        return y + (self.scale * delta).astype(y.dtype)

    def merged(self, dtype=jnp.float32) -> jax.Array:
        """The dense W + scale * A B [in..., out...] in `dtype` (computed in fp32)."""
        w = self.base.dequantize(jnp.float32) if isinstance(self.base, QuantizedWeight) \
            else jnp.asarray(self.base, jnp.float32)
        r = self.a.shape[-1]
        a = self.a.astype(jnp.float32).reshape(-1, r)  # [In, R]
        b = self.b.astype(jnp.float32).reshape(r, -1)  # [R, Out]
        return (w + self.scale * (a @ b).reshape(w.shape)).astype(dtype)

    def __getitem__(self, index):
        # nnx.Linear reads its kernel as `self.kernel[...]`: the whole weight is the object
        if index is Ellipsis:
            return self
        raise TypeError(f"LoraWeight supports only [...], got [{index!r}]")


jax.tree_util.register_dataclass(LoraWeight, data_fields=["base", "a", "b", "key"],
                                 meta_fields=["scale", "n_in", "dropout"])


def _is_lora(x) -> bool:
    return isinstance(x, LoraWeight)


def wrap(tree: Any, *, rank: int, key: jax.Array, alpha: float | None = None,
         where: Callable[[str, Any], bool] | None = None, a_init: Initializer = peft_a_init,
         b_init: Initializer = jax.nn.initializers.zeros, dtype=jnp.float32,
         n_in: int | Callable[[str, Any], int] = 1) -> Any:
    """`tree` with each selected weight W (array or `QuantizedWeight`) replaced by
    LoraWeight(base=W, a=A, b=B).

    Args:
      tree: a pytree of weights (e.g. Flax params, possibly from `jaxmem.quant.quantize`).
      rank: R, the adapters' rank (> 0).
      key: a PRNG key; the i-th selected weight (in tree order) uses fold_in(key, i).
      alpha: the update is alpha / rank * A B; None: scale 1.
      where: `where(path, leaf) -> bool`, path like "Dense_0/kernel"; None: every
        `QuantizedWeight` and every floating array of >= 2 axes named `kernel`.
      a_init, b_init: `init(key, shape, dtype)` for A [In, R] and B [R, Out] (reshaped to
        [in..., R] / [R, out...]); defaults as peft: A ~ U(-1/sqrt(In), 1/sqrt(In)), B = 0, so
        the wrapped model computes exactly the base model until B moves.
      dtype: the adapters' dtype.
      n_in: input axes of an array weight, an int or `n_in(path, leaf) -> int` (a
        `QuantizedWeight` knows its own): 1 for `Dense`, len(axis) for `DenseGeneral`.

    Returns:
      The tree with `LoraWeight` objects in place of the selected weights.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem
      >>> params = {"Dense_0": {"kernel": jnp.ones((16, 4)), "bias": jnp.zeros(4)}}
      >>> w = jaxmem.lora.wrap(params, rank=2, key=jax.random.key(0))["Dense_0"]["kernel"]
      >>> w.a.shape, w.b.shape, float(jnp.abs(w.merged() - 1).max())
      ((16, 2), (2, 4), 0.0)
    """
    if rank <= 0:
        raise ValueError(f"wrap: rank must be positive, got {rank}")
    scale = 1.0 if alpha is None else alpha / rank
    count = iter(range(1 << 30))

    def select(p, leaf):
        if where is not None:
            return where(p, leaf)
        return isinstance(leaf, QuantizedWeight) or is_kernel(p, leaf)

    def one(path, leaf):
        p = path_text(path)
        if _is_lora(leaf) or not select(p, leaf):
            return leaf
        axes_in = leaf.n_in if isinstance(leaf, QuantizedWeight) else (
            n_in(p, leaf) if callable(n_in) else n_in)
        shape = tuple(leaf.shape)
        size_in, size_out = int(np.prod(shape[:axes_in])), int(np.prod(shape[axes_in:]))
        ka, kb = jax.random.split(jax.random.fold_in(key, next(count)))
        a = a_init(ka, (size_in, rank), dtype).reshape(*shape[:axes_in], rank)
        b = b_init(kb, (rank, size_out), dtype).reshape(rank, *shape[axes_in:])
        return LoraWeight(base=leaf, a=a, b=b, scale=scale, n_in=axes_in)

    return jax.tree_util.tree_map_with_path(
        one, tree, is_leaf=lambda x: isinstance(x, QuantizedWeight) or _is_lora(x))


def split(tree: Any) -> tuple[Any, Any]:
    """(adapters, frozen): two trees shaped like `tree`. `adapters` holds only each
    LoraWeight's A and B (base None; every other leaf None): what to differentiate and give the
    optimizer. `frozen` holds everything else (each LoraWeight's a and b None)."""
    adapters = jax.tree_util.tree_map(
        lambda x: dataclasses.replace(x, base=None, key=None) if _is_lora(x) else None, tree,
        is_leaf=_is_lora)
    frozen = jax.tree_util.tree_map(
        lambda x: dataclasses.replace(x, a=None, b=None) if _is_lora(x) else x, tree,
        is_leaf=_is_lora)
    return adapters, frozen


def combine(adapters: Any, frozen: Any) -> Any:
    """The inverse of `split`: the full tree, each LoraWeight with its A and B back."""
    return jax.tree_util.tree_map(
        lambda ad, fr: fr if ad is None else dataclasses.replace(fr, a=ad.a, b=ad.b),
        adapters, frozen, is_leaf=lambda x: x is None or _is_lora(x))


def _subscripts(x_ndim: int, contract: tuple[int, ...], n_out: int, w=None) -> str:
    """x's axes `contract` against a weight's leading axes: 'abc,cx->abx' for Dense."""
    if getattr(w, "n_in", len(contract)) != len(contract):
        raise ValueError(f"a {type(w).__name__} with n_in={w.n_in} input axes is multiplied "
                         f"over {len(contract)} axes of the input (wrap/quantize with "
                         f"n_in={len(contract)})")
    xs = "abcdefghijklmnop"[:x_ndim]
    outs = "stuvwxyz"[:n_out]
    ins = "".join(xs[i] for i in contract)
    rest = "".join(c for i, c in enumerate(xs) if i not in contract)
    return f"{xs},{ins}{outs}->{rest}{outs}"


def _einsum(precision):
    return lambda s, x, w: jnp.einsum(s, x, w.astype(x.dtype), precision=precision)


def dense(x: jax.Array, w, precision=None) -> jax.Array:
    """x [..., in...] @ w [in..., out...] -> [..., out...]: contracts x's last axes with w's
    input axes (w.n_in of them for a weight object, 1 for an array), for arrays, `LoraWeight`
    and `QuantizedWeight` alike."""
    n_in = getattr(w, "n_in", 1)
    n_out = len(w.shape) - n_in
    subscripts = _subscripts(x.ndim, tuple(range(x.ndim - n_in, x.ndim)), n_out)
    return project(subscripts, x, w, _einsum(precision))


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                **kwargs):
    """`jax.lax.dot_general` that also takes a weight object as `rhs` (nnx.Linear's and
    Dense's `dot_general=` hook). A weight object's contracted axes must be its leading ones
    and there must be no batch axes; arrays go to `lax.dot_general` as they are."""
    if not hasattr(rhs, "project"):
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type, **kwargs)
    (lc, rc), (lb, rb) = dimension_numbers
    if lb or rb or tuple(rc) != tuple(range(len(rc))):
        raise ValueError(f"dot_general: a weight object contracts its leading axes without "
                         f"batch axes; got dimension_numbers {dimension_numbers}")
    subscripts = _subscripts(lhs.ndim, tuple(lc), len(rhs.shape) - len(rc), rhs)
    return project(subscripts, lhs, rhs, _einsum(precision))


def promote_dtype(*args, dtype=None, inexact=True):
    """Flax's `promote_dtype` (Linen's variadic form or NNX's one tuple) that passes weight
    objects through: arrays are cast to `dtype` or their common type; a weight object is cast
    where it multiplies (to the activations' dtype)."""
    nnx_style = len(args) == 1 and isinstance(args[0], tuple)
    values = args[0] if nnx_style else args
    arrays = [v for v in values if v is not None and not hasattr(v, "project")]
    target = dtype or jnp.result_type(*arrays)
    if inexact and not jnp.issubdtype(target, jnp.inexact):
        target = jnp.float32
    out = [v if v is None or hasattr(v, "project") else jnp.asarray(v, target) for v in values]
    return tuple(out) if nnx_style else out


def linen():
    """A context manager under which Linen `nn.Dense` / `nn.DenseGeneral` layers (without
    `batch_dims`) whose stored kernel is a weight object multiply through it (see the module
    docstring); bias, `dtype` and `precision` are honoured as the layers do."""
    import flax.linen as nn  # Linen's adapter only (NNX users and plain code never need it)

    def interceptor(next_fun, args, kwargs, context):
        m = context.module
        if (context.method_name != "__call__" or not isinstance(m, (nn.Dense, nn.DenseGeneral))
                or not m.has_variable("params", "kernel")):
            return next_fun(*args, **kwargs)
        w = m.get_variable("params", "kernel")
        if not hasattr(w, "project"):
            return next_fun(*args, **kwargs)
        (x,) = args
        bias = m.get_variable("params", "bias") if m.use_bias else None
        x = x.astype(m.dtype or jnp.result_type(x, m.param_dtype))
        if isinstance(m, nn.Dense):
            axes, features = (x.ndim - 1,), (m.features,)
        else:
            if m.batch_dims:
                raise ValueError(f"jaxmem.lora.linen: {m.name}: DenseGeneral with batch_dims "
                                 f"is not supported with a weight-object kernel")
            axes = tuple(a % x.ndim for a in np.atleast_1d(m.axis))
            features = tuple(np.atleast_1d(m.features))
        y = project(_subscripts(x.ndim, axes, len(features), w), x, w, _einsum(m.precision))
        if bias is not None:
            y = y + jnp.reshape(bias, bias.shape[-len(features):]).astype(y.dtype)
        return y

    return nn.intercept_methods(interceptor)
