"""8-bit AdamW: both moments stored in 8 bits with block-wise dynamic quantization.

Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (arXiv 2110.02861):

    state leaf  -> Quantized(codes uint8 [same shape as the param], scale fp32 [..., nblocks])
    value       =  MAP[codes] * scale[block]        block = `block_size` consecutive elements of
                                                    the param's last k axes, merged (`block_axes`:
                                                    k = 1 where the last axis is a multiple or a
                                                    divisor of the block; else bitsandbytes' flat
                                                    blocks; the last may be short)
    m (signed)  uses SIGNED_MAP   = create_dynamic_map(signed=True)   (bitsandbytes' "dynamic")
    v (>= 0)    uses UNSIGNED_MAP = create_dynamic_map(signed=False)  (bitsandbytes' "udynamic")

Each step dequantizes a leaf's moments to fp32, does the Adam update in fp32, and quantizes them
again with a fresh absmax per block (nearest map value, except that a positive second moment
never rounds to 0: `_boundaries`). A linear int8 map for the second moment
diverges (its small values all round to zero and the update blows up), so none is offered.

Which leaves keep fp32 moments is the caller's rule (`keep_fp32`); the default keeps non-float
leaves and tensors with fewer than MIN_8BIT_SIZE elements (bitsandbytes' 4096 threshold: norm
scales, biases and other small vectors, where the block scales would cost more than they save).
The paper also keeps embeddings in 32 bits; jaxmem's trainer adds that through its own rule.

Layout for sharding: `codes` has exactly the param's shape and `scale` the param's shape with the
k blocked axes replaced by their number of blocks, so a sharding rule written for a param applies
to its codes as is, and to its scale on every axis before them. All leaves are ordinary arrays in a
`Quantized` pytree node (a flax struct), so jit, tree maps (`select_tree`) and Orbax treat them
like any other.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from jaxmem.bits import from_bits, to_bits
from jaxmem.optim._stochastic import row_chunks

BLOCK = 256           # elements per absmax block (bitsandbytes' blockwise optimizers use 256)
MIN_8BIT_SIZE = 4096  # smaller tensors keep fp32 states (bitsandbytes' min_8bit_size)


def _linspace(start: float, end: float, steps: int) -> np.ndarray:
    """torch.linspace in fp32 (what bitsandbytes calls): an fp32 step; the first half counted from
    `start`, the second from `end`, each value start + step * i with one rounding (as a fused
    multiply-add). numpy's float64 linspace differs from it by 1 ulp in places."""
    start32, end32 = np.float32(start), np.float32(end)
    step = np.float64((end32 - start32) / np.float32(steps - 1))
    i = np.arange(steps, dtype=np.float64)
    return np.where(i < steps // 2, np.float64(start32) + step * i,
                    np.float64(end32) - step * (steps - 1 - i)).astype(np.float32)


