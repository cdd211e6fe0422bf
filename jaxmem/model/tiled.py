"""The SwiGLU MLP in sequence tiles: under full remat its backward holds one tile's [B, Tc, F].

    tiled_mlp(x, w_gate, w_up, w_down, einsum, chunk)   down(silu(x Wg) * (x Wu)), tiled over T
                                                      (or Gemma's GELU-tanh gate)

Under `--remat full` the backward of a block recomputes the MLP and then differentiates it: the
gate, up and hidden activations and their gradients, [B, T, F] each (F = 3.5 D in Llama 3 8B), are the
largest buffers of a remat'd step once attention runs in query chunks and the loss is fused
(measured with XLA's buffer assignment: eight fp32 [B*T, F] buffers at llama-3.2-1b). Like
attention and the loss, the MLP then runs a sequence tile at a time (a scan keeping the batch
axis whole; ALST's "tiled MLP"): a custom VJP keeps only x and the weights, and its backward
recomputes each tile's activations, returns that tile's d(x) and sums the weight gradients in
fp32 across tiles. The MLP's output is not needed by the block's backward (it is only added
to the residual stream), so the remat'd forward need not recompute it and dead-code elimination
should drop it; not verified with a FLOP count, because XLA's `cost_analysis()` counts a loop
body once (docs/memory.md).

Used only where it changes nothing else (jaxmem.families.decoder decides; the eval forward,
which differentiates nothing, is built under `full`: jaxmem.train.step.EVAL_REMAT): under `full`
remat (or a `names:` or `offload:` policy naming no MLP tag, e.g. `offload:block_input`: the tags live inside the tile, where no policy sees them),
with the plain einsum or an einsum with a `prepare_weight` hook (fp8), and when a [B, T, F]
fp32 activation is over TILE_BYTES. fp8 in tiles: each tile's activations get their own
current scale (a finer scaling than one per tensor, not bitwise the untiled values), and the
weights are quantized once per call (`prepare_weight`), not once per tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmem.model.lean import swiglu
from jaxmem.einsum import project

TILE_BYTES = 64 * 2**20  # fp32 [B, Tc, F] per tile
# Tiles only from more than this many tokens per unit of model width D: below, the tiles' fp32
# weight-gradient sums (3 x D x F x 4 bytes) outweigh the [B, T, F] activations tiling saves.
# llama-3-8b bf16-sr remat full at 1 x 2048 (2,048 <= 3 x 4,096), the H100's compiled step:
# untiled 48.37 GiB and 0.41 s predicted, in two tiles 49.03 GiB and 0.50 s (issue 51).
# The in-backward step's rule is the same (jaxmem.train.inbackward_rules.mlp_tiles).
TILE_MIN_TOKENS_PER_WIDTH = 3


def tiles_under(remat) -> bool:
    """Whether a remat policy (jaxmem.model.remat.RematPolicy) lets the MLP run in tiles: `full`,
    or a `names:` / `offload:` policy naming no MLP tag (the tags live inside the tile, where no
    policy sees them), unless the policy says `+untiled` (RematPolicy.mlp_tiles False).
    jaxmem.families.decoder, the step's footprint and the analytic planner all ask this."""
    if not getattr(remat, "mlp_tiles", True):
        return False
    return remat.kind == "full" or (remat.kind in ("names", "offload") and not any(
        t.startswith("mlp_") for t in remat.names))


