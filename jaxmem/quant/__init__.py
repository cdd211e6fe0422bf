"""NF4 / int8 quantization of a pytree of weights, for any model (public API: docs/api.md).

    q = jaxmem.quant.quantize(params, kind="nf4", block_size=64, double_quant=True)
    dense = jaxmem.quant.dequantize(q, jnp.bfloat16)

Each selected weight W [in..., out...] becomes a `QuantizedWeight`, a pytree
whose leaves are the stored arrays: NF4 codes two per uint8 byte, or int8 codes, with one fp32
absmax per block of `block_size` consecutive input values and output column (bitsandbytes'
layout for a torch [out, in] weight); with double quantization the absmax values are stored in
int8 with one fp32 scale per 256. Storage: NF4 4.5 bits per weight, 4.127 with double
quantization; int8 8.5 with blocks of 64 (tests/test_quant.py counts the bytes). A
`QuantizedWeight` multiplies through `project(subscripts, x, einsum)`, which dequantizes in the
forward and again in the backward (a custom VJP), so no dequantized copy is kept for the
backward; `jaxmem.lora` makes Flax `Dense` / `DenseGeneral` / NNX `Linear` layers call it.

One weight at a time: `quantize_weight(w, kind, n_in, block, double_quant)`; a stacked weight
[L, in..., out...] one layer at a time: `quantize_layers` / `dequantize_layers`; on an fsdp mesh,
`gather_packed` all-gathers the packed leaves before they are dequantized (the layout and the
reasons: jaxmem/quant/_weight.py and _gather.py).

References: Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs"
(arXiv:2305.14314), appendix E (NF4, double quantization); bitsandbytes `Linear4bit`.
"""

from __future__ import annotations

import enum
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.quant._gather import gather_packed
from jaxmem.quant._weight import (DQ_BLOCK, NF4_CODE, QuantizedWeight, bits_per_param,
                                  dequantize_layers, double_quantize, quantize_layers,
                                  quantize_weight)

__all__ = ["DQ_BLOCK", "NF4_CODE", "QuantKind", "QuantizedWeight", "bits_per_param",
           "dequantize", "dequantize_layers", "double_quantize", "gather_packed", "is_kernel",
           "path_text", "quantize", "quantize_layers", "quantize_weight"]


class QuantKind(str, enum.Enum):
    """The stored format (a `str` enum: `QuantKind.NF4 == "nf4"`).

    NF4: 4-bit NormalFloat, 16 code values (QLoRA's quantiles of N(0, 1)); relative RMS error
        0.092 on Gaussian weights. INT8: linear int8, round(127 w / absmax); error 0.006.
    """

    NF4 = "nf4"
    INT8 = "int8"


def path_text(path) -> str:
    """A tree path as 'Dense_0/kernel' (dict keys, attribute names and indices joined by /)."""
    parts = []
    for k in path:
        parts.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
    return "/".join(parts)


def is_kernel(path: str, leaf) -> bool:
    """The default selection: floating arrays of 2 or more axes named `kernel` (Flax's name for
    the weight of `nn.Dense`, `nn.DenseGeneral` and `nnx.Linear`); biases, norms and embeddings
    (`embedding`) are left alone."""
    return (path.rpartition("/")[2] == "kernel" and getattr(leaf, "ndim", 0) >= 2
            and jnp.issubdtype(leaf.dtype, jnp.floating))


def _kind(kind) -> QuantKind:
    try:
        return QuantKind(kind.lower() if isinstance(kind, str) else kind)
    except ValueError:
        raise ValueError(f"quantize: kind must be one of 'nf4', 'int8', got {kind!r}") from None


def quantize(tree: Any, kind: QuantKind | str = QuantKind.NF4, block_size: int = 64,
             double_quant: bool = False, where: Callable[[str, Any], bool] | None = None,
             n_in: int | Callable[[str, Any], int] = 1) -> Any:
    """`tree` with each selected weight replaced by its `QuantizedWeight`.

    Args:
      tree: a pytree of arrays (e.g. Flax params); a weight is [in..., out...] with `n_in`
        input axes, as a Flax kernel is stored ([In, Out] for `Dense`).
      kind: `QuantKind` or its string, "nf4" (default) or "int8".
      block_size: input values per absmax; the product of a weight's input axes must be a
        multiple of it. 0: one absmax per output column (int8 only).
      double_quant: store the absmax values in int8 too (blocks of 256): NF4 4.127 bits/weight.
      where: `where(path, leaf) -> bool` selects the weights, `path` like "Dense_0/kernel";
        None: `is_kernel` (arrays named `kernel` with >= 2 axes).
      n_in: how many leading axes of a selected weight are input axes: an int for all (1: a
        `Dense` kernel [In, Out]) or `n_in(path, leaf) -> int` (a `DenseGeneral` with
        `axis=(-2, -1)` has 2).

    Returns:
      The same tree structure with `QuantizedWeight` objects in place of the selected arrays;
      other leaves are returned as they are.

    Raises:
      ValueError naming the argument and the weight's path: unknown kind, a block size that
      does not divide a weight's input size, block_size 0 with NF4.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmem
      >>> params = {"Dense_0": {"kernel": jnp.ones((128, 32)), "bias": jnp.zeros(32)}}
      >>> q = jaxmem.quant.quantize(params, "nf4", block_size=64)
      >>> q["Dense_0"]["kernel"].codes.dtype, q["Dense_0"]["kernel"].codes.shape
      (dtype('uint8'), (2, 32, 32))
      >>> float(jnp.max(jnp.abs(jaxmem.quant.dequantize(q)["Dense_0"]["kernel"] - 1)))
      0.0
    """
    k = _kind(kind)
    select = is_kernel if where is None else where
    if block_size < 0 or (block_size == 0 and k is QuantKind.NF4):
        raise ValueError(f"quantize: block_size must be positive for {k.value}, got {block_size}")

    def one(path, leaf):
        p = path_text(path)
        if isinstance(leaf, QuantizedWeight) or not select(p, leaf):
            return leaf
        axes_in = n_in(p, leaf) if callable(n_in) else n_in
        size_in = int(np.prod(leaf.shape[:axes_in]))
        if block_size and size_in % block_size:
            raise ValueError(f"quantize: block_size {block_size} does not divide the input size "
                             f"{size_in} of {p} (shape {tuple(leaf.shape)}, n_in={axes_in})")
        return _quantize_jit(jnp.asarray(leaf), k.value, axes_in, block_size, double_quant)

    return jax.tree_util.tree_map_with_path(
        one, tree, is_leaf=lambda x: isinstance(x, QuantizedWeight))


# one compiled program per weight shape instead of a few dozen eager ops per weight
_quantize_jit = jax.jit(quantize_weight, static_argnums=(1, 2, 3, 4))


def dequantize(tree: Any, dtype=jnp.float32) -> Any:
    """`tree` with each `QuantizedWeight` (also inside a `jaxmem.lora.LoraWeight`) replaced by
    its dense weight [in..., out...] in `dtype` (values computed in fp32)."""
    return jax.tree_util.tree_map(
        lambda x: x.dequantize(dtype) if isinstance(x, QuantizedWeight) else x, tree,
        is_leaf=lambda x: isinstance(x, QuantizedWeight))
