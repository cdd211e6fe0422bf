"""The `--optimizer-in-backward` step's layer backward with the MLP in slabs of F: what
jaxmem.train.inbackward's reverse loop runs for a layer where `inbackward_rules.mlp_slabs` says
so (the 8B: 14 slabs of 1,024).

    mid, vjp_attn = vjp(attention half)(attention params_l, x_l)     the family's block, part
                                                                     "attention"
    for each slab [s, s + w) of F:                                   a fori_loop
        W_s = the MLP weights' slabs of layer l (gate and up: columns, down: rows)
        d W_s, d mid_s = vjp(MLP half on W_s)(dx)                    the family's block, part
        update the slabs W_s in place (Parts.slab)                   "mlp", with F = w
        d mid += d mid_s, d norm += its share                        summed in fp32
    update the pre-MLP norm; d attention params_l, dx = vjp_attn(dx + d mid); update them

The MLP's output is the sum of its slabs' (each slab's down projection of its own gate and up
columns), so each slab's weight gradients are complete, exact, and applied at once: no copy of
the layer's whole MLP weights and none of its MLP gradients exists (8B: 336 MiB each), only one
slab's. The MLP's input gradient and its norm's are summed over the slabs in fp32. A slab
whose gradient is not finite is left as it was (a part, like the head's vocabulary slices);
bf16 rounding draws each slab's own bits (`Parts.slab`: other bits than the whole layer's, as
unbiased).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxmem.families.decoder import DecoderBlock
from jaxmem.optim import slab_at


@dataclasses.dataclass(frozen=True)
class Slabs:
    """Where a layer's MLP runs in slabs: `axes` {stacked leaf index: its F axis in the stack}
    for the MLP's weights, `names` {index: its name under the layer's "mlp"}, `width` the slab
    width, `norm` (the pre-MLP norm's stacked leaf index, its path), `paths` {index: path}
    of every layer leaf and `treedef` the layer's tree."""
    axes: dict
    names: dict
    width: int
    norm: tuple
    paths: dict
    treedef: object


def mlp_weights(c, params_layers) -> dict | None:
    """{k: (name, F axis)} for each MLP weight among the stacked layer params (k: its position
    in their flatten order, the axis counted with the layer axis), {} where the layer has none,
    None where one's F axis is not known (no axis, or several, of F's size)."""
    out = {}
    for k, (path, x) in enumerate(jax.tree_util.tree_flatten_with_path(params_layers)[0]):
        names = tuple(p.key for p in path)
        if names[0] == "mlp" and len(names) == 2:
            f = [a for a in range(1, len(x.shape)) if x.shape[a] == c.intermediate_size]
            if len(f) != 1:
                return None
            out[k] = (names[1], f[0])
    return out


def plan(c, params_layers, stacked: list, width: int) -> Slabs | None:
    """`Slabs` of width `width` (inbackward_rules.mlp_slabs) for the stacked layer leaves
    `params_layers` (their indices among all the params' leaves `stacked`), or None where
    `width` is 0 or the layer is not one it knows how to cut."""
    weights = mlp_weights(c, params_layers) if width else None
    if not weights:
        return None
    paths = [tuple(k.key for k in p) for p, _ in
             jax.tree_util.tree_flatten_with_path(params_layers)[0]]
    pre = c.norms.before_mlp  # the norm feeding the MLP (jaxmem.families.norms)
    norm = [(i, path) for i, path in zip(stacked, paths) if pre is not None and path[0] == pre]
    if len(norm) != 1:  # a block without one pre-MLP norm: not one this module knows
        return None
    return Slabs({stacked[k]: ax for k, (_, ax) in weights.items()},
                 {stacked[k]: name for k, (name, _) in weights.items()}, width, norm[0],
                 dict(zip(stacked, paths)), jax.tree_util.tree_structure(params_layers))


def layer_in_slabs(step, u, slabs: Slabs, l, ps: dict, sts: dict, x, dx, a, fact):
    """Layer `l`'s backward and update (module docstring) -> (dx, ps, sts, sum of squared
    gradients, finite); `step` the _InBackwardStep (its cast and the model), `u` its _Updates,
    ps / sts {stacked index: the whole stacked leaf / its state}."""
    c, w = step.c, slabs.width
    n = c.intermediate_size // w
    treedef = slabs.treedef
    leaves = [jax.lax.dynamic_index_in_dim(ps[i], l, 0, keepdims=False)
              if i not in slabs.axes else None for i in u.stacked]
    lp = treedef.unflatten(leaves)
    attn = {k: v for k, v in lp.items() if k != "mlp"}
    half = lambda part, **kw: DecoderBlock(c.replace(**kw), step.einsum, part=part)  # noqa
    attention, mlp = half("attention"), half("mlp", intermediate_size=w)
    mid, vjp_attn = jax.vjp(
        lambda p, x: attention.apply({"params": step.cast(p)}, x, a["ctx"], fact)[0], attn, x)
    i_norm, norm_path = slabs.norm
    scale = lp[norm_path[0]]

    def slab(j, carry):
        d_mid, d_scale, pm, sm, ss, fin = carry
        start = j * w
        ws = {slabs.names[i]: slab_at(pm[i], l, ax, start, w)[0]  # a copy of w / F of it
              for i, ax in slabs.axes.items()}
        _, vjp = jax.vjp(lambda p, h: mlp.apply({"params": step.cast(p)}, h, a["ctx"])[0],
                         {norm_path[0]: scale, "mlp": ws}, mid)
        dp, dm = vjp(dx)
        grads = {i: dp["mlp"][slabs.names[i]] for i in slabs.axes}
        ss_s, finite = u.stats(grads)
        for i, ax in slabs.axes.items():
            pm[i], sm[i] = u.parts.slab(i, l, ax, start, grads[i][None], pm[i], sm[i], finite)
        d_scale = jax.tree_util.tree_map(lambda s, g: s + g.astype(jnp.float32), d_scale,
                                         dp[norm_path[0]])
        return (d_mid + dm.astype(jnp.float32), d_scale, pm, sm, ss + ss_s, fin & finite)

    zeros32 = lambda t: jax.tree_util.tree_map(  # noqa: E731
        lambda y: jnp.zeros(y.shape, jnp.float32), t)
    carry = (jnp.zeros(mid.shape, jnp.float32), zeros32(scale),
             {i: ps[i] for i in slabs.axes}, {i: sts[i] for i in slabs.axes},
             jnp.zeros((), jnp.float32), jnp.asarray(True))
    d_mid, d_scale, pm, sm, ss, fin = jax.lax.fori_loop(0, n, slab, carry)
    ps, sts = {**ps, **pm}, {**sts, **sm}
    # the pre-MLP norm (its gradient summed over the slabs), then the attention half
    grads = {i_norm: jax.tree_util.tree_leaves(d_scale)[0].astype(ps[i_norm].dtype)}
    d_attn, dx = vjp_attn(dx + d_mid.astype(dx.dtype))
    grads.update({i: functools.reduce(lambda t, k: t[k], path, d_attn)
                  for i, path in slabs.paths.items() if i not in slabs.axes and i != i_norm})
    ss_a, finite = u.stats(grads)
    ps, sts = u.layer(l, grads, ps, sts, finite)
    return dx, ps, sts, ss + ss_a, fin & finite

