"""Frozen int8 / NF4 weights that really are stored in 8 / 4 bits, and multiply without keeping a
dequantized copy for the backward.

    q = quantize_weight(w, kind, n_in, block, double_quant)  one weight -> QuantizedWeight
    w = q.dequantize(dtype)                              back to the dense [in..., out...] array
    y = q.project(subscripts, x, einsum)                 einsum(subscripts, x, dequantize(q))

Layout (per layer; a stacked param carries a leading layer axis L on every leaf, and L is never
a block axis: `quantize_layers` quantizes one layer at a time). The weight [in..., out...] is
viewed as [In, Out] (In = product of the input axes: D for q/k/v/gate/up, N*H for o_proj, F for
down_proj) and cut into blocks of `block` consecutive values along In, one absmax per block and
output column, as bitsandbytes cuts a torch [out, in] weight along its rows:

    codes   [In/block, block, Out]  int8 (round(127 w / absmax)), or for NF4 uint8
            [In/block, block/2, Out]: two 4-bit indices into NF4_CODE per byte
    absmax  [In/block, Out]         float32, or with double quantization:
    absmax_q [n/256, 256] int8, absmax_scale [n/256] float32, absmax_offset [] float32
            (absmax - mean in blocks of 256 with their own absmax, as QLoRA does; linear int8
            codes where bitsandbytes uses its dynamic 8-bit map)

NF4 storage: 4 + 32/64 = 4.5 bits per parameter; with double quantization 4 + 8/64 + 32/(64*256)
= 4.127 (memory_analysis argument bytes: tests/test_quant.py). int8 with block 0 means one
absmax per output column (block = In).

Why nibbles in uint8 and not XLA's uint4: XLA does store uint4 packed, but in a scan over the
layers the CPU compiler converted the whole stacked uint4 array to uint8 before the loop (one
extra byte per parameter of temp memory, +6.5 GiB for Llama-3-8B), where a uint8 array is sliced
per layer as it is and unpacked with two bit operations inside the loop.

Why a custom VJP: without remat, autodiff of `einsum(x, dequantize(q))` keeps each layer's
dequantized weight as a residual for dx = g W^T, which erases the 4-bit saving (measured on a
toy: temp 468 MB vs 329 MB, /work/shared/DESIGN.md). `project` saves only x and the quantized
leaves it already holds, and dequantizes again in the backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.quant._gather import gathered as _gathered

# bitsandbytes' NF4 code values (bitsandbytes/functional.py, get_4bit_type("nf4")): QLoRA's
# quantiles of N(0, 1), normalized to [-1, 1], with an exact zero.
NF4_CODE = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0], np.float32)
KINDS = ("int8", "nf4")
DQ_BLOCK = 256  # double quantization: absmax values per second-level block


LEAF_NAMES = ("codes", "absmax", "absmax_q", "absmax_scale", "absmax_offset")


@jax.tree_util.register_pytree_with_keys_class
class QuantizedWeight:
    """One quantized weight (see the module docstring); a pytree whose leaves are the arrays.

    kind: "int8" or "nf4". shape: the dense weight's shape [in..., out...] (one layer).
    n_in: how many leading axes of `shape` are input axes. block: values per absmax.

    Every array is a named pytree leaf (paths end in .codes, .absmax, .absmax_q, .absmax_scale,
    .absmax_offset), so sharding rules, device_put and checkpoints reach each piece of the
    quantization state; none of it is kept outside the tree (jaxmem.parallel.rules.base_specs).
    """

    def __init__(self, codes, absmax, absmax_q, absmax_scale, absmax_offset, kind, shape, n_in,
                 block):
        self.codes, self.absmax = codes, absmax
        self.absmax_q, self.absmax_scale, self.absmax_offset = absmax_q, absmax_scale, absmax_offset
        self.kind, self.shape, self.n_in, self.block = kind, tuple(shape), n_in, block

    def tree_flatten(self):
        return ((self.codes, self.absmax, self.absmax_q, self.absmax_scale, self.absmax_offset),
                (self.kind, self.shape, self.n_in, self.block))

    def tree_flatten_with_keys(self):
        leaves, aux = self.tree_flatten()
        return tuple((jax.tree_util.GetAttrKey(n), l) for n, l in zip(LEAF_NAMES, leaves)), aux

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        return cls(*leaves, *aux)

    @property
    def double_quant(self) -> bool:
        return self.absmax is None

    def scales(self) -> jax.Array:
        """absmax [In/block, Out] float32 (decoded from its 8-bit form under double quant)."""
        if not self.double_quant:
            return self.absmax.astype(jnp.float32)
        n_blocks, out = _blocks_out(self.shape, self.n_in, self.block)
        flat = (self.absmax_q.astype(jnp.float32) / 127.0
                * self.absmax_scale[:, None].astype(jnp.float32)).reshape(-1)
        return flat[:n_blocks * out].reshape(n_blocks, out) + self.absmax_offset.astype(jnp.float32)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The dense weight of `shape` in `dtype` (values computed in fp32)."""
        if self.kind == "nf4":
            values = jnp.take(jnp.asarray(NF4_CODE), unpack_nibbles(self.codes).astype(jnp.int32))
        else:
            values = self.codes.astype(jnp.float32) / 127.0
        w = values * self.scales()[:, None, :]  # [In/block, block, Out]
        return w.reshape(self.shape).astype(dtype)

    def project(self, subscripts: str, x: jax.Array, einsum) -> jax.Array:
        """einsum(subscripts, x, W) with W dequantized in the forward and again in the backward."""
        leaves, aux = self.tree_flatten()
        return _quantized_einsum(subscripts, einsum, aux, x, leaves)


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """[n, block, Out] values 0..15 -> uint8 [n, block/2, Out]: element 2i in the low nibble,
    2i+1 in the high one."""
    n, b, out = codes.shape
    pairs = codes.reshape(n, b // 2, 2, out)
    return pairs[:, :, 0] | (pairs[:, :, 1] << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
    """Inverse of `pack_nibbles`: uint8 [n, block/2, Out] -> [n, block, Out] values 0..15."""
    n, half, out = packed.shape
    return jnp.stack([packed & 15, packed >> 4], axis=2).reshape(n, 2 * half, out)


def _blocks_out(shape, n_in: int, block: int) -> tuple[int, int]:
    In, Out = int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:]))
    return In // block, Out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _quantized_einsum(subscripts, einsum, aux, x, leaves):
    leaves = _gathered(aux, leaves)
    w = QuantizedWeight.tree_unflatten(aux, leaves).dequantize(x.dtype)
    return einsum(subscripts, x, w)


