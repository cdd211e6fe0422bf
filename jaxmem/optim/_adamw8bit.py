"""8-bit AdamW: both moments stored in 8 bits with block-wise dynamic quantization.

Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (arXiv 2110.02861):

    state leaf  -> Quantized(codes uint8 [same shape as the param], scale fp32 [..., nblocks])
    value       =  MAP[codes] * scale[block]        block = BLOCK consecutive elements of the
                                                    param's last axis (the last block may be short)
    m (signed)  uses SIGNED_MAP   = create_dynamic_map(signed=True)   (bitsandbytes' "dynamic")
    v (>= 0)    uses UNSIGNED_MAP = create_dynamic_map(signed=False)  (bitsandbytes' "udynamic")

Each step dequantizes a leaf's moments to fp32, does the Adam update in fp32, and quantizes them
again with a fresh absmax per block (nearest map value). A linear int8 map for the second moment
diverges (its small values all round to zero and the update blows up), so none is offered.

Which leaves stay fp32 (`keeps_fp32`): embeddings (the paper's stable-embedding finding), and
tensors with fewer than MIN_8BIT_SIZE elements (bitsandbytes' 4096 threshold: norm scales and
other small vectors, where the scales would cost more than they save), both through
jaxmem.model.roles.

Layout for sharding: `codes` has exactly the param's shape and `scale` the param's shape with the
last axis replaced by its number of blocks, so a sharding rule written for a param applies to its
codes as is, and to its scale on every axis but the last. All leaves are ordinary arrays in a
`Quantized` pytree node (a flax struct), so jit, lax.cond and Orbax treat them like any other.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from jaxmem.model.roles import param_role
from jaxmem.train.stochastic import row_chunks

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
    """One moment tensor in 8 bits: codes index the map; scale is each block's absmax."""

    codes: jax.Array  # uint8, the param's shape
    scale: jax.Array  # fp32, param.shape[:-1] + (ceil(last / BLOCK),)


