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


SR_STREAM = 0x5352  # "SR": keeps the rounding bits apart from other users of fold_in(rng, step)


def step_key(rng: jax.Array, step: jax.Array) -> jax.Array:
    """The rounding key of one step: the state's raw key data folded with the step number, then
    with SR_STREAM (LoRA dropout draws from fold_in(rng, step) itself: jaxmem.train.step)."""
    key = jax.random.wrap_key_data(rng) if hasattr(jax.random, "wrap_key_data") else rng
    return jax.random.fold_in(jax.random.fold_in(key, step), SR_STREAM)


CHUNK = 2**24  # elements rounded at a time in a large leaf
_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def row_chunks(shape, chunk: int = CHUNK) -> int:
    """Into how many pieces to cut the rows (every axis but the last, flattened) of an array of
    `shape` so that each piece has <= `chunk` elements (a divisor of the row count)."""
    if len(shape) < 2:
        return 1
    rows = 1
    for d in shape[:-1]:
        rows *= d
    for n in range(1, rows + 1):
        if rows % n == 0 and rows // n * shape[-1] <= chunk:
            return n
    return rows


def _add_round(p, u, key):
    total = p.astype(jnp.float32) + u.astype(jnp.float32)
    return round_bf16(total, key)


def apply_updates_sr(params, updates, key: jax.Array):
    """params + updates computed in fp32, each floating leaf stochastically rounded back to its
    dtype when that is bf16; others as optax.apply_updates.

    Keys: fold_in(key, leaf index), then fold_in(., piece) for a leaf rounded in pieces (leaves
    over CHUNK elements go through lax.map over row pieces: the random bits of a whole
    [L, D, F] leaf measured ~8 B/element of CPU temporaries)."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    new = []
    for i, (p, u) in enumerate(zip(leaves, treedef.flatten_up_to(updates))):
        if p.dtype != jnp.bfloat16:
            new.append((p.astype(jnp.float32) + u.astype(jnp.float32)).astype(p.dtype))
            continue
        leaf_key = jax.random.fold_in(key, i)
        n = row_chunks(p.shape, CHUNK)
        if n == 1:
            new.append(_add_round(p, u, leaf_key))
            continue
        split = lambda x: x.reshape((n, -1, x.shape[-1]))  # noqa: E731
        keys = jax.vmap(lambda j: jax.random.fold_in(leaf_key, j))(jnp.arange(n))
        # p and u enter the loop as raw bits, so XLA cannot hoist their fp32 converts out of it
        # (whole-leaf 4 B/element buffers; jaxmem.train.optim8bit does the same)
        pb, ub = (jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]) for x in (p, u))
        out = jax.lax.map(lambda a: _add_round(jax.lax.bitcast_convert_type(a[0], p.dtype),
                                               jax.lax.bitcast_convert_type(a[1], u.dtype), a[2]),
                          (split(pb), split(ub), keys))
        new.append(out.reshape(p.shape))
    return treedef.unflatten(new)