def mlp_tile(batch: int, seq_len: int, ffn: int, hidden: int | None = None) -> int:
    """Sequence positions per MLP tile (seq_len: no tiling): a tile's fp32 [B, Tc, F] within
    TILE_BYTES; given the model's width `hidden`, no tiling at batch x seq_len <=
    TILE_MIN_TOKENS_PER_WIDTH x hidden tokens (`tiling_pays`)."""
    if hidden is not None and not tiling_pays(batch * seq_len, hidden):
        return seq_len
    return max(1, min(seq_len, TILE_BYTES // (batch * ffn * 4)))


def tiling_pays(tokens: int, hidden: int) -> bool:
    """Whether the MLP's [B, T, F] activations outweigh the tiles' fp32 weight-gradient sums:
    more than TILE_MIN_TOKENS_PER_WIDTH x hidden tokens (on one device)."""
    return tokens > TILE_MIN_TOKENS_PER_WIDTH * hidden


def _mlp(einsum, gated, x, wg, wu, wd):
    gate = project("BTD,DF->BTF", x, wg, einsum)  # [B, Tc, F]
    up = project("BTD,DF->BTF", x, wu, einsum)  # [B, Tc, F]
    return project("BTF,FD->BTD", gated(gate, up), wd, einsum)  # [B, Tc, D]


def _tiles(x, chunk):
    """[B, T, D] -> [n, B, chunk, D], zero-padded (a zero row gives zero and gets no gradient)."""
    B, T, D = x.shape
    n = -(-T // chunk)
    x = jnp.pad(x, [(0, 0), (0, n * chunk - T), (0, 0)])
    return jnp.moveaxis(x.reshape(B, n, chunk, D), 1, 0)


def _untile(a, T):
    n, B, chunk, D = a.shape
    return jnp.moveaxis(a, 0, 1).reshape(B, n * chunk, D)[:, :T]


def _prepared(einsum, ws, like=None):
    """The weights as `einsum` multiplies one weight many times: fp8 quantizes each once here,
    not once per tile (`prepare_weight`, jaxmem.model.fp8); other einsums take them as they are."""
    prepare = getattr(einsum, "prepare_weight", None)
    if prepare is None:
        return tuple(ws)
    return tuple(prepare(w, like=p) for w, p in zip(ws, like or (None,) * len(ws)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def tiled_mlp(x, wg, wu, wd, einsum, chunk, gated=swiglu):
    """down(gated(x Wg, x Wu)) for x [B, T, D], `chunk` sequence positions at a time (gated:
    jaxmem.model.lean's swiglu or geglu)."""
    ws = _prepared(einsum, (wg, wu, wd))
    ys = jax.lax.map(lambda xc: _mlp(einsum, gated, xc, *ws), _tiles(x, chunk))
    return _untile(ys, x.shape[1])


def _tiled_fwd(x, wg, wu, wd, einsum, chunk, gated=swiglu):
    return tiled_mlp(x, wg, wu, wd, einsum, chunk, gated), (x, wg, wu, wd)


def _is_float(a):
    return jnp.issubdtype(a.dtype, jnp.floating)


def _tiled_bwd(einsum, chunk, gated, res, dy):
    x, *ws = res
    ws = tuple(ws)
    prepared = _prepared(einsum, ws)  # once for all tiles; each tile rebinds it to the weights

    def body(acc, c):
        xc, dc = c  # [B, Tc, D] each
        _, vjp = jax.vjp(lambda xc, *ws: _mlp(einsum, gated, xc,
                                              *_prepared(einsum, ws, prepared)), xc, *ws)
        dxc, *dws = vjp(dc)
        acc = jax.tree_util.tree_map(
            lambda a, d: a + d.astype(jnp.float32) if _is_float(d) else a, acc, tuple(dws))
        return acc, dxc

    zeros = jax.tree_util.tree_map(
        lambda w: jnp.zeros(w.shape, jnp.float32 if _is_float(w) else w.dtype), ws)
    dws, dxs = jax.lax.scan(body, zeros, (_tiles(x, chunk), _tiles(dy, chunk)))
    dws = jax.tree_util.tree_map(
        lambda d, w: d.astype(w.dtype) if _is_float(w) else jnp.zeros(w.shape, jax.dtypes.float0),
        dws, ws)
    return (_untile(dxs, x.shape[1]).astype(x.dtype), *dws)


tiled_mlp.defvjp(_tiled_fwd, _tiled_bwd)
