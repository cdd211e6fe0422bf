"""Stochastic rounding to bf16, for bf16 weights with no fp32 master copy.

    round_bf16(x, key)                     fp32 -> bf16, rounding up with probability equal to
                                           the distance to the lower bf16 value / the ulp
    apply_updates_sr(params, updates, key) params + updates in fp32, then round_bf16 per leaf
    pieces(key, x, leaf=i) -> keys         the rounding keys of leaf i and of its row pieces:
                                           the one place they come from

Round-to-nearest drops every update below half an ulp of the weight (bf16 has 8 significant
bits: a weight of 1.0 ignores updates below 2^-8), so late, small updates vanish and pure bf16
training stalls (docs/precision.md). Stochastic rounding keeps them in expectation:
E[round_bf16(x)] = x. The bits: bf16 is the top 16 bits of an fp32, so adding a uniform random
16-bit integer to the fp32's bit pattern and truncating the low 16 bits rounds up with exactly
that probability (the sign-magnitude layout makes this right for negative values too).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxmem.bits import from_bits, to_bits

CHUNK = 2**24  # elements rounded at a time in a large leaf


def rounding_chunk() -> int:
    """Elements rounded at a time in a large leaf (CHUNK, read when called)."""
    return CHUNK


def round_bf16(x: jax.Array, key: jax.Array) -> jax.Array:
    """Stochastically round `x` to bf16, unbiased: E[round_bf16(x, key)] = x.

    Args:
      x: any shape, any float dtype (computed on in fp32).
      key: a PRNG key; the same key gives the same rounding.

    Returns:
      bf16 array of x's shape. Non-finite values, and finite ones whose rounding up would carry
      past bf16's largest value, are rounded to nearest instead.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jnp.full((10000,), 1.0 + 2.0**-10)    # a quarter of a bf16 ulp above 1.0
      >>> r = round_bf16(x, jax.random.PRNGKey(0)).astype(jnp.float32)
      >>> sorted(set(r.tolist()))                    # the two neighbours, ~1/4 of them up
      [1.0, 1.0078125]
    """
    x = x.astype(jnp.float32)
    return round_bf16_bits(x, jax.random.bits(key, x.shape, jnp.uint32))


def round_bf16_bits(x: jax.Array, random_bits: jax.Array) -> jax.Array:
    """`round_bf16` with its random bits given: `round_bf16(x, key)` is
    `round_bf16_bits(x, jax.random.bits(key, x.shape, jnp.uint32))`. For a caller that rounds
    a slice of an array whose bits were drawn for a larger shape (the optimizer applied layer
    by layer, jaxmem.train.inbackward)."""
    x = x.astype(jnp.float32)
    bits = to_bits(x)                                              # uint32
    noise = random_bits.astype(jnp.uint32) >> 16                  # uniform in [0, 2^16)
    rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
    out = from_bits(rounded, jnp.float32)
    # A carry past the largest finite bf16 would give inf: keep those (and inf/nan) to nearest.
    ok = jnp.isfinite(out) & jnp.isfinite(x)
    return jnp.where(ok, out, x).astype(jnp.bfloat16)


def row_chunks(shape, chunk: int | None = None) -> int:
    """Into how many pieces to cut the rows (every axis but the last, flattened) of an array of
    `shape` so that each piece has <= `chunk` elements (None: CHUNK, read at the call; a divisor
    of the row count; 1 for 0-D and 1-D shapes).

    Example:
      >>> row_chunks((2, 4096, 14336)), row_chunks((4, 8), chunk=16), row_chunks((4096,))
      (8, 2, 1)
    """
    chunk = CHUNK if chunk is None else chunk
    if len(shape) < 2:
        return 1
    rows = 1
    for d in shape[:-1]:
        rows *= d
    for n in range(1, rows + 1):
        if rows % n == 0 and rows // n * shape[-1] <= chunk:
            return n
    return rows


@dataclasses.dataclass(frozen=True)
class RoundingPieces:
    """The stochastic-rounding keys of one leaf rounded in `n` row pieces (from `pieces`).

    keys(j): piece j's key: the leaf's own `key` when n == 1, else fold_in(key, j) (j may be
      traced); None where the leaf is not rounded (`key` None).
    keys.bits(j, shape): piece j's random bits (uint32 of `shape`).
    keys.leaf_bits(shape): the whole leaf's bits, its n pieces' bits one after the other.
    """

    key: jax.Array | None
    n: int

    def __call__(self, j) -> jax.Array | None:
        if self.key is None:
            return None
        return self.key if self.n == 1 else jax.random.fold_in(self.key, j)

    def bits(self, j, shape) -> jax.Array:
        return jax.random.bits(self(j), shape, jnp.uint32)

    def leaf_bits(self, shape) -> jax.Array:
        size = 1
        for d in shape:
            size *= d
        return jax.vmap(lambda j: self.bits(j, (size // self.n,)))(
            jnp.arange(self.n)).reshape(shape)


def pieces(key: jax.Array | None, x, *, leaf: int | None = None,
           n: int | None = None) -> RoundingPieces:
    """The stochastic-rounding keys of a leaf and of its row pieces: the one place they come
    from, for the whole-tree update (`apply_updates_sr`), the in-place 8-bit AdamW
    (jaxmem.optim.AdamW8bitInPlace) and the update applied part by part (jaxmem.optim.Parts).

    The scheme: leaf i of a tree (`jax.tree_util.tree_flatten` order) draws from
    fold_in(key, i); a leaf over CHUNK (2^24) elements is rounded in row pieces (`row_chunks`),
    piece j drawing from fold_in(fold_in(key, i), j).

    Args:
      key: the whole tree's key with `leaf` the leaf's index, or (leaf None) the leaf's own
        key, fold_in(tree key, i). None: nothing is rounded.
      x: the leaf (an array or a jax.ShapeDtypeStruct); only bf16 leaves are rounded.
      leaf: the leaf's index in its tree, or None (above).
      n: the row pieces the leaf is rounded in; None: `row_chunks(x.shape)` (CHUNK read now).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> key = jax.random.PRNGKey(0)
      >>> keys = pieces(key, jnp.zeros((4, 8), jnp.bfloat16), leaf=3, n=2)
      >>> ref = jax.random.fold_in(jax.random.fold_in(key, 3), 1)
      >>> bool((jax.random.key_data(keys(1)) == jax.random.key_data(ref)).all())
      True
      >>> pieces(key, jnp.zeros(8), leaf=0)(0) is None    # fp32: not rounded
      True
    """
    n = row_chunks(x.shape) if n is None else n
    if key is None or x.dtype != jnp.bfloat16:
        return RoundingPieces(None, n)
    return RoundingPieces(key if leaf is None else jax.random.fold_in(key, leaf), n)


def _add_round(p, u, key):
    total = p.astype(jnp.float32) + u.astype(jnp.float32)
    return round_bf16(total, key)


def apply_updates_sr(params, updates, key: jax.Array):
    """`optax.apply_updates` for bf16 params without an fp32 master copy: each bf16 leaf gets
    p + u computed in fp32 and stochastically rounded back to bf16 (`round_bf16`); every other
    leaf p + u in fp32, cast back to p's dtype.

    Args:
      params: a pytree of arrays (any dtypes; the bf16 leaves are the ones rounded).
      updates: a pytree of params' structure (e.g. from a GradientTransformation's update).
      key: a PRNG key; leaf i draws from fold_in(key, i), and a leaf over CHUNK (2^24) elements,
        rounded in row pieces (`row_chunks`) so that its random bits never exist at once, from
        fold_in(fold_in(key, i), piece).

    Returns:
      The new params, same structure and dtypes as `params`.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> params = {"w": jnp.ones((4, 4), jnp.bfloat16)}
      >>> tx = optax.sgd(1e-3)          # each step below half a bf16 ulp of 1.0
      >>> updates, _ = tx.update({"w": jnp.ones((4, 4))}, tx.init(params))
      >>> new = apply_updates_sr(params, updates, jax.random.PRNGKey(0))
      >>> new["w"].dtype, bool((new["w"] < 1).any())   # round-to-nearest would leave all 1.0
      (dtype(bfloat16), True)
    """
    leaves, treedef = jax.tree_util.tree_flatten(params)
    return treedef.unflatten([apply_leaf_sr(p, u, pieces(key, p, leaf=i).key)
                              for i, (p, u) in enumerate(zip(leaves,
                                                             treedef.flatten_up_to(updates)))])


def apply_leaf_sr(p: jax.Array, u: jax.Array, leaf_key: jax.Array | None) -> jax.Array:
    """One leaf of `apply_updates_sr` (leaf_key = fold_in(key, leaf index); None or ignored for
    a leaf that is not bf16): a bf16 leaf rounded stochastically (in row pieces over CHUNK
    elements, `pieces`' keys), any other p + u in fp32, cast back."""
    if p.dtype != jnp.bfloat16:
        return (p.astype(jnp.float32) + u.astype(jnp.float32)).astype(p.dtype)
    keys = pieces(leaf_key, p)
    n = keys.n
    if n == 1:
        return _add_round(p, u, keys(0))
    split = lambda x: x.reshape((n, -1, x.shape[-1]))  # noqa: E731
    keys = jax.vmap(keys)(jnp.arange(n))
    # p and u enter the loop as raw bits, so XLA cannot hoist their fp32 converts out of it
    # (whole-leaf 4 B/element buffers; the 8-bit AdamW's update does the same)
    out = jax.lax.map(lambda a: _add_round(from_bits(a[0], p.dtype),
                                           from_bits(a[1], u.dtype), a[2]),
                      (split(to_bits(p)), split(to_bits(u)), keys))
    return out.reshape(p.shape)
