"""Where a part of an optimizer's leaf lives and how it is cut out and written back: columns of a
leaf, a slab of one layer of a stacked leaf (a Quantized state's codes cut with their blocks'
scales), and the moves between pinned host memory and the device (jaxmem.optim._partwise's
parts, the in-backward step, jaxmem.model.fetch)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem.optim._adamw8bit import Quantized


def cut_cols(x, start, w):
    """Columns [start, start + w) of a state array; of a Quantized its codes and their blocks'
    scales (w and start multiples of its block)."""
    if isinstance(x, Quantized):
        return Quantized(codes=cols(x.codes, start, w),
                         scale=cols(x.scale, start // x.block, w // x.block), block=x.block)
    return cols(x, start, w)


def paste_cols(x, y, start):
    """`x` with `cut_cols`' columns from `start` replaced by `y`, in place."""
    if isinstance(x, Quantized):
        return Quantized(codes=put_cols(x.codes, y.codes, start),
                         scale=put_cols(x.scale, y.scale, start // x.block), block=x.block)
    return put_cols(x, y, start)


def slab_at(x, l, axis: int, start, w: int, y=None):
    """Indices [start, start + w) along `axis` of layer `l` of a stacked array x ([L, ...]), as
    [1, ...], or, given y, x with them replaced by y in place; of a Quantized its codes and
    their blocks' scales (blocks along the last axis: start and w multiples of its block
    there)."""
    if isinstance(x, Quantized):
        last = axis == x.codes.ndim - 1
        b = x.block if last else 1
        ys = (None, None) if y is None else (y.codes, y.scale)
        return Quantized(codes=slab_at(x.codes, l, axis, start, w, ys[0]),
                         scale=slab_at(x.scale, l, axis, start // b, w // b, ys[1]),
                         block=x.block)
    at = [jnp.asarray(0, jnp.int32)] * x.ndim
    at[0], at[axis] = jnp.asarray(l, jnp.int32), jnp.asarray(start, jnp.int32)
    if y is not None:
        return jax.lax.dynamic_update_slice(x, y.astype(x.dtype), at)
    return jax.lax.dynamic_slice(x, at, (1,) + tuple(w if a == axis else n
                                                     for a, n in enumerate(x.shape) if a))


def cols(x, start, w: int):
    """Columns [start, start + w) of x (its last axis)."""
    return jax.lax.dynamic_slice_in_dim(x, start, w, x.ndim - 1)


def put_cols(x, y, start):
    """x with columns [start, start + y's width) replaced by y, in place."""
    return jax.lax.dynamic_update_slice_in_dim(x, y, start, x.ndim - 1)


def in_host_memory(x) -> bool:
    """Whether a traced array lives in host memory (its aval's memory space; --offload-optimizer,
    --offload-params and --offload-base host)."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def to_device(x, on_host: bool):
    """x copied to the device where it sits in host memory (`on_host`), else x."""
    return jax.device_put(x, jax.memory.Space.Device) if on_host else x


def to_host(x, on_host: bool):
    """x copied back to host memory where its stack lives there (`on_host`), else x."""
    return jax.device_put(x, jax.memory.Space.Host) if on_host else x
