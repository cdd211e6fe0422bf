"""Block-wise 8-bit quantization of optimizer moments (Dettmers et al. 2022, as bitsandbytes
implements it): bitsandbytes' dynamic maps, the block layout (`block_axes`), and rounding to the
nearest map value or stochastically (`quantize(..., salt=)`). `jaxmem.optim._adamw8bit` builds
8-bit AdamW on it.

    Quantized(codes uint8 [the param's shape], scale fp32 [param.shape[:-k] + (nblocks,)])
    value = MAP[codes] * scale[block]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

BLOCK = 256           # elements per absmax block (bitsandbytes' blockwise optimizers use 256)


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


def _num_blocks(n: int, block: int) -> int:
    """Blocks along an axis of `n` elements (`block` each; one short block when n < block, and
    the last one short when block does not divide n)."""
    return -(-n // min(block, n))


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


def _interval_table(edges: np.ndarray, below) -> tuple[np.ndarray, int]:
    """A search of the sorted `edges` in one gather: for each of the 65,536 intervals of fp32
    values that share their top 16 bits (sign, exponent, 7 mantissa bits), `below(edges, v)`
    at the interval's least value v, and the most edges any interval holds inside it (the
    refinement steps a value of it may need beyond the table's answer). NaN's intervals give 0:
    a NaN compares false with every edge, as in a binary search (a NaN whose top bits are
    inf's, which no arithmetic makes, reads as inf)."""
    bits = np.arange(65536, dtype=np.uint64).astype(np.uint32) << np.uint32(16)
    first, last = bits.view(np.float32), (bits | np.uint32(0xFFFF)).view(np.float32)
    negative = bits >= np.uint32(0x80000000)
    least, most = np.where(negative, last, first), np.where(negative, first, last)
    nan = np.isnan(least)  # a NaN interval; the one starting at inf: inf, then NaNs
    most = np.where(np.isnan(most), least, most)
    # a subnormal interval starts at zero: a device that flushes subnormals (XLA:CPU does)
    # compares them as 0, one that does not finds the edges above 0 in the refinement step
    tiny = np.finfo(np.float32).tiny
    least = np.where(np.abs(least) < tiny, np.float32(0.0), least)
    lo, hi = below(edges, np.where(nan, 0, least)), below(edges, np.where(nan, 0, most))
    return np.where(nan, 0, lo).astype(np.uint8), int(np.max(np.where(nan, 0, hi - lo)))


def take_constant(table: np.ndarray, idx: jax.Array) -> jax.Array:
    """`table[idx]` with `table` a constant of the program: how this module reads its maps and
    code tables unless a caller gives another `take` (the fused update kernel, jaxmem.optim.
    _kernel, reads the same tables from its operands: a kernel captures no array constant)."""
    return jnp.asarray(table)[idx]


def _tabled(normed: jax.Array, table: tuple[np.ndarray, int], edges: np.ndarray,
            step, take=take_constant) -> jax.Array:
    """The table's answer for each value's interval, then its refinement steps (`step(idx,
    edges)`: the next index), all in one fusion: one gather from a 64 KiB constant, where a
    binary search over the 256 entries chained 8 gathers that XLA's GPU fusion would not merge
    (each step's index is read twice), materializing an int32 index array per step. `step(idx,
    at)` reads edge i as at(i)."""
    codes, steps = table
    top = (jax.lax.bitcast_convert_type(normed, jnp.uint32) >> 16).astype(jnp.int32)
    idx = take(codes, top).astype(jnp.int32)
    for _ in range(steps):
        idx = step(idx, lambda i: take(edges, i))
    return idx


def _count_below(edges, v):
    """How many edges are strictly below v (searchsorted, side left), at most 255."""
    return np.minimum(np.searchsorted(edges, v, side="left"), 255)


def _last_at_or_below(edges, v):
    """The last index whose edge is <= v, else 0 (searchsorted, side right, less one)."""
    return np.maximum(np.searchsorted(edges, v, side="right") - 1, 0)


@functools.lru_cache(maxsize=None)
def _tables(which: str) -> dict:
    """The nearest-code and stochastic-code tables of SIGNED_MAP or UNSIGNED_MAP."""
    qmap = {"signed": SIGNED_MAP, "unsigned": UNSIGNED_MAP}[which]
    mids = _boundaries(qmap)
    return {"mids": mids, "nearest": _interval_table(mids, _count_below),
            "lower": _interval_table(qmap, _last_at_or_below)}


def _map_name(qmap: np.ndarray) -> str | None:
    for name, m in (("signed", SIGNED_MAP), ("unsigned", UNSIGNED_MAP)):
        if qmap is m or np.array_equal(qmap, m):
            return name
    return None


def _nearest_code(normed: jax.Array, qmap: np.ndarray, take=take_constant) -> jax.Array:
    """Index of the nearest value of the sorted 256-entry `qmap` (`_boundaries` says the one
    exception): the number of decision boundaries below each value. For the two maps of this
    module a 64 KiB table of the fp32 values' top 16 bits answers it in one gather and one
    comparison (`_tabled`); for any other map, a binary search unrolled into 8 elementwise
    steps. (jnp.searchsorted runs a while loop over the whole array, which XLA cannot fuse: on
    llama-3-8b's shapes it kept ~37 B/param of temporaries.)"""
    name = _map_name(qmap)
    if name is not None:
        t = _tables(name)
        return _tabled(normed, t["nearest"], t["mids"],
                       lambda idx, mids: idx + (mids(idx) < normed), take)  # mids[255] = inf
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


def _stochastic_code(normed: jax.Array, qmap: np.ndarray, salt: jax.Array,
                     take=take_constant) -> jax.Array:
    """Index of one of the two values of the sorted `qmap` around each value, the upper one with
    probability (value - lower) / (upper - lower), so that E[qmap[code]] = value (clamped to the
    map's range). The uniform number is a hash of the value's fp32 bits and `salt`: a function
    of what is rounded, not of where it lies, so an update in row pieces, on shards or layer by
    layer rounds every element as the whole-leaf update does. The lower value is found as in
    `_nearest_code`: a table and one refinement for this module's maps, else a binary search."""
    name = _map_name(qmap)
    if name is not None:  # the table of `_nearest_code`, of the values themselves
        vals = lambda i: take(qmap, i)  # noqa: E731
        lo = _tabled(normed, _tables(name)["lower"], qmap, lambda lo, v: jnp.where(
            v(jnp.minimum(lo + 1, 255)) <= normed, jnp.minimum(lo + 1, 255), lo), take)
    else:
        table = jnp.asarray(qmap, jnp.float32)
        vals = lambda i: table[i]  # noqa: E731
        lo = jnp.where(vals(128) <= normed, 128, 0)
        for step in (64, 32, 16, 8, 4, 2, 1):
            lo = jnp.where(vals(lo + step) <= normed, lo + step, lo)
    hi = jnp.minimum(lo + 1, 255)
    gap = vals(hi) - vals(lo)
    frac = jnp.where(gap > 0, (normed - vals(lo)) / jnp.where(gap > 0, gap, 1.0), 0.0)
    bits = _fmix32(jax.lax.bitcast_convert_type(normed, jnp.uint32) ^ salt)
    uniform = (bits >> 8).astype(jnp.float32) * np.float32(2.0**-24)  # [0, 1)
    idx = jnp.where(uniform < frac, hi, lo)
    if qmap[0] == 0.0:  # as `_boundaries`: a positive second moment never rounds to 0
        idx = jnp.where((normed > 0) & (idx == 0), 1, idx)
    return idx


def quantize(x: jax.Array, qmap: np.ndarray, block: int = BLOCK,
             axes: int | None = None, salt: jax.Array | None = None,
             take=take_constant) -> Quantized:
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
      take: `(table, idx) -> table[idx]` for the maps and code tables (`take_constant`).

    Returns:
      Quantized(codes uint8 x.shape, scale fp32 x.shape[:-axes] + (nblocks,), block).
    """
    axes = block_axes(x.shape, block) if axes is None else axes
    view = block_view(x.shape, axes)
    b = _block_size(view, block)
    xb, pad = _blocks(x.astype(jnp.float32).reshape(view), b)       # [..., nb, b]
    scale = jnp.max(jnp.abs(xb), axis=-1)                            # [..., nb]
    normed = xb / jnp.where(scale == 0, 1.0, scale)[..., None]       # in [-1, 1]
    idx = (_nearest_code(normed, qmap, take) if salt is None
           else _stochastic_code(normed, qmap, salt, take)).astype(jnp.uint8)
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
    nb = _num_blocks(view[-1], block)
    return Quantized(codes=jnp.full(shape, code, jnp.uint8),
                     scale=jnp.zeros(view[:-1] + (nb,), jnp.float32), block=block)


def dequantize(q: Quantized, qmap: np.ndarray, take=take_constant) -> jax.Array:
    """fp32 values of `q`, shape q.codes.shape (the inverse of `quantize` up to the map's
    resolution: within half a map gap times the block's absmax)."""
    view = block_view(q.codes.shape, _axes(q))
    b = _block_size(view, q.block)
    values = take(np.asarray(qmap, np.float32), q.codes.astype(jnp.int32)).reshape(view)
    vb, pad = _blocks(values, b)                                     # [..., nb, b]
    out = (vb * q.scale[..., None]).reshape(vb.shape[:-2] + (-1,))
    return (out[..., : view[-1]] if pad else out).reshape(q.codes.shape)
