"""One leaf of `AdamW8bitInPlace` (jaxmem.optim._fused) updated in place, and its step part by
part: how the optimizer walks a leaf, apart from what a step computes on a piece.

    apply_leaf_in_place(piece, g, m, v, p, decays, leaf_key, finite) -> (new p, new m, new v)
        a leaf through a piece function, in row pieces inside a fori_loop where it is large
    InPlaceParts(opt, state, params, key)
        `AdamW8bitInPlace.split`'s parts (jaxmem.optim.Parts), each through the same function
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem.bits import from_bits, to_bits
import jaxmem.optim._stochastic as sr
from jaxmem.optim._adamw8bit import Quantized, as_rows, moment_pieces
from jaxmem.optim._blockwise import _axes
from jaxmem.optim._cuts import in_host_memory, to_device, to_host
from jaxmem.optim._partwise import Parts, layer_rows


def apply_leaf_in_place(piece, g, m, v, p, decays, leaf_key, finite):
    """One whole leaf through `piece` (from `AdamW8bitInPlace.pieces`) -> (new p, new m, new v).

    A leaf of more than CHUNK elements goes in row pieces (`moment_pieces`: each holds whole
    blocks, and they are `row_chunks(p.shape)`'s but for a tensor whose size is not a multiple
    of the block: then other pieces, and bf16 rounding draws other, equally unbiased, bits than
    `apply_updates_sr`, except when it is updated whole: then it draws that function's), piece
    j with key fold_in(leaf_key, j), inside a fori_loop whose carry (p, m, v) is updated slice by
    slice and that runs no piece where `finite` is False; a smaller one at once (key leaf_key),
    selected with jnp.where. `g` may be a function (n, j) -> piece j of n of the gradient's rows
    (rows [j * rows / n, (j + 1) * rows / n)), so a caller can make each piece where it is used,
    never the whole gradient."""
    rows, n, same = moment_pieces(p.shape, m)
    keys = sr.pieces(leaf_key, p, n=n)
    # --offload-optimizer host: moments in pinned host memory come to the device a piece at a
    # time (the whole leaf where it is one piece) and go back after it
    host = jax.tree_util.tree_map(in_host_memory, (p, m, v))
    fetch = lambda t: jax.tree_util.tree_map(to_device, t, host)  # noqa: E731
    back = lambda t: jax.tree_util.tree_map(to_host, t, host)  # noqa: E731
    if n == 1:
        bits = None
        if not same and keys.key is not None:  # apply_updates_sr's pieces' bits, all at once
            bits = sr.pieces(leaf_key, p).leaf_bits(p.shape)
        p, m, v = fetch((p, m, v))
        out = piece(g(1, 0).reshape(p.shape) if callable(g) else g, m, v, p, decays,
                    None if bits is not None else keys(0), bits)
        return back(jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), out,
                                           (p, m, v)))
    split = lambda x: as_rows(x, rows[-1], n)  # noqa: E731  rows -> [n, rows / n, last]
    # the gradient enters as raw bits, so XLA cannot hoist a whole-leaf fp32 convert out of the loop
    gs = None if callable(g) else split(to_bits(g))

    def body(j, carry):
        take = lambda x: jax.lax.dynamic_index_in_dim(x, j, 0, keepdims=False)  # noqa: E731
        put = lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, j, 0)  # noqa: E731
        pkey = keys(j)
        gj = g(n, j).reshape((-1, rows[-1])) if gs is None else from_bits(take(gs), g.dtype)
        pj, mj, vj = fetch(jax.tree_util.tree_map(take, carry))
        return jax.tree_util.tree_map(put, carry, back(piece(gj, mj, vj, pj, decays, pkey)))

    carry = split((p, m, v))
    trips = jnp.where(finite, n, 0)  # a skipped step runs no piece: the carry stays bitwise
    out = jax.lax.fori_loop(0, trips, body, carry)
    return jax.tree_util.tree_map(lambda x, ref: x.reshape(ref.shape), out, (p, m, v))


class InPlaceParts(Parts):
    """`AdamW8bitInPlace.split`'s parts: each goes through `pieces`' piece function."""

    def __init__(self, opt, state, params, key):
        super().__init__(params, key)
        self.piece, self._finish = opt.pieces(state)
        adam = opt.moments(state)
        self.states = list(zip(self.treedef.flatten_up_to(adam.mu),
                               self.treedef.flatten_up_to(adam.nu)))
        self.decays = self.treedef.flatten_up_to(opt.decays(params))

    def leaf(self, i, g, p, s, finite):
        new_p, m, v = apply_leaf_in_place(self.piece, g, *s, p, self.decays[i],
                                          self.pieces(i).key, finite)
        return new_p, (m, v)

    def layer(self, i, l, g, p, s, finite, fetched=None):
        def fn(ins, st, pkey, bits):
            (g,), (p, m, v) = ins, st
            return self.piece(g, m, v, p, self.decays[i], pkey, bits)

        # moments block-wise along the last axis: a layer's rows hold whole blocks, and the
        # codes [L, ..., last] and scales [L, ..., nb] are cut by layer like the weights
        rows, n, _ = moment_pieces(p.shape, s[0])
        new_p, m, v = layer_rows(fn, (g,), (p, *s), l, rows, self.pieces(i, n), finite,
                                 fetched)
        return new_p, (m, v)

    def column_block(self, i):
        m = self.states[i][0]
        shape = self.leaves[i].shape
        if len(shape) != 2 or not isinstance(m, Quantized):
            return super().column_block(i)
        # blocks along the last axis, whole in every column slice of a multiple of the block
        return m.block if _axes(m) == 1 and shape[-1] % m.block == 0 else None

    def slab_block(self, i, axis):
        m, shape = self.states[i][0], self.leaves[i].shape
        if not 0 < axis < len(shape) or not isinstance(m, Quantized):
            return super().slab_block(i, axis)
        if _axes(m) != 1:  # blocks over several axes: not cut here
            return None
        if axis < len(shape) - 1:
            return 1
        return m.block if shape[-1] % m.block == 0 else None

    def _column_update(self, i, g, p, s, key):
        new_p, m, v = self.piece(g, *s, p, self.decays[i], key)
        return new_p, (m, v)

    def finish(self, states):
        return self._finish(self.treedef.unflatten([s[0] for s in states]),
                            self.treedef.unflatten([s[1] for s in states]), jnp.asarray(True))