def create_dynamic_map(signed: bool = True, max_exponent_bits: int = 7,
                       total_bits: int = 8) -> np.ndarray:
    """bitsandbytes' dynamic quantization map (functional.create_dynamic_map), 256 sorted fp32 values.

    A dynamic exponent (10^-6 .. 10^0) and a fraction whose bit count shrinks as the exponent grows:
    for exponent i the map holds the midpoints of a linspace(0.1, 1) with 2^(i + fraction bits)
    intervals, scaled by 10^(i - 6) (mirrored for signed maps); plus 0 and 1.
    """
    data: list[float] = []
    non_sign_bits = total_bits - 1  # bitsandbytes: `total_bits - (1 if signed else 1)`
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = (2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                          else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        boundaries = _linspace(0.1, 1.0, fraction_items)
        means = (boundaries[:-1] + boundaries[1:]) / np.float32(2.0)
        scale = np.float32(10.0 ** (-(max_exponent_bits - 1) + i))  # fp32 products, as torch
        data += (scale * means).tolist()
        if signed:
            data += (-scale * means).tolist()
    if additional_items > 0:
        boundaries = _linspace(0.1, 1.0, additional_items + 1)
        means = (boundaries[:-1] + boundaries[1:]) / np.float32(2.0)
        scale = np.float32(1.0)  # bitsandbytes reuses the loop's last exponent: 10^0
        data += (scale * means).tolist()
        if signed:
            data += (-scale * means).tolist()
    data += [0.0, 1.0]
    assert len(data) == 2 ** total_bits
    data += [0.0] * (256 - len(data))
    return np.sort(np.asarray(data, np.float32))


SIGNED_MAP = create_dynamic_map(signed=True)
UNSIGNED_MAP = create_dynamic_map(signed=False)


@struct.dataclass
class Quantized:
    """One moment tensor in 8 bits: `MAP[codes] * scale[block]` (see the module docstring).

    codes: uint8, the param's shape; each an index into the moment's 256-value map.
    scale: fp32, each block's absmax: with k = `block_axes(param.shape)` trailing axes merged
      into one of n elements, param.shape[:-k] + (ceil(n / block),) (k = 1: the last axis).
    block: elements per block (static: part of the treedef, not a leaf).
    """

    codes: jax.Array
    scale: jax.Array
    block: int = struct.field(pytree_node=False, default=BLOCK)


def _blocks(x: jax.Array, block: int) -> tuple[jax.Array, int]:
    """x [..., n] -> [..., nb, block] (zero-padded), and the padding."""
    n = x.shape[-1]
    nb = -(-n // block)
    pad = nb * block - n
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(x.shape[:-1] + (nb, block)), pad


def _block_size(shape, block: int) -> int:
    return min(block, shape[-1]) if shape else 1


def block_axes(shape, block: int = BLOCK, lead: int = 0) -> int:
    """How many trailing axes of a leaf of `shape` its blocks run over (the layout rule):

    * 1 where the last axis is a multiple of `block` or divides it: blocks along the last axis.
      For a multiple these are bitsandbytes' flat blocks exactly; for a divisor (a 64- or
      128-wide head) each of bitsandbytes' blocks is cut into whole rows, each with its own
      absmax, and no block straddles a row (so none straddles a shard of a leading axis);
    * otherwise bitsandbytes' flat blocks: the fewest trailing axes whose product is a multiple
      of `block`, else all of them but the first `lead` (e.g. [96, 200]: both, 75 blocks of 256
      consecutive elements; rows of 200 would not be a refinement of them, and ended training
      further from fp32 AdamW: experiments/adamw8bit_vs_bnb.py).

    `lead` leading axes index separate tensors (a scanned stack of layers): blocks never span them.

    Example:
      >>> block_axes((4096, 14336)), block_axes((32, 4096, 8, 128)), block_axes((96, 200))
      (1, 1, 2)
      >>> block_axes((16, 96, 200), lead=1), block_axes((16, 3, 100), lead=1)
      (2, 2)
    """
    n = len(shape)
    if n <= lead + 1 or shape[-1] % block == 0 or block % shape[-1] == 0:
        return 1 if n else 0
    size = 1
    for k in range(1, n - lead + 1):
        size *= shape[-k]
        if size % block == 0:
            return k
    return n - lead


def block_view(shape, axes: int) -> tuple:
    """`shape` with its last `axes` axes merged into one: the array blocks run along the last
    axis of."""
    if axes <= 1:
        return tuple(shape)
    return tuple(shape[:-axes]) + (int(np.prod(shape[-axes:])),)


def _axes(q: "Quantized") -> int:
    """`block_axes` of a quantized moment, read from its shapes (scale has one axis for the
    merged ones)."""
    return q.codes.ndim - q.scale.ndim + 1


def moment_view(shape, m) -> tuple:
    """The shape a leaf of `shape` is cut into rows by, for moments `m` (its `Quantized` or an
    fp32 array): `block_view` of the moment's axes, so that a row piece holds whole blocks."""
    return block_view(shape, _axes(m)) if isinstance(m, Quantized) else tuple(shape)


def _boundaries(qmap: np.ndarray) -> np.ndarray:
    """The 256 decision boundaries of the sorted `qmap` (fp32): the midpoints between neighbours,
    then inf. For a map whose least value is 0 (UNSIGNED_MAP, the second moment's), the first
    boundary is 0 itself instead of the midpoint to the least positive value: a positive value
    never rounds to 0. Adam divides by sqrt(v); a v rounded to 0 under an m that is not turns the
    next update into m / eps (a 0.05 jump on a 3e-3 learning rate in
    experiments/adamw8bit_vs_bnb.py's linear problem), so v rounds up to the map's least positive
    value instead, which only shrinks that update. Exact zeros stay 0."""
    mids = np.append((qmap[1:] + qmap[:-1]) / 2, np.inf).astype(np.float32)
    if qmap[0] == 0.0:
        mids[0] = 0.0
    return mids


def _nearest_code(normed: jax.Array, qmap: np.ndarray) -> jax.Array:
    """Index of the nearest value of the sorted 256-entry `qmap` (`_boundaries` says the one
    exception): the number of decision boundaries below each value, found by a binary search
    unrolled into 8 elementwise steps. jnp.searchsorted runs a while loop over the whole array,
    which XLA cannot fuse: on llama-3-8b's shapes it kept ~37 B/param of temporaries; this is one
    fused loop."""
    mids = jnp.asarray(_boundaries(qmap), jnp.float32)  # [256]
    idx = jnp.where(mids[127] < normed, 128, 0)  # the first step compares with one constant
    for step in (64, 32, 16, 8, 4, 2, 1):
        below = mids[idx + (step - 1)] < normed  # mids[255] = inf: never below
        idx = jnp.where(below, idx + step, idx)
    return idx


def _fmix32(x: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: a bijection of uint32 in which every input bit flips every
    output bit with probability ~1/2."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def step_salt(count: jax.Array) -> jax.Array:
    """The uint32 salt of step `count` for `quantize(..., salt=)` (a function of the count only,
    so a resumed run draws the same)."""
    return _fmix32(jnp.asarray(count).astype(jnp.uint32) * np.uint32(0x9E3779B9)
                   + np.uint32(0x7F4A7C15))


def _stochastic_code(normed: jax.Array, qmap: np.ndarray, salt: jax.Array) -> jax.Array:
    """Index of one of the two values of the sorted `qmap` around each value, the upper one with
    probability (value - lower) / (upper - lower), so that E[qmap[code]] = value (clamped to the
    map's range). The uniform number is a hash of the value's fp32 bits and `salt`: a function
    of what is rounded, not of where it lies, so an update in row pieces, on shards or layer by
    layer rounds every element as the whole-leaf update does. The lower value is found by a
    binary search unrolled into 8 elementwise steps, as in `_nearest_code`."""
    vals = jnp.asarray(qmap, jnp.float32)
    lo = jnp.where(vals[128] <= normed, 128, 0)
    for step in (64, 32, 16, 8, 4, 2, 1):
        lo = jnp.where(vals[lo + step] <= normed, lo + step, lo)
    hi = jnp.minimum(lo + 1, 255)
    gap = vals[hi] - vals[lo]
    frac = jnp.where(gap > 0, (normed - vals[lo]) / jnp.where(gap > 0, gap, 1.0), 0.0)
    bits = _fmix32(jax.lax.bitcast_convert_type(normed, jnp.uint32) ^ salt)
    uniform = (bits >> 8).astype(jnp.float32) * np.float32(2.0**-24)  # [0, 1)
    idx = jnp.where(uniform < frac, hi, lo)
    if qmap[0] == 0.0:  # as `_boundaries`: a positive second moment never rounds to 0
        idx = jnp.where((normed > 0) & (idx == 0), 1, idx)
    return idx


def quantize(x: jax.Array, qmap: np.ndarray, block: int = BLOCK,
             axes: int | None = None, salt: jax.Array | None = None) -> Quantized:
    """Block-wise absmax + nearest value of `qmap` (sorted, 256 values; with UNSIGNED_MAP a
    positive value rounds to at least the least positive map value, never to 0: `_boundaries`),
    or with `salt` one of the two neighbouring map values, drawn so that the rounding is
    unbiased (`_stochastic_code`).

    Args:
      x: any float dtype, ndim >= 1.
      qmap: SIGNED_MAP for signed values, UNSIGNED_MAP for values >= 0.
      block: elements per block (the last of a row may be shorter).
      axes: how many trailing axes the blocks run over (merged, row-major); None:
        `block_axes(x.shape, block)`.
      salt: None: round to the nearest map value (bitsandbytes' rule). A uint32 scalar
        (`step_salt`): stochastic rounding, its random numbers hashed from the values and salt.

    Returns:
      Quantized(codes uint8 x.shape, scale fp32 x.shape[:-axes] + (nblocks,), block).
    """
    axes = block_axes(x.shape, block) if axes is None else axes
    view = block_view(x.shape, axes)
    b = _block_size(view, block)
    xb, pad = _blocks(x.astype(jnp.float32).reshape(view), b)       # [..., nb, b]
    scale = jnp.max(jnp.abs(xb), axis=-1)                            # [..., nb]
    normed = xb / jnp.where(scale == 0, 1.0, scale)[..., None]       # in [-1, 1]
    idx = (_nearest_code(normed, qmap) if salt is None
           else _stochastic_code(normed, qmap, salt)).astype(jnp.uint8)
    codes = idx.reshape(idx.shape[:-2] + (-1,))
    if pad:
        codes = codes[..., : view[-1]]
    return Quantized(codes=codes.reshape(x.shape), scale=scale, block=block)


def quantized_zeros(shape, qmap: np.ndarray, block: int = BLOCK,
                    axes: int | None = None) -> Quantized:
    """`quantize(zeros(shape), qmap, block, axes)` from the shape alone: every code the one of
    0.0, every scale 0. Quantizing real zeros would keep fp32 temporaries of the leaf's size at
    init (llama-3-8b state creation compiled to 40.5 GiB of temporaries on CPU; with this, 0.58)."""
    code = int(np.sum(_boundaries(qmap) < np.float32(0.0)))  # what _nearest_code gives for 0.0
    view = block_view(shape, block_axes(shape, block) if axes is None else axes)
    nb = -(-view[-1] // _block_size(view, block))
    return Quantized(codes=jnp.full(shape, code, jnp.uint8),
                     scale=jnp.zeros(view[:-1] + (nb,), jnp.float32), block=block)


def dequantize(q: Quantized, qmap: np.ndarray) -> jax.Array:
    """fp32 values of `q`, shape q.codes.shape (the inverse of `quantize` up to the map's
    resolution: within half a map gap times the block's absmax)."""
    view = block_view(q.codes.shape, _axes(q))
    b = _block_size(view, q.block)
    values = jnp.asarray(qmap, jnp.float32)[q.codes.astype(jnp.int32)].reshape(view)
    vb, pad = _blocks(values, b)                                     # [..., nb, b]
    out = (vb * q.scale[..., None]).reshape(vb.shape[:-2] + (-1,))
    return (out[..., : view[-1]] if pad else out).reshape(q.codes.shape)


def keep_small_fp32(path, leaf) -> bool:
    """The default `keep_fp32` rule: non-float leaves and leaves of fewer than MIN_8BIT_SIZE
    (4096) elements keep fp32 moments (bitsandbytes' `min_8bit_size`). `path` is unused."""
    del path
    return not jnp.issubdtype(leaf.dtype, jnp.floating) or leaf.size < MIN_8BIT_SIZE


CHUNK = 2**24  # elements per piece of a large leaf's update (a few hundred MB of temporaries)


def moment_pieces(shape, m, chunk: int | None = None) -> tuple[tuple, int, bool]:
    """(rows, n, same): a leaf of `shape` with moments `m` is updated as n equal row pieces of
    the shape `rows` (its `moment_view`, the last axis possibly cut into rows of c elements),
    each <= `chunk` elements (None: row_chunks' default) and holding whole blocks.

    `same`: the pieces are the elements of `row_chunks(shape)`'s row pieces, so stochastic
    rounding per piece draws `apply_updates_sr`'s bits (jax.random.bits does not depend on the
    shape it fills). Always where blocks run along the last axis; for flat blocks where c can be
    a multiple of the block that divides both a piece and the view's last axis. Else (a tensor
    whose size is not a multiple of the block) n = row_chunks(view), same False."""
    view = moment_view(shape, m)
    n = row_chunks(shape, chunk)
    if not isinstance(m, Quantized):
        return tuple(shape), n, True
    size, last = int(np.prod(shape, dtype=np.int64)), view[-1]
    piece = size // n
    if piece % last == 0:
        return view, n, True
    c = math.gcd(piece, last)
    if last % m.block == 0 and c % m.block == 0:
        return view[:-1] + (last // c, c), n, True
    return view, row_chunks(view, chunk), n == 1


def as_rows(tree, last: int, n: int | None = None):
    """The arrays of `tree` (a leaf, its gradient, its `Quantized` or fp32 moments) as rows of
    `last` elements (the last axis of `moment_pieces`' rows): [rows, last], or with `n`
    [n, rows / n, last]; a `Quantized`'s scale as the rows of their blocks ([rows, nb] or
    [n, rows / n, nb]), so that row i of the codes and row i of the scale belong together."""
    lead = (-1,) if n is None else (n, -1)

    def one(x):
        if isinstance(x, Quantized):
            nb = -(-last // min(x.block, last))
            return Quantized(codes=x.codes.reshape(lead + (last,)),
                             scale=x.scale.reshape(lead + (nb,)), block=x.block)
        return x.reshape(lead + (last,))
    return jax.tree_util.tree_map(one, tree, is_leaf=lambda x: isinstance(x, Quantized))


class ScaleByAdam8bitState(NamedTuple):
    """State of `scale_by_adam_8bit` (and the first link of `adamw_8bit`'s chain).

    count: int32 scalar, updates taken (Adam's t, for the bias corrections).
    mu: the first moments, params' structure: per leaf a `Quantized` (SIGNED_MAP) or, where
      `keep_fp32` held, an fp32 array of the param's shape.
    nu: the second moments, the same way (UNSIGNED_MAP).
    """

    count: jax.Array
    mu: Any
    nu: Any


def _is_q(x) -> bool:
    return isinstance(x, Quantized)


def bias_corrections(count: jax.Array, b1: float, b2: float) -> tuple[jax.Array, jax.Array]:
    """Adam's 1 - b^t for both moments (fp32), t = the updated count."""
    return 1 - jnp.asarray(b1, jnp.float32) ** count, 1 - jnp.asarray(b2, jnp.float32) ** count


def adam_piece(g, m, v, c1, c2, b1: float, b2: float, eps: float, salt=None):
    """One Adam step on (a piece of) a leaf: g any float dtype; m, v Quantized or fp32 arrays of
    g's shape; `salt` (`step_salt`) rounds the new 8-bit moments stochastically, None to the
    nearest. Returns (update in promote(g.dtype, bf16), new m, new v); fp32 math throughout.
    Shared by `scale_by_adam_8bit` and in-place updates built on it (jaxmem's trainer), so the
    two give bitwise the same moments and updates."""
    g32 = g.astype(jnp.float32)
    m32 = dequantize(m, SIGNED_MAP) if _is_q(m) else m
    v32 = dequantize(v, UNSIGNED_MAP) if _is_q(v) else v
    m32 = b1 * m32 + (1 - b1) * g32
    v32 = b2 * v32 + (1 - b2) * g32 * g32
    u = (m32 / c1) / (jnp.sqrt(v32 / c2) + eps)
    salt_v = None if salt is None else _fmix32(salt + np.uint32(1))
    new_m = quantize(m32, SIGNED_MAP, m.block, _axes(m), salt) if _is_q(m) else m32
    new_v = quantize(v32, UNSIGNED_MAP, v.block, _axes(v), salt_v) if _is_q(v) else v32
    return u.astype(jnp.promote_types(g.dtype, jnp.bfloat16)), new_m, new_v


KeepFp32 = Callable[[Any, jax.Array], bool]


LayerAxes = Callable[[Any, jax.Array], int]


def scale_by_adam_8bit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
                       keep_fp32: KeepFp32 | None = None, block_size: int = BLOCK,
                       layer_axes: LayerAxes | None = None,
                       stochastic_moments: bool = True) -> optax.GradientTransformation:
    """`optax.scale_by_adam` with both moments in 8 bits; bias-corrected, no `eps_root`.

    Args:
      b1, b2, eps: Adam's decay rates and denominator epsilon.
      keep_fp32: `(path, leaf) -> bool`, path as `jax.tree_util.tree_map_with_path` gives it:
        True keeps that leaf's moments in fp32. None: `keep_small_fp32`.
      block_size: elements per absmax block (laid out by `block_axes`).
      layer_axes: `(path, leaf) -> int`: how many leading axes of that leaf index separate
        tensors (a scanned stack of layers), which no block spans. None: 0 for every leaf.
      stochastic_moments: round the requantized moments stochastically (unbiased; the default),
        or to the nearest map value (False: bitsandbytes' rule). See `adamw_8bit`.

    Returns:
      A GradientTransformation whose state is `ScaleByAdam8bitState`; updates come out in
      promote(grad dtype, bf16).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    keep = keep_small_fp32 if keep_fp32 is None else keep_fp32

    def init_fn(params):
        def zeros(path, p, qmap):
            if not jnp.issubdtype(p.dtype, jnp.floating) or p.ndim == 0 or keep(path, p):
                return jnp.zeros(p.shape, jnp.float32)
            lead = 0 if layer_axes is None else layer_axes(path, p)
            return quantized_zeros(p.shape, qmap, block_size,
                                   block_axes(p.shape, block_size, lead))
        mu = jax.tree_util.tree_map_with_path(lambda k, p: zeros(k, p, SIGNED_MAP), params)
        nu = jax.tree_util.tree_map_with_path(lambda k, p: zeros(k, p, UNSIGNED_MAP), params)
        return ScaleByAdam8bitState(count=jnp.zeros((), jnp.int32), mu=mu, nu=nu)

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_int32_increment(state.count)
        c1, c2 = bias_corrections(count, b1, b2)
        salt = step_salt(count) if stochastic_moments else None

        def chunk(g, m, v):
            return adam_piece(g, m, v, c1, c2, b1, b2, eps, salt)

        def one(g, m, v):
            # Dequantize, Adam and quantize again cannot all fuse into one loop (the new absmax
            # is a reduction over what the loop computes), so XLA keeps fp32 temporaries of the
            # leaf's size: 16 B/element measured on CPU for a [2, 4096, 14336] leaf, 8 when
            # mapped over pieces of <= CHUNK elements (`moment_pieces`)
            rows, n, _ = moment_pieces(g.shape, m, CHUNK) if _is_q(m) else (g.shape, 1, True)
            if n == 1:
                return chunk(g, m, v)
            # the gradient enters the loop as raw bits (jaxmem.bits says why)
            out = jax.lax.map(lambda a: chunk(from_bits(a[0], g.dtype), *a[1:]),
                              as_rows((to_bits(g), m, v), rows[-1], n))
            return jax.tree_util.tree_map(lambda x, ref: x.reshape(ref.shape), out, (g, m, v))

        out = jax.tree_util.tree_map(one, updates, state.mu, state.nu)
        treedef = jax.tree_util.tree_structure(updates)
        flat = treedef.flatten_up_to(out)
        new_u = treedef.unflatten([t[0] for t in flat])
        mu = treedef.unflatten([t[1] for t in flat])
        nu = treedef.unflatten([t[2] for t in flat])
        return new_u, ScaleByAdam8bitState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


def adamw_8bit(learning_rate: float | optax.Schedule, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8, weight_decay: float = 1e-4,
               mask: Any | Callable[[Any], Any] | None = None, *, keep_fp32: KeepFp32 | None = None,
               block_size: int = BLOCK, layer_axes: LayerAxes | None = None,
               stochastic_moments: bool = True) -> optax.GradientTransformation:
    r"""AdamW with both moments stored in 8 bits (block-wise dynamic quantization).

    `optax.adamw` with each moment dequantized to fp32 for the update and quantized again after it.
    With :math:`Q` the block-wise quantization (absmax per `block_size` elements, nearest of 256
    map values, a positive :math:`v` never 0) and :math:`\eta_t` the learning rate:

    .. math::
      m_t = \beta_1 Q^{-1}(\hat m_{t-1}) + (1 - \beta_1) g_t,\quad
      v_t = \beta_2 Q^{-1}(\hat v_{t-1}) + (1 - \beta_2) g_t^2,\\
      \hat m_t = Q(m_t),\quad \hat v_t = Q(v_t),\\
      u_t = -\eta_t \left( \frac{m_t / (1 - \beta_1^t)}{\sqrt{v_t / (1 - \beta_2^t)} + \epsilon}
            + \lambda \theta_{t-1} \right)

    (:math:`\lambda` only where `mask` is True). State per quantized leaf: 1 B/element per
    moment + 4 B per block, ~2.03 B/param for both at block 256 (optax.adamw: 8).

    Args:
      learning_rate: a float or an optax schedule (step -> learning rate).
      b1, b2: exponential decay rates of the first and the second moment.
      eps: added to the denominator's square root.
      weight_decay: decoupled weight decay rate (:math:`\lambda`).
      mask: as optax.adamw's: a pytree of bools of params' structure, or a callable
        params -> such a pytree; True where weight decay applies. None: everywhere.
      keep_fp32: `(path, leaf) -> bool` (path as `jax.tree_util.tree_map_with_path` gives it);
        True keeps that leaf's moments in fp32. None: `keep_small_fp32`.
      block_size: elements per absmax block (bitsandbytes: 256), laid out by `block_axes`:
        along the last axis where it is a multiple or a divisor of `block_size`, else
        bitsandbytes' flat blocks of consecutive elements.
      layer_axes: `(path, leaf) -> int`, leading axes no block spans (a stack of layers:
        bitsandbytes sees each layer as its own tensor). None: 0.

    Returns:
      `optax.chain(scale_by_adam_8bit(...), add_decayed_weights(weight_decay, mask),
      scale_by_learning_rate(lr))`, state that chain's tuple (first `ScaleByAdam8bitState`);
      it composes like any optax transformation (chain, schedules, masked, MultiSteps).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from jaxmem.optim import adamw_8bit
      >>> params = {"w": jnp.ones((64, 128)), "b": jnp.zeros(128)}
      >>> tx = optax.chain(optax.clip_by_global_norm(1.0), adamw_8bit(1e-3))
      >>> state = tx.init(params)
      >>> state[1][0].mu["w"].codes.dtype, state[1][0].mu["b"].dtype   # "b" < 4096 elements
      (dtype('uint8'), dtype('float32'))
      >>> grads = jax.tree.map(jnp.ones_like, params)
      >>> updates, state = tx.update(grads, state, params)
      >>> params = optax.apply_updates(params, updates)
      >>> round(float(params["w"][0, 0]), 6)    # 1 - 1e-3 * (1 / (1 + 1e-8) + 1e-4 * 1)
      0.999

    References:
      Dettmers et al., `8-bit Optimizers via Block-wise Quantization
      <https://arxiv.org/abs/2110.02861>`_, ICLR 2022.
      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019.
    """
    return optax.chain(scale_by_adam_8bit(b1, b2, eps, keep_fp32=keep_fp32, block_size=block_size,
                                          layer_axes=layer_axes,
                                          stochastic_moments=stochastic_moments),
                       optax.add_decayed_weights(weight_decay, mask),
                       optax.scale_by_learning_rate(learning_rate))
