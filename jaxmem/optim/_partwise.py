"""One optimizer step applied one part of the params at a time: a whole leaf, or layer l of a
leaf stacked along its first axis. What an update inside the backward pass (jaxmem's
`--optimizer-in-backward`) calls as each part's gradient appears.

    parts = split(tx, state, params, key=...)       an optax chain of element-wise links
    parts = AdamW8bitInPlace(...).split(state, params, key=...)      the 8-bit AdamW, natively
    parts.states[i]                                  leaf i's state (tree_flatten(params) order)
    p, s = parts.leaf(i, g, p, s, finite)            leaf i, whole
    p, s = parts.layer(i, l, g_l, p, s, finite)      layer l of leaf i (p, s: the whole stack)
    fetched = parts.fetch(l, p, s)                   layer l's host-resident slices on the device,
    p, s = parts.layer(i, l, g_l, p, s, finite, fetched)    fetched ahead (a prefetch)
    parts.column_block(i)                            the multiple of columns leaf i ([R, C])
    p, s = parts.columns(i, start, g_c, p, s, finite)   can be updated in; columns [start,
                                                     start + w) of it (an LM head's gradient
                                                     made a vocabulary slice at a time)
    p, s = parts.slab(i, l, axis, start, g_s, p, s, finite)   indices [start, start + w) along
                                                     `axis` of layer l of a stacked leaf (the
                                                     in-backward MLP's slabs of F; slab_block)
    state = parts.finish(new states)                 the counts advanced once

Each part goes through the whole-tree update's own arithmetic, from the state as it was before
the step (so every part sees the same count and learning rate), and the bf16 rounding draws the
whole-tree update's bits (`pieces`): the 8-bit AdamW's parts are bitwise its whole-tree update;
an optax chain's are within one bf16 ulp of it (XLA fuses its arithmetic differently for a part:
measured on XLA:CPU, adamw under bf16-sr, 1 to 5 of 196,608 elements a ulp apart). A part whose
`finite` is False is left as it was.

Which optax chains split: those whose state is made only of the element-wise states below,
dispatched on their type; any other state type is refused (`NotSplittable`, naming it):

    ScaleByAdamState, ScaleByLionState     mu (and nu) split per leaf, count advanced once
    ScaleByScheduleState, EmptyState       counts, advanced once (or nothing)
    MaskedState(EmptyState)                a masked link without state (weight decay's mask)
    tuple                                  optax.chain's

optax.adamw and optax.lion are such chains. Their update runs on a part as on a tree of the
params' structure holding the part at its place and zero-sized stand-ins elsewhere (which cost
nothing): a mask (a callable on the params) sees every leaf's path and number of axes. Clipping
by the global norm is not element-wise and its state is an EmptyState: a caller that splits a
clipped chain must refuse it itself (jaxmem.train.inbackward.check does).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from jaxmem.optim._adamw8bit import Quantized, as_rows
from jaxmem.optim._cuts import (cut_cols, in_host_memory, paste_cols, slab_at, to_device,
                                to_host)
from jaxmem.optim._stochastic import (RoundingPieces, apply_leaf_sr, pieces, round_bf16,
                                      round_bf16_bits)

_MOMENTS = ((optax.ScaleByAdamState, ("mu", "nu")), (optax.ScaleByLionState, ("mu",)))
_SPLITS = "ScaleByAdamState, ScaleByLionState, ScaleByScheduleState, EmptyState, " \
          "MaskedState(EmptyState)"


class NotSplittable(TypeError):
    """An optimizer state whose update is not known to split part by part."""


def _map_moments(state, fn):
    """`state` (an optax chain's) with each params-shaped moment tree t replaced by fn(t), in
    one fixed order; NotSplittable for a state type not known to be element-wise."""
    for cls, fields in _MOMENTS:
        if isinstance(state, cls):
            return state._replace(**{f: fn(getattr(state, f)) for f in fields})
    if isinstance(state, (optax.ScaleByScheduleState, optax.EmptyState)):
        return state
    if isinstance(state, optax.MaskedState) and isinstance(state.inner_state, optax.EmptyState):
        return state
    if type(state) is tuple:
        return tuple(_map_moments(s, fn) for s in state)
    inner = getattr(state, "inner_state", None)
    name = type(state).__name__ + (f"({type(inner).__name__})" if inner is not None else "")
    raise NotSplittable(f"optax state {name} does not split part by part (element-wise states "
                        f"only: {_SPLITS})")


def _moments(state) -> list:
    out: list = []
    _map_moments(state, lambda t: out.append(t) or t)
    return out


def _with_moments(state, trees):
    it = iter(trees)
    return _map_moments(state, lambda t: next(it))


class Parts:
    """One step applied part by part (the module docstring); `split` and
    AdamW8bitInPlace.split make one. Leaves are numbered as in
    `jax.tree_util.tree_flatten(params)`; `states` holds each leaf's state."""

    def __init__(self, params, key: jax.Array | None):
        leaves, self.treedef = jax.tree_util.tree_flatten(params)
        self.leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
        self.key = key
        self.states: list = []

    def pieces(self, i: int, n: int | None = None) -> RoundingPieces:
        """Leaf i's rounding keys (jaxmem.optim.pieces), in `n` row pieces (None: row_chunks)."""
        return pieces(self.key, self.leaves[i], leaf=i, n=n)

    def leaf(self, i: int, g, p, s, finite):
        """(new p, new s) of leaf i, updated whole from its gradient `g` (or `g(n, j)`: row
        piece j of n of it, made where it is used)."""
        raise NotImplementedError

    def layer(self, i: int, l, g, p, s, finite, fetched: list | None = None):
        """(new p, new s) of a stacked leaf i ([L, ...], with its state `s`) with layer `l`
        updated from `g` (layer l's gradient, p.shape[1:]), in place. `fetched`: `fetch(l, p,
        s)` made earlier (the caller's prefetch); None: made here."""
        raise NotImplementedError

    def column_block(self, i: int) -> int | None:
        """The multiple of columns a 2-axis leaf i ([R, C]) can be updated in by `columns`
        (1: any), None where it cannot be (another number of axes; a state whose blocks cross
        columns)."""
        return 1 if len(self.leaves[i].shape) == 2 else None

    def columns(self, i: int, start, g, p, s, finite):
        """(new p, new s) of the 2-axis leaf i with columns [start, start + w) (w =
        g.shape[-1], a multiple of `column_block(i)`) updated from `g`, their gradient, in
        place; state in host memory comes for them and goes back. bf16 rounding draws from
        fold_in(leaf key, start // w): other bits than `leaf`'s row pieces, as unbiased. A
        slice whose gradient is not `finite` keeps its weights and state."""
        w = g.shape[-1]
        return self._cut_update(i, g, p, s, finite, lambda x: cut_cols(x, start, w),
                                lambda x, y: paste_cols(x, y, start),
                                self.column_key(i, start, w))

    def slab_block(self, i: int, axis: int) -> int | None:
        """The multiple of indices along `axis` (1 or more) that `slab` can cut a stacked leaf
        i at (1: any), None where it cannot (a state whose blocks span that axis and others)."""
        return 1 if 0 < axis < len(self.leaves[i].shape) else None

    def slab(self, i: int, l, axis: int, start, g, p, s, finite):
        """(new p, new s) of the stacked leaf i ([L, ...]) with indices [start, start + w)
        along `axis` of its layer `l` (w = g.shape[axis]; g [1, ...] their gradient; start and
        w multiples of `slab_block(i, axis)`) updated in place: `columns` for a layer of a
        stack, the in-backward MLP's slabs along F. bf16 rounding draws from fold_in(fold_in(
        leaf key, l), start // w). A slab whose gradient is not `finite` stays as it was."""
        w = g.shape[axis]
        key = self.pieces(i).key
        if key is not None:
            key = jax.random.fold_in(jax.random.fold_in(key, l), start // w)
        return self._cut_update(i, g, p, s, finite, lambda x: slab_at(x, l, axis, start, w),
                                lambda x, y: slab_at(x, l, axis, start, w, y), key)

    def _cut_update(self, i: int, g, p, s, finite, cut, paste, key):
        """`columns` and `slab`: the part cut(x) of p and of each array of its state s (a
        Quantized's codes with their blocks' scales), host-resident state fetched, updated from
        `g` by `_column_update` with `key`, kept where not `finite`, written back with
        paste(x, new part) in place (state to the host where it lives)."""
        q = lambda x: isinstance(x, Quantized)  # noqa: E731
        host = jax.tree_util.tree_map(in_host_memory, s)
        s_c = jax.tree_util.tree_map(to_device, jax.tree_util.tree_map(cut, s, is_leaf=q), host)
        p_c = cut(p)
        new_p, new_s = self._column_update(i, g, p_c, s_c, key)
        pick = lambda a, b: jnp.where(finite, a, b)  # noqa: E731
        new_s = jax.tree_util.tree_map(to_host, jax.tree_util.tree_map(pick, new_s, s_c), host)
        return paste(p, pick(new_p, p_c)), jax.tree_util.tree_map(paste, s, new_s, is_leaf=q)

    def _column_update(self, i: int, g, p, s, key):
        """(new p, new s) of columns p of leaf i and their state s (on the device), rounded
        with `key` where the leaf is (`columns` cuts, keeps or replaces, and writes back)."""
        raise NotImplementedError

    def column_key(self, i: int, start, width: int):
        """The rounding key of columns [start, start + width) of leaf i (`columns`), or None."""
        key = self.pieces(i).key
        return None if key is None else jax.random.fold_in(key, start // width)

    @staticmethod
    def fetch(l, p, s) -> list:
        """Layer `l` of the stacked leaf `p` and of its state `s` where they live in host memory
        (--offload-optimizer / --offload-params host), copied to the device: per array of
        tree_leaves((p, s)) (p's first) its [1, ...] slice, None where it is on the device (that
        one is sliced where it is used)."""
        return [to_device(jax.lax.dynamic_slice_in_dim(x, l, 1, 0), True) if in_host_memory(x)
                else None for x in jax.tree_util.tree_leaves((p, s))]

    def finish(self, states: list):
        """The new optimizer state from every leaf's new state, its counts advanced once."""
        raise NotImplementedError


def split(tx: optax.GradientTransformation, state, params, *, key: jax.Array | None = None,
          stochastic_rounding: bool = False) -> Parts:
    """`tx`'s next step on `params` from `state`, part by part (`Parts`): the update of each
    part is `tx.update` on it, then optax.apply_updates, or with `stochastic_rounding` the
    bf16 leaves rounded as `apply_updates_sr` rounds them (`key`'s bits).

    Raises NotSplittable (naming the type) where `state` holds a state other than the
    element-wise ones of the module docstring.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = optax.adamw(1e-2)
      >>> params = {"b": jnp.zeros(3), "w": jnp.ones((2, 3))}
      >>> parts = split(tx, tx.init(params), params)
      >>> yes = jnp.asarray(True)
      >>> new = [parts.leaf(i, jnp.ones_like(x), x, s, yes)
      ...        for i, (x, s) in enumerate(zip(jax.tree.leaves(params), parts.states))]
      >>> state = parts.finish([s for _, s in new])
      >>> ref, ref_state = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
      >>> bool((optax.apply_updates(params, ref)["w"] == new[1][0]).all()), int(state[0].count)
      (True, 1)
      >>> try:
      ...     split(optax.adafactor(1e-2), optax.adafactor(1e-2).init(params), params)
      ... except NotSplittable as e:
      ...     print(str(e).split(" (")[0])
      optax state FactoredState does not split part by part
    """
    return _OptaxParts(tx, state, params, key if stochastic_rounding else None,
                       stochastic_rounding)


class _OptaxParts(Parts):
    def __init__(self, tx, state, params, key, rounds: bool):
        super().__init__(params, key)
        self.tx, self.state, self.rounds = tx, state, rounds
        cols = [self.treedef.flatten_up_to(t) for t in _moments(state)]
        self.states = [tuple(c[i] for c in cols) for i in range(len(self.leaves))]
        zeros = lambda x: jnp.zeros((0,) * x.ndim, x.dtype)  # noqa: E731
        self._tiny = [zeros(x) for x in self.leaves]  # stand-ins for the other leaves
        self._tiny_moments = [[zeros(x) for x in c] for c in cols]

    def _update(self, i, g, p, s):
        """tx.update on leaf i's part (g, p, s: any slice with the leaf's number of axes) ->
        (the part's update, its new state)."""
        only = lambda tiny, x: self.treedef.unflatten(tiny[:i] + [x] + tiny[i + 1:])  # noqa: E731
        state = _with_moments(self.state, [only(t, x) for t, x in zip(self._tiny_moments, s)])
        u, new = self.tx.update(only(self._tiny, g), state, only(self._tiny, p))
        mine = lambda t: self.treedef.flatten_up_to(t)[i]  # noqa: E731
        return mine(u), tuple(mine(t) for t in _moments(new))

    def _add(self, p, u):
        if self.rounds:  # apply_updates_sr's leaves that are not rounded
            return (p.astype(jnp.float32) + u.astype(jnp.float32)).astype(p.dtype)
        return jnp.asarray(p + u).astype(p.dtype)  # optax.apply_updates

    def _apply(self, p, u, key=None, bits=None):
        """p + u as the whole-tree update applies it: rounded stochastically with `key` or the
        given `bits` where there are any (a bf16 leaf under bf16-sr), else `_add`."""
        if key is None and bits is None:
            return self._add(p, u)
        total = p.astype(jnp.float32) + u.astype(jnp.float32)
        return round_bf16_bits(total, bits) if bits is not None else round_bf16(total, key)

    def leaf(self, i, g, p, s, finite):
        if callable(g):
            g = g(1, 0).reshape(p.shape)
        host = tuple(in_host_memory(x) for x in s)  # --offload-optimizer host: the whole leaf's
        s = tuple(to_device(x, h) for x, h in zip(s, host))  # moments in, and back out after
        u, new = self._update(i, g, p, s)
        new_p = apply_leaf_sr(p, u, self.pieces(i).key) if self.rounds else self._add(p, u)
        pick = lambda a, b: jnp.where(finite, a, b)  # noqa: E731
        return pick(new_p, p), tuple(to_host(pick(a, b), h) for a, b, h in zip(new, s, host))

    def layer(self, i, l, g, p, s, finite, fetched=None):
        take = lambda x, f: jax.lax.dynamic_slice_in_dim(x, l, 1, 0) if f is None else f  # noqa
        put = lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y, l, 0)  # noqa: E731
        # --offload-optimizer / --offload-params host: layer l streamed from the host stacks
        # (fetched now, or ahead by the caller), written back after
        fetched = self.fetch(l, p, s) if fetched is None else fetched
        host = tuple(in_host_memory(x) for x in s)
        s_l = tuple(take(x, f) for x, f in zip(s, fetched[1:]))
        u, new = self._update(i, g.reshape((1,) + g.shape), take(p, fetched[0]), s_l)

        def fn(ins, st, pkey, bits):
            (u,), (p,) = ins, st
            return (self._apply(p, u, pkey, bits),)

        (new_p,) = layer_rows(fn, (u,), (p,), l, p.shape, self.pieces(i), finite, fetched[:1])
        new = tuple(jnp.where(finite, a, b) for a, b in zip(new, s_l))
        new = tuple(to_host(y, h) for y, h in zip(new, host))
        return new_p, tuple(put(x, y) for x, y in zip(s, new))

    def _column_update(self, i, g, p, s, key):
        u, new = self._update(i, g, p, tuple(s))
        return self._apply(p, u, key if self.rounds else None), type(s)(new)

    def finish(self, states):
        tiny = self.treedef.unflatten(self._tiny)
        _, new = self.tx.update(tiny, _with_moments(
            self.state, [self.treedef.unflatten(t) for t in self._tiny_moments]), tiny)
        return _with_moments(new, [self.treedef.unflatten([s[k] for s in states])
                                   for k in range(len(self._tiny_moments))])


def layer_rows(fn, ins, stacked, l, shape, keys: RoundingPieces, finite, fetched=None):
    """Layer `l` of the stacked arrays `stacked` (of `shape` [L, ..., last], seen as rows of
    `last`: an 8-bit leaf's `shape` is its moment_pieces' rows, its moments' codes and scales
    cut by as_rows) through fn(ins rows, stacked rows, piece key, bits) -> new stacked rows,
    written back in place; `ins` are layer-l arrays (size a x last); `keys` the leaf's
    rounding keys (`pieces`), in keys.n row pieces; `fetched`: `Parts.fetch(l, *stacked)`'s
    list (layer l of the host-resident arrays on the device, fetched ahead by the caller;
    None: each sub-piece fetched where it is updated).

    The whole-tree update cuts a leaf's L * a rows (a per layer) into n pieces of P rows, piece
    j rounded with keys(j). Here the layer goes through in sub-pieces of g = gcd(a, P) rows,
    each inside one piece: g = P gives the piece's key itself; otherwise the piece's bits are
    drawn and the sub-piece's rows cut out of them (a piece's bits drawn P / g times)."""
    L, n = shape[0], keys.n
    a = math.prod(shape[1:-1])  # rows per layer
    P = L * a // n  # rows per piece of the whole-tree update
    g = math.gcd(a, P)
    rows = lambda x: as_rows(x, shape[-1])  # noqa: E731
    take = lambda x, r0, k: jax.lax.dynamic_slice_in_dim(x, r0, k, 0)  # noqa: E731
    put = lambda x, y, r0: jax.lax.dynamic_update_slice_in_dim(x, y, r0, 0)  # noqa: E731
    i2, whole = rows(ins), rows(stacked)
    on_host = jax.tree_util.tree_map(in_host_memory, whole)
    # --offload-optimizer / --offload-params host, with layer l's host-resident slices fetched
    # ahead (`fetched`): the loop runs on a window of layer l's a rows on the device (the
    # carry's rows start at 0), written back into the host stacks after it. Without: on the
    # stacks themselves (rows from l * a), each sub-piece of a host-resident one copied to the
    # device for its update and back after it (one sub-piece on the device, not a layer)
    windowed = fetched is not None and any(jax.tree_util.tree_leaves(on_host))
    base = 0 if windowed else l * a
    move = (lambda t, f: t) if windowed else (  # noqa: E731
        lambda t, f: jax.tree_util.tree_map(f, t, on_host))

    def body(k, carry):
        r0 = l * a + k * g  # first row of the sub-piece in the stacked leaf
        j = r0 // P  # its piece
        key, bits = keys(j), None
        if key is not None and g != P:
            bits, key = take(keys.bits(j, (P, shape[-1])), r0 - j * P, g), None
        st = move(jax.tree_util.tree_map(lambda x: take(x, base + k * g, g), carry), to_device)
        out = move(fn(jax.tree_util.tree_map(lambda x: take(x, k * g, g), i2), st, key, bits),
                   to_host)
        return jax.tree_util.tree_map(lambda x, y: put(x, y, base + k * g), carry, out)

    # a part with non-finite gradients runs no sub-piece: its rows stay bitwise
    subs = jnp.where(finite, a // g, 0)
    if windowed:  # the window: layer l's a rows of each array on the device
        leaves, tree = jax.tree_util.tree_flatten(stacked)
        window = rows(tree.unflatten([jax.lax.dynamic_slice_in_dim(x, l, 1, 0) if f is None
                                      else f for x, f in zip(leaves, fetched)]))
        window = jax.lax.fori_loop(0, subs, body, window)
        out = jax.tree_util.tree_map(lambda x, y, h: put(x, to_host(y, h), l * a), whole,
                                     window, on_host)
    else:
        out = jax.lax.fori_loop(0, subs, body, whole)
    return jax.tree_util.tree_map(lambda x, ref: x.reshape(ref.shape), out, stacked)