def _blocks(x: jax.Array, block: int) -> tuple[jax.Array, int]:
    """x [..., n] -> [..., nb, block] (zero-padded), and the padding."""
    n = x.shape[-1]
    nb = -(-n // block)
    pad = nb * block - n
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(x.shape[:-1] + (nb, block)), pad


def _block_size(shape) -> int:
    return min(BLOCK, shape[-1]) if shape else 1


def _nearest_code(normed: jax.Array, qmap: np.ndarray) -> jax.Array:
    """Index of the nearest value of the sorted 256-entry `qmap`: the number of decision
    boundaries (midpoints) below each value, found by a binary search unrolled into 8
    elementwise steps. jnp.searchsorted runs a while loop over the whole array, which XLA cannot
    fuse: on llama-3-8b's shapes it kept ~37 B/param of temporaries; this is one fused loop."""
    mids = jnp.asarray(np.append((qmap[1:] + qmap[:-1]) / 2, np.inf), jnp.float32)  # [256]
    idx = jnp.where(mids[127] < normed, 128, 0)  # the first step compares with one constant
    for step in (64, 32, 16, 8, 4, 2, 1):
        below = mids[idx + (step - 1)] < normed  # mids[255] = inf: never below
        idx = jnp.where(below, idx + step, idx)
    return idx


def quantize(x: jax.Array, qmap: np.ndarray) -> Quantized:
    """Block-wise absmax + nearest value of `qmap` (sorted); x of any shape with ndim >= 1."""
    block = _block_size(x.shape)
    xb, pad = _blocks(x.astype(jnp.float32), block)                 # [..., nb, block]
    scale = jnp.max(jnp.abs(xb), axis=-1)                            # [..., nb]
    normed = xb / jnp.where(scale == 0, 1.0, scale)[..., None]       # in [-1, 1]
    idx = _nearest_code(normed, qmap).astype(jnp.uint8)
    codes = idx.reshape(idx.shape[:-2] + (-1,))
    if pad:
        codes = codes[..., : x.shape[-1]]
    return Quantized(codes=codes, scale=scale)


def quantized_zeros(shape, qmap: np.ndarray) -> Quantized:
    """`quantize(zeros(shape), qmap)` from the shape alone: every code the one of 0.0, every
    scale 0. The quantize itself kept fp32 temporaries of the leaf's size at init (llama-3-8b
    state creation compiled to 40.5 GiB of temporaries on CPU; with this, 0.58)."""
    mids = np.append((qmap[1:] + qmap[:-1]) / 2, np.inf).astype(np.float32)
    code = int(np.sum(mids < np.float32(0.0)))  # what _nearest_code gives for 0.0
    nb = -(-shape[-1] // _block_size(shape))
    return Quantized(codes=jnp.full(shape, code, jnp.uint8),
                     scale=jnp.zeros(tuple(shape[:-1]) + (nb,), jnp.float32))


def dequantize(q: Quantized, qmap: np.ndarray) -> jax.Array:
    """fp32 values of `q` (the inverse of `quantize` up to the map's resolution)."""
    block = _block_size(q.codes.shape)
    values = jnp.asarray(qmap, jnp.float32)[q.codes.astype(jnp.int32)]
    vb, pad = _blocks(values, block)                                 # [..., nb, block]
    out = (vb * q.scale[..., None]).reshape(vb.shape[:-2] + (-1,))
    return out[..., : q.codes.shape[-1]] if pad else out


def keeps_fp32(path, leaf) -> bool:
    """Does this parameter keep fp32 moments? Embeddings, small tensors, non-float leaves."""
    if not jnp.issubdtype(leaf.dtype, jnp.floating) or leaf.ndim == 0:
        return True
    return param_role(path) == "embedding" or leaf.size < MIN_8BIT_SIZE


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
CHUNK = 2**24  # elements per piece of a large leaf's update (a few hundred MB of temporaries)


def _num_chunks(shape) -> int:
    """Pieces of a leaf's rows for its update (jaxmem.train.stochastic.row_chunks).

    Dequantize, Adam and quantize again cannot all fuse into one loop (the new absmax is a
    reduction over what the loop computes), so XLA keeps fp32 temporaries of the size of the
    leaf: 16 B/element measured on CPU for a [2, 4096, 14336] leaf, 8 when mapped over pieces
    of <= CHUNK elements (blocks run along the last axis, so a piece holds whole blocks)."""
    return row_chunks(shape, CHUNK)


class ScaleByAdam8bitState(NamedTuple):
    count: jax.Array  # int32
    mu: Any           # per param: Quantized (SIGNED_MAP) or fp32 array
    nu: Any           # per param: Quantized (UNSIGNED_MAP) or fp32 array


def _is_q(x) -> bool:
    return isinstance(x, Quantized)


def bias_corrections(count: jax.Array, b1: float, b2: float) -> tuple[jax.Array, jax.Array]:
    """Adam's 1 - b^t for both moments (fp32), t = the updated count."""
    return 1 - jnp.asarray(b1, jnp.float32) ** count, 1 - jnp.asarray(b2, jnp.float32) ** count


def adam_piece(g, m, v, c1, c2, b1: float, b2: float, eps: float):
    """One Adam step on (a piece of) a leaf: g any float dtype; m, v Quantized or fp32 arrays of
    g's shape. Returns (update in promote(g.dtype, bf16), new m, new v); fp32 math throughout.
    Shared by `scale_by_adam_8bit` and the fused in-place update (jaxmem.train.fused8bit), so the
    two give bitwise the same moments and updates."""
    g32 = g.astype(jnp.float32)
    m32 = dequantize(m, SIGNED_MAP) if _is_q(m) else m
    v32 = dequantize(v, UNSIGNED_MAP) if _is_q(v) else v
    m32 = b1 * m32 + (1 - b1) * g32
    v32 = b2 * v32 + (1 - b2) * g32 * g32
    u = (m32 / c1) / (jnp.sqrt(v32 / c2) + eps)
    new_m = quantize(m32, SIGNED_MAP) if _is_q(m) else m32
    new_v = quantize(v32, UNSIGNED_MAP) if _is_q(v) else v32
    return u.astype(jnp.promote_types(g.dtype, jnp.bfloat16)), new_m, new_v


def scale_by_adam_8bit(b1: float = 0.9, b2: float = 0.999,
                       eps: float = 1e-8) -> optax.GradientTransformation:
    """optax.scale_by_adam with both moments in 8 bits (fp32 where `keeps_fp32`); bias-corrected."""

    def init_fn(params):
        def zeros(path, p, qmap):
            if keeps_fp32(path, p):
                return jnp.zeros(p.shape, jnp.float32)
            return quantized_zeros(p.shape, qmap)
        mu = jax.tree_util.tree_map_with_path(lambda k, p: zeros(k, p, SIGNED_MAP), params)
        nu = jax.tree_util.tree_map_with_path(lambda k, p: zeros(k, p, UNSIGNED_MAP), params)
        return ScaleByAdam8bitState(count=jnp.zeros((), jnp.int32), mu=mu, nu=nu)

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_int32_increment(state.count)
        c1, c2 = bias_corrections(count, b1, b2)

        def chunk(g, m, v):
            return adam_piece(g, m, v, c1, c2, b1, b2, eps)

        def one(g, m, v):
            n = _num_chunks(g.shape) if _is_q(m) else 1
            if n == 1:
                return chunk(g, m, v)
            lead = g.shape[:-1]  # rows [..] -> [n, rows / n]; codes [.., last], scale [.., nb]
            split = lambda x: x.reshape((n, -1, x.shape[-1]))  # noqa: E731
            # the gradient enters the loop as raw bits: given as bf16, XLA hoisted its fp32
            # convert out of the loop, a whole-leaf 4 B/element buffer
            bits = jax.lax.bitcast_convert_type(g, _UINT[g.dtype.itemsize])
            out = jax.lax.map(
                lambda a: chunk(jax.lax.bitcast_convert_type(a[0], g.dtype), *a[1:]),
                jax.tree_util.tree_map(split, (bits, m, v)))
            return jax.tree_util.tree_map(lambda x: x.reshape(lead + x.shape[-1:]), out)

        out = jax.tree_util.tree_map(one, updates, state.mu, state.nu)
        treedef = jax.tree_util.tree_structure(updates)
        flat = treedef.flatten_up_to(out)
        new_u = treedef.unflatten([t[0] for t in flat])
        mu = treedef.unflatten([t[1] for t in flat])
        nu = treedef.unflatten([t[2] for t in flat])
        return new_u, ScaleByAdam8bitState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


def adamw_8bit(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
               weight_decay: float = 1e-4, mask=None) -> optax.GradientTransformation:
    """optax.adamw with 8-bit moments: the same chain (adam, decoupled decay, -lr)."""
    return optax.chain(scale_by_adam_8bit(b1, b2, eps),
                       optax.add_decayed_weights(weight_decay, mask),
                       optax.scale_by_learning_rate(learning_rate))
