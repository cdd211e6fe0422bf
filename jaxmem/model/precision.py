"""Precision modes: where parameters live, what the matmuls compute in, and the default loss scale.

    mode       params + optimizer state   forward/backward   loss scale default
    fp32       fp32                       fp32               none
    bf16       bf16 (pure bf16)           bf16               none
    amp-bf16   fp32 master                bf16               none
    amp-fp16   fp32 master                fp16               dynamic
    fp8        fp32 master                bf16, fp8 matmuls  none   (jaxmem.model.fp8)
    bf16-sr    bf16 params, fp32 optimizer bf16               none   (updated weights rounded
               state (8-bit: see optim8bit)                           stochastically to bf16,
                                                                      jaxmem.optim.apply_updates_sr)
    fp8-sr     as bf16-sr                  bf16, fp8 matmuls  none   (fp8's GEMMs on bf16-sr's
                                                                      weights: no fp32 master)

In the amp modes the train state holds fp32 params; the loss casts them to the compute dtype
*inside* the differentiated function, so the gradients come back in fp32 for the fp32 master copy.
Norm weights are stored in the param dtype (fp32 in the master-weight modes, bf16 in pure bf16)
and never cast to the compute dtype (as PyTorch autocast leaves them); RMSNorm computes in fp32.
Norm statistics, softmax, logits and the loss are fp32 in every mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxmem.model.roles import param_role


class PrecisionError(ValueError):
    """An unknown precision mode."""


@dataclass(frozen=True)
class Precision:
    """A precision mode.

    name: the `--precision` value.
    param_dtype: dtype of the stored params, gradients and optimizer state.
    compute_dtype: dtype the forward and backward matmuls run in.
    loss_scale: the default `--loss-scale` for the mode.
    fp8: route the attention and MLP projections through fp8 matmuls.
    stochastic_rounding: params + updates are summed in fp32 and rounded stochastically to the
        param dtype (no master copy); the optimizer state is initialized in fp32.
    """

    name: str
    param_dtype: jnp.dtype
    compute_dtype: jnp.dtype
    loss_scale: str = "none"
    fp8: bool = False
    stochastic_rounding: bool = False


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", jnp.float32, jnp.float32),
    "bf16": Precision("bf16", jnp.bfloat16, jnp.bfloat16),
    "amp-bf16": Precision("amp-bf16", jnp.float32, jnp.bfloat16),
    "amp-fp16": Precision("amp-fp16", jnp.float32, jnp.float16, loss_scale="dynamic"),
    "fp8": Precision("fp8", jnp.float32, jnp.bfloat16, fp8=True),
    "bf16-sr": Precision("bf16-sr", jnp.bfloat16, jnp.bfloat16, stochastic_rounding=True),
    "fp8-sr": Precision("fp8-sr", jnp.bfloat16, jnp.bfloat16, fp8=True, stochastic_rounding=True),
}


def get_precision(name: str) -> Precision:
    if name not in PRECISIONS:
        raise PrecisionError(f"unknown precision {name!r}; choose one of: {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


def _is_norm(path) -> bool:
    return param_role(path) == "norm"


def cast_params(params, dtype, keep_norms_fp32: bool = True):
    """Cast floating params to `dtype`; norm scales stay as they are when `keep_norms_fp32`.

    Maps over leaves, so a weight object in the tree (jaxmem.model.projection) keeps its type
    and its non-floating leaves (packed int8/NF4 codes); its floating leaves are cast.
    """
    def cast(path, x):
        if not jnp.issubdtype(x.dtype, jnp.floating) or (keep_norms_fp32 and _is_norm(path)):
            return x
        return x.astype(dtype)
    return jax.tree_util.tree_map_with_path(cast, params)


def cast_floating(tree, dtype):
    """Cast every floating leaf of `tree` to `dtype`."""
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)
