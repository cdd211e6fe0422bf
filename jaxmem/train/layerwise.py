"""The optimizer applied one part of the params at a time: a layer of the stacked block params,
or one of the leaves outside the stack (embedding, final norm, LM head). What
`--optimizer-in-backward` (jaxmem.train.inbackward) calls as each part's gradient appears.

    updater = LayerwiseUpdate(cfg, optimizer, params, opt_state, key)
    new_leaf_state = updater.leaf(i, g, leaf_state)             a leaf outside the stack
    new_stack_state = updater.layer(l, grads_l, stack_state)    layer l of every stacked leaf
    new_opt_state = updater.finish(leaf and stack states)        counts advanced once

Every number is the one the whole-tree step computes (jaxmem.optim.AdamW8bitInPlace and
jaxmem.optim.as_optimizer), because each piece goes through the same code with the same inputs:

- 8-bit AdamW: `AdamW8bitInPlace.pieces`, the whole-tree update's own piece function. Its
  moments are block-wise along the last axis, so a layer's rows hold whole blocks; a stacked
  leaf's codes [L, ..., last] and scales [L, ..., nb] are sliced by layer like the weights.
- any other optimizer (adamw, lion): the optax transformation's `update` on the part's subtree
  (its state's params-shaped subtrees cut to the part; the step counts read from the state as
  it was before the step, so every part sees the same count), then the same application.
- bf16-sr: a stacked leaf's random bits are those of the whole-tree update: leaf i draws from
  fold_in(key, i), and a leaf over 2^24 elements is rounded in row pieces j with
  fold_in(fold_in(key, i), j) (jaxmem.optim.apply_updates_sr's scheme). Where a layer's rows
  are whole pieces, its pieces are updated one at a time with their own keys; otherwise the
  piece's bits are drawn and the layer's rows cut out of them (`_layer_rows`).

The stacked arrays are updated with dynamic_update_slice, so inside a loop whose carry holds
them XLA writes each layer into the donated state's buffers (no second copy of the params).
A part whose gradients are not all finite is left unchanged (`finite`), weights and moments.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from jaxmem.optim import (apply_leaf_in_place, apply_leaf_sr, as_rows, moment_pieces,
                          round_bf16, round_bf16_bits, row_chunks)
from jaxmem.train.optim import OptimConfig, RunOptimizer, decay_mask


def _is_stacked(path) -> bool:
    return getattr(path[0], "key", None) == "layers"


class LayerwiseUpdate:
    """One optimizer step, part by part (module docstring). Built inside the jitted step.

    Leaves are numbered as in `jax.tree_util.tree_flatten(params)` (the whole-tree update's
    order, which its random keys follow); `stacked` lists the indices under "layers".
    A leaf's state is (m, v) for 8-bit AdamW, or its slice of each params-shaped subtree of the
    optax state for the others (a tuple of arrays, one per subtree).
    """

    def __init__(self, cfg: OptimConfig, optimizer: RunOptimizer, params, opt_state,
                 key: jax.Array | None):
        self.cfg = cfg
        self.key = key if optimizer.stochastic_rounding else None
        self.rounds = optimizer.stochastic_rounding
        paths_leaves, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        self.paths = [p for p, _ in paths_leaves]
        self.shapes = [x.shape for _, x in paths_leaves]
        self.dtypes = [x.dtype for _, x in paths_leaves]
        self.decays = self.treedef.flatten_up_to(decay_mask(params, cfg.decay_embeddings))
        self.stacked = [i for i, p in enumerate(self.paths) if _is_stacked(p)]
        self.eight_bit = optimizer.in_place is not None
        self.state = opt_state
        if self.eight_bit:
            self.opt8 = optimizer.in_place
            self.piece, self._finish8 = self.opt8.pieces(opt_state)
        else:
            self.tx = optimizer.tx
            self._keys = set(params)

    # ------------------------------------------------------------------ the state, per leaf

    def leaf_states(self) -> list:
        """Per leaf, its optimizer state (see the class docstring)."""
        if self.eight_bit:
            adam = self.opt8.moments(self.state)
            return list(zip(self.treedef.flatten_up_to(adam.mu),
                            self.treedef.flatten_up_to(adam.nu)))
        subtrees = []
        self._walk(self.state, lambda j, node: subtrees.append(node) or node)
        cols = [self.treedef.flatten_up_to(t) for t in subtrees]
        return [tuple(c[i] for c in cols) for i in range(len(self.paths))]

    def finish(self, leaf_states: list):
        """The new optimizer state from every leaf's new state, the counts advanced once."""
        if self.eight_bit:
            mu = self.treedef.unflatten([s[0] for s in leaf_states])
            nu = self.treedef.unflatten([s[1] for s in leaf_states])
            return self._finish8(mu, nu, jnp.asarray(True))
        state = self._walk(self.state, lambda j, node: self.treedef.unflatten(
            [s[j] for s in leaf_states]))
        return self._scalars(state, self._new_counts())

    def _walk(self, node, fn, keys=None, count=None):
        """`node` with its j-th params-shaped dict (top-level `keys`, default the params'; in a
        fixed order) replaced by fn(j, dict)."""
        count = [0] if count is None else count
        if isinstance(node, dict) and set(node) == (keys or self._keys):
            count[0] += 1
            return fn(count[0] - 1, node)
        if isinstance(node, tuple):
            children = [self._walk(c, fn, keys, count) for c in node]
            return type(node)(*children) if hasattr(node, "_fields") else tuple(children)
        return node

    def _new_counts(self):
        """The optax state after one update, for its non-moment leaves (the counts): an
        update of zero-sized stand-ins for the params and moments, which costs nothing."""
        empty = lambda tree: jax.tree_util.tree_map(  # noqa: E731
            lambda x: jnp.zeros((0,) * x.ndim, x.dtype), tree)
        tiny = self.treedef.unflatten([jnp.zeros((0,) * len(s), d)
                                       for s, d in zip(self.shapes, self.dtypes)])
        _, new = self.tx.update(tiny, self._walk(self.state, lambda j, node: empty(node)), tiny)
        return new

    def _scalars(self, state, new):
        """`state` with its non-moment leaves taken from `new` (same structure)."""
        if isinstance(state, dict) and set(state) == self._keys:
            return state
        if isinstance(state, tuple):
            children = [self._scalars(a, b) for a, b in zip(state, new)]
            return type(state)(*children) if hasattr(state, "_fields") else tuple(children)
        return new

    def _optax_part(self, grads: dict, states: dict, params: dict):
        """tx.update on a part: grads / params {leaf index: array}, states {index: tuple};
        -> ({index: update}, {index: new state tuple}). The counts come from the state before
        the step (self.state), so every part is updated with the same count."""
        idx = sorted(grads)
        sub = lambda vals: _subtree(self.paths, idx, vals)  # noqa: E731
        part_state = self._walk(self.state, lambda j, node: sub([states[i][j] for i in idx]))
        updates, new_state = self.tx.update(sub([grads[i] for i in idx]), part_state,
                                            sub([params[i] for i in idx]))
        cols = []
        self._walk(new_state, lambda j, node: cols.append(_flatten_sub(self.paths, idx, node))
                   or node, keys={self.paths[i][0].key for i in idx})
        return (dict(zip(idx, _flatten_sub(self.paths, idx, updates))),
                {i: tuple(c[n] for c in cols) for n, i in enumerate(idx)})

    # ------------------------------------------------------------------ the updates

    def _leaf_key(self, i):
        if self.key is None or self.dtypes[i] != jnp.bfloat16:
            return None
        return jax.random.fold_in(self.key, i)

    def leaf(self, i: int, g, p, state, finite):
        """(new p, new state) of leaf `i` (outside the stack), as the whole-tree update. `g`
        may be a function (n, j) -> piece j of n of the gradient's rows
        (jaxmem.optim.apply_leaf_in_place): 8-bit AdamW then makes each piece where it uses it."""
        if callable(g) and not self.eight_bit:
            g = g(1, 0).reshape(p.shape)
        if self.eight_bit:
            m, v = state
            new_p, m, v = apply_leaf_in_place(self.piece, g, m, v, p, self.decays[i],
                                              self._leaf_key(i), finite)
            return new_p, (m, v)
        updates, new_states = self._optax_part({i: g}, {i: state}, {i: p})
        u, new_state = updates[i], new_states[i]
        leaf_key = self._leaf_key(i)
        new_p = (apply_leaf_sr(p, u, leaf_key) if leaf_key is not None else
                 self._add(p, u))
        pick = lambda a, b: jnp.where(finite, a, b)  # noqa: E731
        return pick(new_p, p), jax.tree_util.tree_map(pick, new_state, state)

    def _add(self, p, u):
        if self.rounds:  # apply_updates_sr's non-bf16 leaves
            return (p.astype(jnp.float32) + u.astype(jnp.float32)).astype(p.dtype)
        return jnp.asarray(p + u).astype(p.dtype)  # optax.apply_updates

    def layer(self, l, grads: dict, params: dict, states: dict, finite):
        """Layer `l` of every stacked leaf: grads {i: layer-l gradient}, params {i: the whole
        stacked leaf}, states {i: its whole stacked state}; returns (params, states) of the
        same form with layer l updated in place."""
        if self.eight_bit:
            out_p, out_s = {}, {}
            for i in self.stacked:
                m, v = states[i]

                def fn(ins, st, pkey, bits, i=i):
                    (g,), (p, m, v) = ins, st
                    return self.piece(g, m, v, p, self.decays[i], pkey, bits)

                rows, n, _ = moment_pieces(self.shapes[i], m)
                out_p[i], m, v = _layer_rows(fn, (grads[i],), (params[i], m, v), l, rows,
                                             self._leaf_key(i), finite, n)
                out_s[i] = (m, v)
            return out_p, out_s
        take = lambda x: jax.lax.dynamic_index_in_dim(x, l, 0, keepdims=False)  # noqa: E731
        put = lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, l, 0)  # noqa: E731
        layer_states = {i: tuple(jax.tree_util.tree_map(take, s) for s in states[i])
                        for i in self.stacked}
        updates, new_states = self._optax_part(
            grads, layer_states, {i: take(params[i]) for i in self.stacked})
        out_p, out_s = {}, {}
        for i in self.stacked:
            def fn(ins, st, pkey, bits):
                (u,), (p,) = ins, st
                if pkey is None and bits is None:
                    return (self._add(p, u),)
                total = p.astype(jnp.float32) + u.astype(jnp.float32)
                return ((round_bf16_bits(total, bits) if bits is not None
                         else round_bf16(total, pkey)),)
            (out_p[i],) = _layer_rows(fn, (updates[i],), (params[i],), l, self.shapes[i],
                                      self._leaf_key(i), finite)
            new = jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), new_states[i],
                                         layer_states[i])
            out_s[i] = tuple(jax.tree_util.tree_map(put, s, n)
                             for s, n in zip(states[i], new))
        return out_p, out_s


