"""8-bit AdamW updated and applied in place, one pass per leaf: `AdamW8bitInPlace`.

    opt = AdamW8bitInPlace(learning_rate, b1, b2, eps, weight_decay, mask, clip_norm=...)
    opt.tx                                  the optax GradientTransformation it equals:
                                            [clip_by_global_norm(clip_norm),] adamw_8bit(...)
    opt.init(params) -> state               opt.tx.init(params): one state type for both
    opt.update_and_apply(grads, state, params, *, key=None, where=True) -> (params, state)
                                            opt.tx.update + optax.apply_updates (or
                                            apply_updates_sr with stochastic_rounding), in place

An optax chain hands whole-leaf arrays from link to link (new codes and scales, the updates, the
new weights), each a fresh buffer of the leaf's size while the old ones are live. Here a leaf of
more than CHUNK (2^24) elements is one lax.fori_loop over row pieces (`row_chunks`; the pieces of
apply_updates_sr, so the same random bits) whose carry is the leaf's weights, codes and scales: a
piece is read with a dynamic slice, clipped, put through Adam (`adam_piece`, the kernel of
scale_by_adam_8bit), decayed, scaled by -lr, added to the weights and written back with a dynamic
update slice (jaxmem.optim._inplace.apply_leaf_in_place), so under jit with donation XLA updates
the state's buffers in place. Each line of the piece mirrors one optax link with the same dtypes,
so the codes, scales and counts are bitwise those of `opt.tx`, and so are the weights of 8-bit
leaves (the fp32-moment leaves may round an fp32 ulp apart where XLA contracts a multiply-add
differently in the two programs).

`where` is honoured without a conditional (jaxmem.optim.Optimizer's contract): a large leaf's loop
runs `where ? n : 0` times, so a skipped step runs no piece and its carry stays bitwise; small
leaves and the counts pick new or old with jnp.where.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jaxmem.bits import tree_norm
import jaxmem.optim._stochastic as sr
import jaxmem.optim._kernel as _kernel
from jaxmem.optim._adamw8bit import (BLOCK, KeepFp32, LayerAxes, Quantized, ScaleByAdam8bitState,
                                     adam_piece, adamw_8bit, bias_corrections, step_salt)
from jaxmem.optim._blockwise import _axes, take_constant
from jaxmem.optim._inplace import InPlaceParts, apply_leaf_in_place
from jaxmem.optim._partwise import Parts

# (path, leaf shape) -> the leaf's NamedSharding on a mesh, or None where it is not split
Placement = Callable[[Any, tuple], Any]


class StepScalars(NamedTuple):
    """The numbers one step of `AdamW8bitInPlace` shares across its leaves (`pieces`): the bias
    corrections, the moments' rounding salt (None: nearest), -lr, and with clipping the global
    gradient norm and whether it is under the clip (None without)."""

    c1: Any
    c2: Any
    salt: Any
    step_size: Any
    g_norm: Any
    trigger: Any


@dataclasses.dataclass(frozen=True)
class AdamW8bitInPlace:
    r"""`adamw_8bit` (after `optax.clip_by_global_norm(clip_norm)` when clip_norm > 0) as a
    jaxmem.optim.Optimizer that updates and applies in one in-place pass per leaf.

    With :math:`Q` the block-wise 8-bit quantization of `adamw_8bit` and :math:`c` the clip
    factor :math:`\min(1, \text{clip\_norm} / \lVert g \rVert)` (1 without clipping), one step
    on a leaf :math:`\theta` is

    .. math::
      m = \beta_1 Q^{-1}(\hat m) + (1 - \beta_1) c g,\quad
      v = \beta_2 Q^{-1}(\hat v) + (1 - \beta_2) (c g)^2,\quad
      \hat m, \hat v \leftarrow Q(m), Q(v),\\
      \theta \leftarrow \theta - \eta_t \left(\frac{m / (1 - \beta_1^t)}
        {\sqrt{v / (1 - \beta_2^t)} + \epsilon} + \lambda \theta\right)

    computed in fp32 and cast to the leaf's dtype (stochastically rounded for bf16 leaves with
    `stochastic_rounding`; :math:`\lambda` only where `mask` is True).

    Fields:
      learning_rate, b1, b2, eps, weight_decay, mask, keep_fp32, block_size, layer_axes,
        stochastic_moments: `adamw_8bit`'s.
      clip_norm: > 0: clip the gradients by this global norm first; 0: no clipping.
      stochastic_rounding: bf16 leaves get p + u in fp32 rounded stochastically (the keys of
        `apply_updates_sr`); `update_and_apply` then needs a `key` on every call.
      placement: `(path, shape) -> NamedSharding | None` for the leaves of params on a mesh;
        a leaf with a sharding is updated shard by shard inside a `shard_map` (`apply_placed`),
        so the update never gathers it. None: every leaf updated as one array.
      update_kernel: "xla" (row pieces in a loop, XLA's kernels) or "pallas": a large 8-bit
        bf16 leaf updated on the device without a sharding is one Pallas kernel
        (jaxmem.optim._kernel: the same piece function, its numbers the loop's on CPU up to
        XLA's excess precision; a Triton kernel on a GPU, its equality not yet measured).

    Guarantees: `init` is `tx.init`, so states move between the two freely; `update_and_apply`
    gives the codes, scales and counts of `tx.update` bitwise, and, without stochastic
    rounding, the new weights of 8-bit leaves as `optax.apply_updates` does, bitwise.
    `where=False`: params and state come back bitwise, with no conditional in the program.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from jaxmem.optim import AdamW8bitInPlace
      >>> opt = AdamW8bitInPlace(1e-3, clip_norm=1.0)
      >>> params = {"w": jnp.ones((64, 128)), "b": jnp.zeros(128)}
      >>> grads = jax.tree.map(jnp.ones_like, params)
      >>> new, state = opt.update_and_apply(grads, opt.init(params), params)
      >>> updates, ref_state = opt.tx.update(grads, opt.init(params), params)
      >>> bool((optax.apply_updates(params, updates)["w"] == new["w"]).all())
      True
      >>> state[1][0].mu["w"].codes.dtype, int(state[1][0].count)
      (dtype('uint8'), 1)
      >>> same, _ = opt.update_and_apply(grads, state, new, where=False)
      >>> bool((same["w"] == new["w"]).all())
      True
    """

    learning_rate: float | optax.Schedule
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 1e-4
    mask: Any | Callable[[Any], Any] | None = None
    clip_norm: float = 0.0
    keep_fp32: KeepFp32 | None = None
    block_size: int = BLOCK
    layer_axes: LayerAxes | None = None
    stochastic_moments: bool = True
    stochastic_rounding: bool = False
    placement: Placement | None = None
    update_kernel: str = "xla"

    @property
    def tx(self) -> optax.GradientTransformation:
        """The optax transformation this equals; its state is this optimizer's."""
        adamw = adamw_8bit(self.learning_rate, self.b1, self.b2, self.eps, self.weight_decay,
                           self.mask, keep_fp32=self.keep_fp32, block_size=self.block_size,
                           layer_axes=self.layer_axes,
                           stochastic_moments=self.stochastic_moments)
        if self.clip_norm > 0:
            return optax.chain(optax.clip_by_global_norm(self.clip_norm), adamw)
        return adamw

    def init(self, params):
        """`tx.init(params)`."""
        return self.tx.init(params)

    def moments(self, state) -> ScaleByAdam8bitState:
        """The `ScaleByAdam8bitState` inside `state` (its mu and nu have params' structure)."""
        return self._split(state)[1]

    def _split(self, state):
        """(clip state or None, adam state, decay state, learning-rate state) of `tx`'s state."""
        clip_state, inner = state if self.clip_norm > 0 else (None, state)
        adam, decay, sched = inner
        if not isinstance(adam, ScaleByAdam8bitState):
            raise TypeError(f"not an AdamW8bitInPlace state: found {type(adam).__name__}")
        return clip_state, adam, decay, sched

    def update_and_apply(self, grads, state, params, *, key: jax.Array | None = None,
                         where: jax.Array | bool = True):
        """(new params, new state): `tx.update` then the update applied, leaf by leaf in place.

        Args:
          grads: params' structure, any float dtypes.
          state: from `init` (or `tx.init`), or from an earlier call.
          params: the weights; bf16 leaves rounded stochastically with `stochastic_rounding`.
          key: a PRNG key, required with `stochastic_rounding` (leaf i draws from
            fold_in(key, i), row piece j of a large leaf from fold_in(fold_in(key, i), j)).
          where: bool scalar; False returns params and state bitwise as given.
        """
        if self.stochastic_rounding and key is None:
            raise ValueError("AdamW8bitInPlace(stochastic_rounding=True) needs a key")
        key = key if self.stochastic_rounding else None
        if self.update_kernel not in ("xla", "pallas"):
            raise ValueError(f"update_kernel {self.update_kernel!r}: choose xla or pallas")
        finite = jnp.asarray(where)
        scalars, finish = self.step_scalars(
            state, tree_norm(grads) if self.clip_norm > 0 else None)
        piece = self.piece_of(scalars)
        adam = self.moments(state)
        paths, treedef = jax.tree_util.tree_flatten_with_path(params)
        cols = [treedef.flatten_up_to(t) for t in (grads, adam.mu, adam.nu, self.decays(params))]
        new = []
        for i, ((path, p), g, m, v, decays) in enumerate(zip(paths, *cols)):
            leaf_key = sr.pieces(key, p, leaf=i).key
            if self.update_kernel == "pallas" and self._unplaced(path, p) and \
                    _kernel.eligible(g, m, v, p, leaf_key):
                new.append(_kernel.update_leaf(self, scalars, g, m, v, p, decays, leaf_key,
                                               finite))
                continue
            new.append(self.apply_placed(path, piece, g, m, v, p, decays, leaf_key, finite))
        new_p, new_m, new_v = (treedef.unflatten(list(col)) for col in zip(*new))
        return new_p, finish(new_m, new_v, finite)

    def split(self, state, params, *, key: jax.Array | None = None) -> Parts:
        """This optimizer's next step on `params` from `state`, part by part
        (jaxmem.optim.Parts), through `pieces`: each part's numbers and random bits are those of
        `update_and_apply` (`key` required with stochastic_rounding). A leaf's state is its
        (m, v). No clipping (it needs every gradient first): ValueError where clip_norm > 0."""
        if self.clip_norm > 0:
            raise ValueError("AdamW8bitInPlace.split cannot clip by the global norm")
        if self.stochastic_rounding and key is None:
            raise ValueError("AdamW8bitInPlace(stochastic_rounding=True) needs a key")
        return InPlaceParts(self, state, params, key if self.stochastic_rounding else None)

    def decays(self, params):
        """Per leaf of params, whether weight decay applies (`mask` resolved; None: all)."""
        if self.mask is None:
            return jax.tree_util.tree_map(lambda _: True, params)
        return self.mask(params) if callable(self.mask) else self.mask

    def pieces(self, state, g_norm: jax.Array | None = None):
        """(piece, finish) of one step from `state`, for callers that walk the leaves themselves
        (`update_and_apply`; an update applied layer by layer inside the backward pass):

            piece(g, m, v, p, decays, pkey, bits=None) -> (new p, new m, new v)
                a piece of a leaf (m, v: its `Quantized` or fp32 moments): clip by `g_norm`
                (required when clip_norm > 0: the global norm of all the gradients), Adam,
                decay where `decays`, times -lr, add; bf16 leaves under stochastic_rounding
                are rounded with `pkey`'s bits or the given `bits` (uint32 of p's shape)
            finish(new mu tree, new nu tree, finite) -> the new state (counts advanced where
                `finite`, a bool scalar)
        """
        scalars, finish = self.step_scalars(state, g_norm)
        return self.piece_of(scalars), finish

    def step_scalars(self, state, g_norm: jax.Array | None = None):
        """(StepScalars, finish) of one step from `state`: `pieces` before its piece function
        is made from the scalars (`piece_of`)."""
        clip_state, adam, decay, sched = self._split(state)
        count = optax.safe_int32_increment(adam.count)
        c1, c2 = bias_corrections(count, self.b1, self.b2)
        lr = self.learning_rate
        trigger = None if g_norm is None else jnp.squeeze(g_norm < self.clip_norm)
        scalars = StepScalars(c1=c1, c2=c2,
                              salt=step_salt(count) if self.stochastic_moments else None,
                              step_size=-1 * (lr(sched.count) if callable(lr) else lr),
                              g_norm=g_norm, trigger=trigger)

        def finish(mu, nu, finite):
            new_adam = ScaleByAdam8bitState(count=jnp.where(finite, count, adam.count),
                                            mu=mu, nu=nu)
            new_sched = sched
            if callable(lr):
                new_sched = sched._replace(count=jnp.where(
                    finite, optax.safe_int32_increment(sched.count), sched.count))
            inner = (new_adam, decay, new_sched)
            return (clip_state, inner) if self.clip_norm > 0 else inner

        return scalars, finish

    def piece_of(self, s: "StepScalars", take=take_constant, divide=jnp.divide):
        """`pieces`' piece function on the step's scalars `s`; the fused kernel (jaxmem.optim.
        _kernel) builds it inside itself with its own `take` (how the 8-bit maps are read,
        `quantize`'s) and, for Triton, which has no bf16 division, its own `divide`."""
        wd, clip, rounds = self.weight_decay, self.clip_norm, self.stochastic_rounding

        def piece(g, m, v, p, decays, pkey, bits=None):
            if clip > 0:  # clip_by_global_norm
                g = jax.lax.select(s.trigger, g, divide(g, s.g_norm.astype(g.dtype)) * clip)
            u, m, v = adam_piece(g, m, v, s.c1, s.c2, self.b1, self.b2, self.eps, s.salt, take)
            if decays and wd != 0.0:  # add_decayed_weights (masked)
                u = u + wd * p
            u = jnp.asarray(s.step_size, dtype=u.dtype) * u  # no copy: a kernel has none
            if pkey is None and bits is None:
                if rounds:  # apply_updates_sr's non-bf16 leaves
                    return (p.astype(jnp.float32) + u.astype(jnp.float32)).astype(p.dtype), m, v
                return jnp.asarray(p + u).astype(p.dtype), m, v  # optax.apply_updates
            total = p.astype(jnp.float32) + u.astype(jnp.float32)
            if bits is not None:
                return sr.round_bf16_bits(total, bits), m, v
            return sr.round_bf16(total, pkey), m, v

        return piece

    def _unplaced(self, path, p) -> bool:
        """The leaf has no sharding of its own (`placement`): updated as one array."""
        return self.placement is None or self.placement(path, p.shape) is None

    def apply_placed(self, path, piece, g, m, v, p, decays, leaf_key, finite):
        """`apply_leaf_in_place` where the leaf lives: with `placement` giving it a sharding,
        each device updates its own shard inside a `shard_map`, in row pieces of its shard, so
        the update never gathers the leaf (a row piece of the whole leaf would cross the shards
        of an inner axis). Blocks run along the last axis of the leaf's block view (its last
        k axes merged): a split there must be on the first of the k axes only, with each shard
        holding whole blocks, else the leaf is updated whole. bf16 rounding on a shard draws from
        fold_in(leaf_key, the shard's index): other bits than one device's, as unbiased."""
        sharding = None if self.placement is None else self.placement(path, p.shape)
        if sharding is None or not isinstance(m, Quantized):
            return apply_leaf_in_place(piece, g, m, v, p, decays, leaf_key, finite)
        mesh, spec = sharding.mesh, P(*sharding.spec, *[None] * (p.ndim - len(sharding.spec)))
        sizes = dict(mesh.shape)
        axes_of = lambda e: () if e is None else (e if isinstance(e, tuple) else (e,))  # noqa: E731
        split = tuple(a for e in spec for a in axes_of(e))
        k = _axes(m)  # the axes the blocks run over (`block_axes`)
        cut = int(np.prod([sizes[a] for a in axes_of(spec[-k])]))
        merged = int(np.prod(p.shape[-k:]))
        if any(e is not None for e in spec[p.ndim - k + 1:]) or \
                (cut > 1 and (merged // cut) % m.block):
            return apply_leaf_in_place(piece, g, m, v, p, decays, leaf_key, finite)
        # each block's scale with its codes (the state may keep small scales whole: then each
        # device takes its slice, and the jit's out_shardings put it back)
        moment = Quantized(codes=spec, scale=P(*spec[:p.ndim - k], spec[-k] if cut > 1 else None),
                           block=m.block)

        def body(g, m, v, p, finite, *key):
            k = jax.random.fold_in(key[0], jax.lax.axis_index(split)) if key else None
            return apply_leaf_in_place(piece, g, m, v, p, decays, k, finite)

        keys = () if leaf_key is None else (leaf_key,)
        run = jax.shard_map(body, mesh=mesh, in_specs=(spec, moment, moment, spec, P())
                            + (P(),) * len(keys), out_specs=(spec, moment, moment),
                            check_vma=False)
        return run(g, m, v, p, finite, *keys)
