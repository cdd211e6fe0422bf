"""8-bit AdamW's update and its application in one in-place pass per leaf (`--optimizer adamw8bit`),
and the trainer's optimizer as a jaxmem.optim.Optimizer (`train_optimizer`).

    train_optimizer(cfg, stochastic_rounding) -> Optimizer(init, update_and_apply)
        adamw8bit: update_and_apply = the in-place pass below; any other: make_optimizer(cfg)'s
        update + apply_updates[_sr] (jaxmem.optim.as_optimizer)
    fused_adamw8bit_apply(cfg, grads, opt_state, params, finite, key)
        -> (new params, new opt_state)       bitwise what optimizer.update + apply_updates[_sr]
                                             gives on make_optimizer(cfg)'s state

The optax chain (clip, scale_by_adam_8bit, add_decayed_weights, -lr; jaxmem.train.optim) hands
whole-leaf arrays from link to link: new codes and scales, the updates, then the new weights,
each a fresh buffer of the leaf's size while the old ones are still live (~13 B/element of CPU
temporaries on llama-3-8b's stacked [L, 4096, 14336] leaves, on top of the state). Here each
large leaf is one lax.fori_loop over row pieces (the same <= 2^24-element pieces as
jaxmem.optim.apply_updates_sr, so the same random bits) whose carry is the leaf's weights, codes
and scales: a piece is read with a dynamic slice, clipped, put through Adam (jaxmem.optim's
adam_piece), decayed, scaled by -lr, added to the weights (stochastically rounded under bf16-sr)
and written back with a dynamic update slice, so XLA updates the donated state buffers in place.

`where` (the Optimizer contract; the trainer passes finite & where) is honoured without a
conditional: a large leaf's loop runs `where ? n : 0` times, so a skipped step runs no piece and
its carry stays bitwise; the small leaves and the counts pick new or old with jnp.where. Nothing
of a skipped step's update, inf or NaN, reaches the state.

Each line of `_piece` mirrors one optax link (clip_by_global_norm, add_decayed_weights,
scale_by_learning_rate, apply_updates), with the same dtypes, so both paths agree bit for bit
(tested). The optax GradientTransformation (jaxmem.optim.adamw_8bit) stays the reference. The
state layout this pass reads is make_optimizer's chain, built in this package: `_split_state`
checks it, and the step only ever sees the `Optimizer` contract.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import jaxmem.optim._stochastic as sr
from jaxmem.bits import from_bits, to_bits, tree_norm
from jaxmem.paths import path_text
from jaxmem.sharding import weight_placement
from jaxmem.optim import Optimizer, Quantized, ScaleByAdam8bitState, as_optimizer
from jaxmem.optim._adamw8bit import adam_piece, bias_corrections
from jaxmem.train.optim import OptimConfig, OptimizerName, decay_mask, make_optimizer, schedule


def train_optimizer(cfg: OptimConfig, stochastic_rounding: bool = False) -> Optimizer:
    """The trainer's optimizer for `cfg`: init = make_optimizer(cfg).init; update_and_apply =
    the in-place pass for adamw8bit, else update + apply (stochastically rounded to bf16 with
    `stochastic_rounding`, from the `key` the caller passes on every step)."""
    tx = make_optimizer(cfg)
    if OptimizerName(cfg.optimizer) != OptimizerName.ADAMW8BIT:
        return as_optimizer(tx, stochastic_rounding=stochastic_rounding)

    def update_and_apply(grads, opt_state, params, *, key=None, where=True):
        if stochastic_rounding and key is None:
            raise ValueError("train_optimizer(stochastic_rounding=True) needs a key")
        return fused_adamw8bit_apply(cfg, grads, opt_state, params, jnp.asarray(where),
                                     key if stochastic_rounding else None)

    return Optimizer(tx.init, update_and_apply)


def _split_state(cfg: OptimConfig, opt_state):
    """(clip state or None, adam state, decay state, schedule state) of make_optimizer's chain."""
    clip_state, inner = opt_state if cfg.clip > 0 else (None, opt_state)
    adam, decay, sched = inner
    assert isinstance(adam, ScaleByAdam8bitState), type(adam)
    return clip_state, adam, decay, sched