def _subtree(paths, idx, values):
    """A nested dict holding values at paths[i] for i in idx (the part's own tree)."""
    out: dict = {}
    for i, v in zip(idx, values):
        node = out
        keys = [k.key for k in paths[i]]
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = v
    return out


def _flatten_sub(paths, idx, tree):
    """Inverse of `_subtree`: the values at paths[i], in idx's order."""
    out = []
    for i in idx:
        node = tree
        for k in paths[i]:
            node = node[k.key]
        out.append(node)
    return out


def _layer_rows(fn, ins, stacked, l, shape, leaf_key, finite, n=None):
    """Layer `l` of the stacked arrays `stacked` (of `shape` [L, ..., last_k], seen as rows of
    last_k: an 8-bit leaf's `shape` and `n` are its jaxmem.optim.moment_pieces' rows and count,
    its moments' codes and scales cut by as_rows; n None: row_chunks(shape)) through
    fn(ins rows, stacked rows, piece key, bits) -> new stacked rows, written back in place;
    `ins` are layer-l arrays (size a x last_k).

    The whole-tree update cuts a leaf's L * a rows (a per layer) into pieces of P rows, piece j
    rounded with key(j). Here the layer goes through in sub-pieces of g = gcd(a, P) rows, each
    inside one piece: g = P gives the piece's key itself; otherwise the piece's bits are drawn
    and the sub-piece's rows cut out of them (a piece's bits drawn P / g times)."""
    L = shape[0]
    a = math.prod(shape[1:-1])  # rows per layer
    n = row_chunks(shape) if n is None else n
    P = L * a // n  # rows per piece of the whole-tree update
    g = math.gcd(a, P)
    rows = lambda x: as_rows(x, shape[-1])  # noqa: E731
    take = lambda x, r0, k: jax.lax.dynamic_slice_in_dim(x, r0, k, 0)  # noqa: E731
    put = lambda x, y, r0: jax.lax.dynamic_update_slice_in_dim(x, y, r0, 0)  # noqa: E731
    i2 = rows(ins)

    def body(k, carry):
        r0 = l * a + k * g  # first row of the sub-piece in the stacked leaf
        j = r0 // P  # its piece
        key = None if leaf_key is None else leaf_key if n == 1 else jax.random.fold_in(leaf_key, j)
        bits = None
        if key is not None and g != P:
            bits = take(jax.random.bits(key, (P, shape[-1]), jnp.uint32), r0 - j * P, g)
            key = None
        st = jax.tree_util.tree_map(lambda x: take(x, r0, g), carry)
        out = fn(jax.tree_util.tree_map(lambda x: take(x, k * g, g), i2), st, key, bits)
        return jax.tree_util.tree_map(lambda x, y: put(x, y, r0), carry, out)

    # a part with non-finite gradients runs no sub-piece: its rows stay bitwise
    out = jax.lax.fori_loop(0, jnp.where(finite, a // g, 0), body,
                            rows(stacked))
    return jax.tree_util.tree_map(lambda x, ref: x.reshape(ref.shape), out, stacked)
