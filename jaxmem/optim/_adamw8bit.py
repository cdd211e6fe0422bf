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

from jaxmem.bits import from_bits, to_bits
from jaxmem.optim._blockwise import (BLOCK, SIGNED_MAP, UNSIGNED_MAP, Quantized, _axes,
                                     _fmix32, block_axes, dequantize, moment_view, _num_blocks,
                                     quantize, quantized_zeros, step_salt, take_constant)
from jaxmem.optim._stochastic import row_chunks

MIN_8BIT_SIZE = 4096  # smaller tensors keep fp32 states (bitsandbytes' min_8bit_size)


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
            return Quantized(codes=x.codes.reshape(lead + (last,)),
                             scale=x.scale.reshape(lead + (_num_blocks(last, x.block),)),
                             block=x.block)
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


def adam_piece(g, m, v, c1, c2, b1: float, b2: float, eps: float, salt=None,
               take=take_constant):
    """One Adam step on (a piece of) a leaf: g any float dtype; m, v Quantized or fp32 arrays of
    g's shape; `salt` (`step_salt`) rounds the new 8-bit moments stochastically, None to the
    nearest. Returns (update in promote(g.dtype, bf16), new m, new v); fp32 math throughout.
    Shared by `scale_by_adam_8bit` and in-place updates built on it (jaxmem's trainer), so the
    two give bitwise the same moments and updates. `take`: how the maps are read (`quantize`)."""
    g32 = g.astype(jnp.float32)
    m32 = dequantize(m, SIGNED_MAP, take) if _is_q(m) else m
    v32 = dequantize(v, UNSIGNED_MAP, take) if _is_q(v) else v
    m32 = b1 * m32 + (1 - b1) * g32
    v32 = b2 * v32 + (1 - b2) * g32 * g32
    u = (m32 / c1) / (jnp.sqrt(v32 / c2) + eps)
    salt_v = None if salt is None else _fmix32(salt + np.uint32(1))
    new_m = quantize(m32, SIGNED_MAP, m.block, _axes(m), salt, take) if _is_q(m) else m32
    new_v = quantize(v32, UNSIGNED_MAP, v.block, _axes(v), salt_v, take) if _is_q(v) else v32
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
