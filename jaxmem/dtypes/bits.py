"""Raw bit patterns of arrays, and the probes of jax/optax versions, each written once.

    uint_dtype(dtype)        the unsigned integer dtype of the same size (uint8/16/32/64)
    to_bits(x), from_bits(b, dtype)
                             an array as its raw bits and back (bitwise exact, no conversion)
    tree_norm(tree)          global L2 norm of a pytree (optax.tree.norm, or optax.global_norm)
    wrap_key_data(data), key_data(key)
                             raw uint32 key data <-> a typed PRNG key, where jax has typed keys

Why raw bits: a bf16 leaf that enters a `lax.map` / `fori_loop` over row pieces as bf16 lets XLA
hoist the piece's fp32 convert out of the loop, a whole-leaf 4 B/element buffer; as unsigned
integers nothing can be hoisted (jaxmem.optim's 8-bit AdamW and stochastic rounding, and the
trainer's in-place 8-bit update, all feed their large leaves through loops this way).

Example:
    >>> import jax.numpy as jnp
    >>> b = to_bits(jnp.array([1.0], jnp.bfloat16)); b.dtype, int(b[0])
    (dtype('uint16'), 16256)
    >>> float(from_bits(b, jnp.bfloat16)[0])
    1.0
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def uint_dtype(dtype) -> np.dtype:
    """The unsigned integer dtype with `dtype`'s item size (1, 2, 4 or 8 bytes)."""
    size = np.dtype(dtype).itemsize
    if size not in _UINT:
        raise ValueError(f"no unsigned integer dtype of {size} bytes (dtype {np.dtype(dtype)})")
    return np.dtype(_UINT[size])


def to_bits(x: jax.Array) -> jax.Array:
    """`x` (any shape, any 1/2/4/8-byte dtype) as its raw bits: same shape, `uint_dtype(x.dtype)`."""
    return jax.lax.bitcast_convert_type(x, uint_dtype(x.dtype))


def from_bits(bits: jax.Array, dtype) -> jax.Array:
    """The inverse of `to_bits`: unsigned raw bits [...] -> `dtype` of the same item size."""
    return jax.lax.bitcast_convert_type(bits, dtype)


def tree_norm(tree) -> jax.Array:
    """Global L2 norm of every leaf of `tree` (fp32 scalar for fp32 leaves), as optax clips by.

    optax >= 0.2.4 has `optax.tree.norm`; older releases only `optax.global_norm` (same value)."""
    import optax  # here, not at the top: jaxmem.dtypes' table needs no optax
    if hasattr(optax, "tree") and hasattr(optax.tree, "norm"):
        return optax.tree.norm(tree)
    return optax.global_norm(tree)


def wrap_key_data(data: jax.Array) -> jax.Array:
    """Raw key data (uint32 [2] for threefry) -> a PRNG key usable by jax.random (a typed key
    where this jax has them; the raw data itself on older jax, which takes raw keys)."""
    return jax.random.wrap_key_data(data) if hasattr(jax.random, "wrap_key_data") else data


def key_data(key: jax.Array) -> jax.Array:
    """A PRNG key (typed or raw) -> its raw uint32 data, the form a checkpoint stores."""
    return jax.random.key_data(key) if hasattr(jax.random, "key_data") else key