def fused_adamw8bit_apply(cfg: OptimConfig, grads, opt_state, params, finite: jax.Array,
                          key: jax.Array | None = None):
    """make_optimizer(cfg).update + apply, in place; `key` given: bf16 leaves rounded
    stochastically (jaxmem.optim.apply_updates_sr's keys); `finite` (a bool scalar) False:
    params and every state leaf bitwise unchanged, without a conditional (module docstring)."""
    piece, finish = adamw8bit_piece(cfg, opt_state, tree_norm(grads) if cfg.clip > 0 else None,
                                    key is not None)
    _, adam, _, _ = _split_state(cfg, opt_state)
    paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    cols = [treedef.flatten_up_to(t) for t in (grads, adam.mu, adam.nu,
                                               decay_mask(params, cfg.decay_embeddings))]
    new_p, new_m, new_v = [], [], []
    for i, ((path, p), g, m, v, decays) in enumerate(zip(paths, *cols)):
        leaf_key = (jax.random.fold_in(key, i)
                    if key is not None and p.dtype == jnp.bfloat16 else None)
        out = apply_placed(path_text(path), piece, g, m, v, p, decays, leaf_key, finite)
        for lst, x in zip((new_p, new_m, new_v), out):
            lst.append(x)
    return treedef.unflatten(new_p), finish(treedef.unflatten(new_m), treedef.unflatten(new_v),
                                            finite)


def adamw8bit_piece(cfg: OptimConfig, opt_state, g_norm: jax.Array | None, rounds: bool):
    """(piece, finish) of one 8-bit AdamW step on make_optimizer(cfg)'s state `opt_state`:

        piece(g, m, v, p, decays, pkey, bits=None) -> (new p, new m, new v)   (a piece of a
            leaf: clip by `g_norm`, Adam, decay, -lr, add; `rounds`: bf16 leaves are rounded
            stochastically with `pkey`'s bits, or the given `bits`; pkey None: to nearest)
        finish(new mu tree, new nu tree, finite) -> the new opt_state (counts advanced where
            `finite`)

    Shared by the whole-tree update (`fused_adamw8bit_apply`) and the one applied layer by
    layer inside the backward pass (jaxmem.train.inbackward), so both compute the same bits."""
    clip_state, adam, decay, sched = _split_state(cfg, opt_state)
    count = optax.safe_int32_increment(adam.count)
    c1, c2 = bias_corrections(count, cfg.b1, cfg.b2)
    step_size = -1 * schedule(cfg)(sched.count)  # scale_by_learning_rate
    wd = cfg.weight_decay
    trigger = None if g_norm is None else jnp.squeeze(g_norm < cfg.clip)

    def piece(g, m, v, p, decays, pkey, bits=None):
        if cfg.clip > 0:  # clip_by_global_norm
            g = jax.lax.select(trigger, g, (g / g_norm.astype(g.dtype)) * cfg.clip)
        u, m, v = adam_piece(g, m, v, c1, c2, cfg.b1, cfg.b2, cfg.eps)
        if decays and wd != 0.0:  # add_decayed_weights (masked)
            u = u + wd * p
        u = jnp.array(step_size, dtype=u.dtype) * u
        if pkey is None and bits is None:
            if rounds:  # apply_updates_sr's non-bf16 leaves
                return (p.astype(jnp.float32) + u.astype(jnp.float32)).astype(p.dtype), m, v
            return jnp.asarray(p + u).astype(p.dtype), m, v  # optax.apply_updates
        total = p.astype(jnp.float32) + u.astype(jnp.float32)
        if bits is not None:
            return sr.round_bf16_bits(total, bits), m, v
        return sr.round_bf16(total, pkey), m, v

    def finish(mu, nu, finite):
        new_adam = ScaleByAdam8bitState(count=jnp.where(finite, count, adam.count), mu=mu, nu=nu)
        new_sched = sched._replace(count=jnp.where(
            finite, optax.safe_int32_increment(sched.count), sched.count))
        inner = (new_adam, decay, new_sched)
        return (clip_state, inner) if cfg.clip > 0 else inner

    return piece, finish


