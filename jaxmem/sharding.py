"""The activation-sharding hook: where the model lets a parallel run place its activations.

The model calls `constrain(x, kind)` at three points:

    kind      where                                         shape
    "embed"   the embedding output                          [B, T, D]
    "block"   each decoder block's output (the scan carry)  [B, T, D]
    "logits"  the LM head's output                          [B, T, V]

With no rules installed `constrain` returns `x` itself, so a single-device run traces exactly
the graph it traced before the hook existed. A parallel run installs rules around the trace:

    with activation_sharding({"embed": P("data"), "block": P("data"), "logits": P("data")}):
        compiled = jax.jit(step).lower(state, batch).compile()

Rules are either a mapping kind -> `PartitionSpec` (or a `jax.sharding.Sharding`), applied with
`jax.lax.with_sharding_constraint` (`jax.sharding.reshard` when the mesh has Explicit axes), or a
callable `(x, kind) -> x` that does anything it likes.
A `PartitionSpec` means nothing without a mesh, so those rules are applied only while a mesh is
in context (`jax.set_mesh`); a kind the mapping lacks is left alone.

Rules act at trace time: install them around the first call (or `.lower`) of a jitted function,
not around later calls, which reuse the trace. jaxmem.parallel owns the rules themselves.

Weights: `constrain_weight(w, path)` is called where the model reads a weight (each projection,
the embedding). It returns `w` unchanged; only its gradient is placed: with a rule installed
(`weight_sharding(rule)`, rule(path, shape, stacked) -> a Sharding or None) the cotangent of
`w` is constrained to the weight's own (FSDP) sharding. Inside the layer scan this makes XLA's
SPMD partitioner reduce-scatter each layer's weight gradients as the backward pass leaves the
layer, instead of all-reducing whole gradients (issue 28); `constrain_grads(tree)` places a
whole gradient tree (the stacked leaves) the same way, and `weight_placement(path, shape)` tells
the optimizer where a leaf lives, so that it updates each device's shard where it is.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable, Mapping, Union

import jax

from jaxmem.paths import path_text

KINDS = ("embed", "block", "logits")

Rules = Union[Callable[[jax.Array, str], jax.Array], Mapping[str, object]]

_RULES: contextvars.ContextVar[Rules | None] = contextvars.ContextVar("jaxmem_activation_rules",
                                                                     default=None)


@contextlib.contextmanager
def activation_sharding(rules: Rules | None):
    """Install `rules` for `constrain` calls traced inside the block (None: none)."""
    if rules is not None and not callable(rules):
        unknown = set(rules) - set(KINDS)
        if unknown:
            raise ValueError(f"activation sharding rules for unknown kind(s) {sorted(unknown)}; "
                             f"kinds: {', '.join(KINDS)}")
    token = _RULES.set(rules)
    try:
        yield
    finally:
        _RULES.reset(token)


_WEIGHTS: contextvars.ContextVar = contextvars.ContextVar("jaxmem_weight_rule", default=None)


@contextlib.contextmanager
def weight_sharding(rule):
    """Install `rule(path: str, shape, stacked: bool) -> Sharding | None` for the gradients of
    the weights read inside the block (None: none). `stacked` is False for one layer's slice
    read inside the layer scan (its shape has no layer axis)."""
    token = _WEIGHTS.set(rule)
    try:
        yield
    finally:
        _WEIGHTS.reset(token)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _grad_placed(w, sharding):
    return w


def _grad_placed_fwd(w, sharding):
    return w, None


def _grad_placed_bwd(sharding, _, g):
    return (jax.lax.with_sharding_constraint(g, sharding),)


_grad_placed.defvjp(_grad_placed_fwd, _grad_placed_bwd)


def constrain_weight(w, path: str, stacked: bool = False):
    """`w` itself; its gradient placed by the installed weight rule (module docstring)."""
    rule = _WEIGHTS.get()
    if rule is None or not isinstance(w, jax.Array):
        return w
    sharding = rule(path, tuple(w.shape), stacked)
    return w if sharding is None else _grad_placed(w, sharding)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gathered(w, whole, own):
    return jax.lax.with_sharding_constraint(w, whole)


def _gathered_fwd(w, whole, own):
    return _gathered(w, whole, own), None


def _gathered_bwd(whole, own, _, g):
    return (jax.lax.with_sharding_constraint(g, own),)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


def gather_weight(w, path: str):
    """`w` (not stacked) gathered whole over every mesh axis but `tensor` (which holds other
    weights, not other tokens), once, where a loop would otherwise gather it on every trip (the
    fused loss's sequence chunks); its gradient placed like the weight. `w` itself without a
    rule or where nothing is split."""
    own = weight_placement(path, w.shape) if isinstance(w, jax.Array) else None
    if own is None:
        return w
    keep = [e if e == "tensor" else None for e in own.spec]
    whole = jax.sharding.NamedSharding(own.mesh, jax.sharding.PartitionSpec(*keep))
    return _gathered(w, whole, own)


def weight_placement(path: str, shape) -> "jax.sharding.NamedSharding | None":
    """The installed weight rule's sharding of a stacked state leaf of `shape` at `path` (a
    parameter, or a leaf shaped and named like one); None without a rule, or when the rule
    leaves the leaf whole."""
    rule = _WEIGHTS.get()
    return None if rule is None else rule(path, tuple(shape), True)


def constrain_grads(tree):
    """A gradient tree (params-shaped, stacked) constrained leaf by leaf to the installed weight
    rule's shardings; the tree itself without a rule."""
    rule = _WEIGHTS.get()
    if rule is None:
        return tree

    def one(path, g):
        sharding = rule(path_text(path), tuple(g.shape), True)
        return g if sharding is None else jax.lax.with_sharding_constraint(g, sharding)
    return jax.tree_util.tree_map_with_path(one, tree)


def local_rows(rows: int) -> int:
    """Of `rows` batch rows, how many each device holds: `rows` divided by the devices the
    installed "block" rule splits the batch axis over (a NamedSharding's mesh axes); `rows`
    itself without one. The model sees global shapes; what it sizes per device (the MLP's
    sequence tiles) asks here."""
    rules = _RULES.get()
    target = rules.get("block") if isinstance(rules, Mapping) else None
    spec = getattr(target, "spec", None)
    if not spec or spec[0] is None:
        return rows
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    n = 1
    for a in axes:
        n *= dict(target.mesh.shape)[a]
    return max(1, rows // n)


def _mesh_in_context():
    """The abstract mesh set with `jax.set_mesh`, or None (also on a jax without that API)."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get() if get is not None else None
    return None if mesh is None or mesh.empty else mesh


def constrain(x: jax.Array, kind: str) -> jax.Array:
    """`x` placed by the installed rule for `kind`; `x` itself when there is none."""
    if kind not in KINDS:
        raise ValueError(f"unknown activation kind {kind!r}; kinds: {', '.join(KINDS)}")
    rules = _RULES.get()
    if rules is None:
        return x
    if callable(rules):
        return rules(x, kind)
    target = rules.get(kind)
    if target is None:
        return x
    mesh = _mesh_in_context()
    if isinstance(target, jax.sharding.PartitionSpec) and mesh is None:
        return x
    if mesh is not None and getattr(mesh, "explicit_axes", ()):
        # Explicit mesh axes: shardings are part of the types, and with_sharding_constraint
        # only asserts them; reshard moves the data.
        return jax.sharding.reshard(x, target)
    return jax.lax.with_sharding_constraint(x, target)
