"""Bytes of the optimizer state and the train state, from the abstract state (nothing allocated).

    optimizer_components(model, optim, precision)  [(name, bytes, dtype)] of the optimizer state
    state_bytes_per_param(model, optim, precision) params, optimizer state, train state / param

The numbers are not a formula: `jax.eval_shape` runs the optimizer's own `init` on the abstract
params (jaxmem.model.llama.abstract_params), so every leaf the optimizer really creates is counted
with its real shape and dtype: the 8-bit codes and block scales of adamw8bit
(jaxmem.optim.adamw_8bit), the fp32 moments of the leaves that keep them (embeddings, small
tensors), Adafactor's factored rows and columns, Lion's one moment. bf16-sr initializes the
optimizer from fp32 shapes (jaxmem.train.step.create_train_state), and so does this.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmem.config.model import ModelConfig
from jaxmem.config.run import OptimConfig
from jaxmem.model.llama import abstract_params
from jaxmem.model.precision import Precision


def _abstract_opt_state(model: ModelConfig, optim: OptimConfig, precision: Precision):
    from jaxmem.train.optim import make_optimizer
    dtype = jnp.float32 if precision.stochastic_rounding else precision.param_dtype
    params = jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s.shape, dtype if jnp.issubdtype(s.dtype, jnp.floating)
                                       else s.dtype), abstract_params(model))
    return jax.eval_shape(make_optimizer(optim).init, params)


def _kind(path, leaf) -> str:
    """What a leaf of the optimizer state is, from its dtype and its place in a Quantized node."""
    last = path[-1] if path else None
    name = getattr(last, "name", None)  # GetAttrKey of a Quantized node (codes / scale)
    if name == "codes":
        return "8-bit moment codes"
    if name == "scale":
        return "8-bit block scales"
    if leaf.ndim == 0:
        return "counters"
    return f"moments ({jnp.dtype(leaf.dtype).name})"


@functools.lru_cache(maxsize=64)
def optimizer_components(model: ModelConfig, optim: OptimConfig,
                         precision: Precision) -> tuple[tuple[str, int, str], ...]:
    """(name, bytes, dtype) per kind of optimizer-state leaf, largest first."""
    state = _abstract_opt_state(model, optim, precision)
    totals: dict[str, list] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        kind = _kind(path, leaf)
        entry = totals.setdefault(kind, [0, jnp.dtype(leaf.dtype).name])
        entry[0] += int(leaf.size) * jnp.dtype(leaf.dtype).itemsize
    out = [(f"{optim.optimizer} {k}", b, d) for k, (b, d) in totals.items()]
    return tuple(sorted(out, key=lambda x: -x[1]))


def state_bytes_per_param(model: ModelConfig, optim: OptimConfig, precision: Precision) -> dict:
    """Bytes per parameter of the params, the optimizer state and both (the train state less its
    counters and loss scale), and the fraction of params whose role is embedding."""
    from jaxmem.model.roles import count_by_role
    params = abstract_params(model)
    P = sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
    pbytes = P * jnp.dtype(precision.param_dtype).itemsize
    obytes = sum(b for _, b, _ in optimizer_components(model, optim, precision))
    return {"params": P, "embedding_fraction": count_by_role(params)["embedding"] / P,
            "param_bytes_per_param": pbytes / P, "optimizer_bytes_per_param": obytes / P,
            "train_state_bytes_per_param": (pbytes + obytes) / P}