def apply_placed(path: str, piece, g, m, v, p, decays, leaf_key, finite):
    """`apply_leaf` where the leaf lives: on a mesh (a weight rule installed,
    jaxmem.sharding.weight_placement) each device updates its own shard inside a
    `shard_map`, in row pieces of its shard, so the update never gathers a leaf whole, whatever
    axis the mesh splits (a row piece of the whole leaf would cross the shards of an inner axis,
    and XLA all-gathers the leaf for the loop over pieces). Blocks run along the last axis:
    when it is split, each shard must hold whole blocks, else the leaf is updated whole.
    bf16 rounding on a shard draws from fold_in(leaf_key, the shard's index): other bits than
    one device's, as unbiased. Off a mesh, or for a leaf left whole: `apply_leaf`."""
    sharding = weight_placement(path, p.shape)
    if sharding is None or not isinstance(m, Quantized):
        return apply_leaf(piece, g, m, v, p, decays, leaf_key, finite)
    mesh, spec = sharding.mesh, P(*sharding.spec, *[None] * (p.ndim - len(sharding.spec)))
    sizes = dict(mesh.shape)
    axes_of = lambda e: () if e is None else (e if isinstance(e, tuple) else (e,))  # noqa: E731
    split = tuple(a for e in spec for a in axes_of(e))
    last = int(np.prod([sizes[a] for a in axes_of(spec[-1])]))
    if last > 1 and (p.shape[-1] // last) % m.block:
        return apply_leaf(piece, g, m, v, p, decays, leaf_key, finite)
    # each block's scale with its codes (the state may keep small scales whole: then each
    # device takes its slice, and the jit's out_shardings put it back)
    moment = Quantized(codes=spec, scale=P(*spec[:-1], spec[-1] if last > 1 else None),
                       block=m.block)

    def body(g, m, v, p, finite, *key):
        k = jax.random.fold_in(key[0], jax.lax.axis_index(split)) if key else None
        return apply_leaf(piece, g, m, v, p, decays, k, finite)

    keys = () if leaf_key is None else (leaf_key,)
    run = jax.shard_map(body, mesh=mesh, in_specs=(spec, moment, moment, spec, P())
                        + (P(),) * len(keys), out_specs=(spec, moment, moment), check_vma=False)
    return run(g, m, v, p, finite, *keys)


def apply_leaf(piece, g, m, v, p, decays, leaf_key, finite):
    """One whole leaf through `piece`: in row pieces of <= CHUNK elements (`_in_place`, keys
    fold_in(leaf_key, j)) when it is larger, else at once (key leaf_key). `g` may be a function
    (n, j) -> piece j of the gradient of n (rows [j * rows / n, (j + 1) * rows / n)), so a
    caller can make each piece where it is used, never the whole gradient."""
    n = sr.row_chunks(p.shape, sr.CHUNK)
    if n == 1:
        out = piece(g(1, 0).reshape(p.shape) if callable(g) else g, m, v, p, decays, leaf_key)
        return jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), out, (p, m, v))
    return _in_place(piece, n, g, m, v, p, decays, leaf_key, finite)


def _in_place(piece, n, g, m, v, p, decays, leaf_key, finite):
    """One leaf through `piece` in n row pieces, the carry (p, m, v) updated slice by slice."""
    split = lambda x: x.reshape((n, -1, x.shape[-1]))  # noqa: E731  rows -> [n, rows / n, last]
    # the gradient enters as raw bits, so XLA cannot hoist a whole-leaf fp32 convert out of the loop
    gs = None if callable(g) else split(to_bits(g))

    def body(j, carry):
        take = lambda x: jax.lax.dynamic_index_in_dim(x, j, 0, keepdims=False)  # noqa: E731
        put = lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, j, 0)  # noqa: E731
        pkey = None if leaf_key is None else jax.random.fold_in(leaf_key, j)
        gj = g(n, j) if gs is None else from_bits(take(gs), g.dtype)
        out = piece(gj, *jax.tree_util.tree_map(take, carry[1:]), take(carry[0]), decays, pkey)
        pj, mj, vj = out
        return jax.tree_util.tree_map(put, carry, (pj, mj, vj))

    carry = jax.tree_util.tree_map(split, (p, m, v))
    trips = jnp.where(finite, n, 0)  # a skipped step runs no piece: the carry stays bitwise
    out = jax.lax.fori_loop(0, trips, body, carry)
    shape_of = (p, m, v)
    return jax.tree_util.tree_map(lambda x, ref: x.reshape(ref.shape), out, shape_of)