def _quantized_einsum_fwd(subscripts, einsum, aux, x, leaves):
    return _quantized_einsum(subscripts, einsum, aux, x, leaves), (x, leaves)


def _quantized_einsum_bwd(subscripts, einsum, aux, residuals, g):
    x, leaves = residuals
    w = QuantizedWeight.tree_unflatten(aux, _gathered(aux, leaves)).dequantize(x.dtype)  # again
    _, vjp = jax.vjp(lambda x_: einsum(subscripts, x_, w), x)  # the unused forward is DCE'd
    (dx,) = vjp(g)
    # the base is frozen: zero cotangents (float0 for the integer codes)
    zero = jax.tree_util.tree_map(
        lambda l: np.zeros(l.shape, jax.dtypes.float0) if not jnp.issubdtype(l.dtype, jnp.floating)
        else jnp.zeros_like(l), leaves)
    return dx, zero


_quantized_einsum.defvjp(_quantized_einsum_fwd, _quantized_einsum_bwd)


def quantize_weight(w: jax.Array, kind: str, n_in: int = 1, block: int = 64,
                    double_quant: bool = False) -> QuantizedWeight:
    """Quantize one layer's weight w [in..., out...] (no layer axis); see the module docstring."""
    if kind not in KINDS:
        raise ValueError(f"quantization kind {kind!r} is not one of {', '.join(KINDS)}")
    shape = tuple(w.shape)
    In, Out = int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:]))
    if block == 0:
        if kind == "nf4":
            raise ValueError("NF4 needs a block size (per-output-channel absmax is int8 only)")
        block = In
    if In % block:
        raise ValueError(f"weight of shape {shape}: input size {In} is not a multiple of the "
                         f"quantization block {block}")
    blocks = w.astype(jnp.float32).reshape(In // block, block, Out)  # [In/b, b, Out]
    absmax = jnp.max(jnp.abs(blocks), axis=1)  # [In/b, Out]
    safe = jnp.where(absmax > 0, absmax, 1.0)[:, None, :]
    if kind == "nf4":
        normalized = blocks / safe
        # nearest code value: compare with the 15 midpoints (sorted table)
        mids = jnp.asarray((NF4_CODE[1:] + NF4_CODE[:-1]) / 2)
        codes = pack_nibbles(jnp.sum(normalized[..., None] > mids, axis=-1).astype(jnp.uint8))
    else:
        codes = jnp.clip(jnp.round(blocks / safe * 127.0), -127, 127).astype(jnp.int8)
    if not double_quant:
        return QuantizedWeight(codes, absmax, None, None, None, kind, shape, n_in, block)
    return QuantizedWeight(codes, None, *double_quantize(absmax), kind, shape, n_in, block)


def double_quantize(absmax: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """absmax [...] fp32 -> (absmax_q int8 [n/256, 256], absmax_scale fp32 [n/256], absmax_offset
    fp32 []): the mean subtracted, then 8 bits per value in blocks of DQ_BLOCK (256), as
    bitsandbytes' double quantization; `QuantizedWeight.scales` inverts it."""
    flat = absmax.reshape(-1)
    offset = jnp.mean(flat)
    centred = flat - offset
    pad = (-flat.size) % DQ_BLOCK
    centred = jnp.pad(centred, (0, pad)).reshape(-1, DQ_BLOCK)  # [n/256, 256]
    scale = jnp.max(jnp.abs(centred), axis=1)  # [n/256]
    q = jnp.round(centred / jnp.where(scale > 0, scale, 1.0)[:, None] * 127.0).astype(jnp.int8)
    return q, scale, offset


def quantize_layers(w, kind: str, n_in: int, block: int, double_quant: bool,
                    to_host: bool = False) -> QuantizedWeight:
    """Quantize a stacked weight [L, in..., out...] one layer at a time.

    `w` may be a host (numpy) array: only one layer's full-precision slice is put on the device
    at a time; the result's leaves are the per-layer leaves stacked (4 / 8 bits on the device).
    to_host: return numpy leaves instead, each layer's packed result copied back to the host as
    soon as it is made (what a sharded placement then splits over a mesh: no device ever holds
    more than one layer).
    """
    fn = jax.jit(functools.partial(quantize_weight, kind=kind, n_in=n_in, block=block,
                                   double_quant=double_quant))
    keep = (lambda q: jax.tree.map(np.asarray, q)) if to_host else (lambda q: q)
    layers = [keep(fn(jnp.asarray(w[i]))) for i in range(w.shape[0])]
    stack = np.stack if to_host else jnp.stack
    leaves = [stack(parts) if parts[0] is not None else None
              for parts in zip(*(q.tree_flatten()[0] for q in layers))]
    return QuantizedWeight.tree_unflatten(layers[0].tree_flatten()[1], leaves)


def dequantize_layers(q: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """The dense stacked weight [L, in..., out...] of a stacked QuantizedWeight."""
    return jax.vmap(lambda *leaves: QuantizedWeight.tree_unflatten(
        q.tree_flatten()[1], leaves).dequantize(dtype))(*q.tree_flatten()[0])


def bits_per_param(q: QuantizedWeight) -> float:
    """Storage bits per weight value of one `QuantizedWeight`, counted from its arrays' bytes
    (NF4 4.5, with double quantization 4.127; int8 with blocks of 64: 8.5)."""
    leaves = [l for l in q.tree_flatten()[0] if l is not None]
    bits = sum(l.size * 8 * l.dtype.itemsize for l in leaves)
    values = q.codes.size * (2 if q.kind == "nf4" else 1)  # NF4: two codes per byte
    return bits / values
