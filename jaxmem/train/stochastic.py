"""Stochastic rounding to bf16, for bf16 weights with no fp32 master copy (`--precision bf16-sr`).

    round_bf16(x, key)                    fp32 -> bf16, rounding up with probability equal to
                                          the distance to the lower bf16 value / the ulp
    apply_updates_sr(params, updates, key) params + updates in fp32, then round_bf16 per leaf

Round-to-nearest drops every update below half an ulp of the weight (bf16 has 8 significant
bits: a weight of 1.0 ignores updates below 2^-8), so late, small updates vanish and pure bf16
training stalls (docs/precision.md). Stochastic rounding keeps them in expectation:
E[round_bf16(x)] = x. The bits: bf16 is the top 16 bits of an fp32, so adding a uniform random
16-bit integer to the fp32's bit pattern and truncating the low 16 bits rounds up with exactly
that probability (the sign-magnitude layout makes this right for negative values too).

The key comes from the train state (jaxmem.train.step folds the state's RNG with the step
number), so a resumed run draws the same bits and stays bitwise equal to an uninterrupted one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def round_bf16(x: jax.Array, key: jax.Array) -> jax.Array:
    """Stochastically round fp32 `x` to bf16 (unbiased); non-finite values round to nearest."""
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    noise = jax.random.bits(key, x.shape, jnp.uint32) >> 16       # uniform in [0, 2^16)
    rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
    out = jax.lax.bitcast_convert_type(rounded, jnp.float32)
    # A carry past the largest finite bf16 would give inf: keep those (and inf/nan) to nearest.
    ok = jnp.isfinite(out) & jnp.isfinite(x)
    return jnp.where(ok, out, x).astype(jnp.bfloat16)


def step_key(rng: jax.Array, step: jax.Array) -> jax.Array:
    """The rounding key of one step: the state's raw key data folded with the step number."""
    key = jax.random.wrap_key_data(rng) if hasattr(jax.random, "wrap_key_data") else rng
    return jax.random.fold_in(key, step)


def apply_updates_sr(params, updates, key: jax.Array):
    """params + updates computed in fp32, each floating leaf stochastically rounded back to its
    dtype when that is bf16 (one key per leaf: fold_in of the leaf's index); others as
    optax.apply_updates."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    new = []
    for i, (p, u) in enumerate(zip(leaves, treedef.flatten_up_to(updates))):
        total = p.astype(jnp.float32) + u.astype(jnp.float32)
        if p.dtype == jnp.bfloat16:
            new.append(round_bf16(total, jax.random.fold_in(key, i)))
        else:
            new.append(total.astype(p.dtype))
    return treedef.unflatten(new)
