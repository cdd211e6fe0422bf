"""A family's parameters, made, shaped and counted by its own module (`jaxmem.families.model`):
no closed-form count that must know each family's twists.

    init_params(config, rng)        the parameters (allocated): Flax's init, or in a dtype
    abstract_params(config, dtype)  their shapes and dtypes, nothing allocated
    num_params(config)              how many (cached per config)
    model_flops(config, seq_len)    training FLOPs per token (jaxmem.perf.flops_per_token of that
                                    count): the MFU numerator of the trainer, planner and reports
    count_params(params)            elements over a params tree's leaves
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmem import families
from jaxmem.families.config import ModelConfig
from jaxmem.perf import flops_per_token


def init_params(config: ModelConfig, rng: jax.Array, seq_len: int = 8, dtype=None):
    """Parameters for `config` (allocates them): Flax's fp32 init, or with `dtype` every
    floating leaf in `dtype`.

    With `dtype` (fp32 too) the values are bitwise Flax's init cast to `dtype`, evaluated by
    jaxmem.model.typed_init: no fp32 copy of a bf16 model, no full-size threefry buffers on
    CPU. llama-3-8b in bf16 compiles on CPU to 14.96 GiB of output and 0.58 GiB of
    temporaries: `jax.jit(lambda k: init_params(cfg, k, dtype=jnp.bfloat16)).lower(key).compile()`.
    """
    tokens = jnp.zeros((1, min(seq_len, config.max_position_embeddings)), jnp.int32)
    module = families.model(config)

    def init(key):
        return module.init(key, tokens)["params"]

    if dtype is None:
        return jax.jit(init)(rng)
    from jaxmem.model.typed_init import init_in_dtype  # noqa: PLC0415
    return jax.jit(lambda key: init_in_dtype(init, key, dtype))(rng)


def abstract_params(config: ModelConfig, dtype=None):
    """Parameter shapes and dtypes as `jax.ShapeDtypeStruct`s, without allocating anything."""
    abstract = jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0), seq_len=1))
    if dtype is None:
        return abstract
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype) if jnp.issubdtype(
        x.dtype, jnp.floating) else x, abstract)


def count_params(params) -> int:
    """Elements over all leaves (arrays or `jax.ShapeDtypeStruct`s)."""
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))


@functools.lru_cache(maxsize=128)
def num_params(config: ModelConfig) -> int:
    """How many parameters `config`'s family module has (its abstract init, counted)."""
    return count_params(abstract_params(config))


def model_flops(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of `config` at `seq_len` positions: `jaxmem.perf.flops_per_token`
    with this module's own parameter count, the one MFU formula every figure uses."""
    return flops_per_token(config, seq_len, num_params(config))
