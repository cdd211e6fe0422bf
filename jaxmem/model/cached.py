"""Decoding a model with sliding-window layers against its KV caches: one stack per kind of
layer ({"full": [Lf, B, S, K, H], "local": [Ll, B, R, K, H]}, jaxmem.decode.sampling.init_cache),
carried whole through the layer scan, a local layer's keys a ring of the last R <= W slots."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem.model.attention import masked_attention


def attend_cached(c, q, k, v, ctx: dict, local, caches: dict):
    """Decoding a model (c: its ModelConfig) with local layers: caches {"full": (k, v)
    [Lf, B, S, K, H], "local": (k, v) [Ll, B, R, K, H]} (the kinds it has), carried whole
    through the layer scan;
    ctx["slot"] is this layer's index among the layers of its kind.

    A full-attention layer writes this call's k, v at ctx["cache_index"] and attends to its
    cache; a local layer attends to its ring of the last R <= W slots plus the new tokens
    (`layers.window_cache_mask`), then writes the last min(T, R) of them into the ring at
    slot mod R. Where the kind is traced, both writes happen with the other kind's write a
    rewrite of what is there (no cond around the caches: a cond copies them), and a cond
    picks the attention."""
    T, idx, slot = q.shape[1], ctx["cache_index"], ctx["slot"]
    is_local = jnp.asarray(local)
    new = {}
    if "full" in caches:
        def write(buf, x):  # [Lf, B, S, K, H]
            old = jax.lax.dynamic_slice(buf, (slot, 0, idx, 0, 0), (1, *x.shape))[0]
            x = jnp.where(is_local, old, x.astype(buf.dtype))
            return jax.lax.dynamic_update_slice(buf, x[None], (slot, 0, idx, 0, 0))
        new["full"] = tuple(write(b, x) for b, x in zip(caches["full"], (k, v)))
    if "local" in caches:
        ring_k, ring_v = (jax.lax.dynamic_index_in_dim(b, slot, 0, keepdims=False)
                          for b in caches["local"])  # [B, R, K, H]
        R = ring_k.shape[1]
        n = min(T, R)
        at = jnp.mod(idx + T - n + jnp.arange(n), R)  # the ring slots of the last n tokens

        def ring_write(buf, ring, x):
            ring = ring.at[:, at].set(jnp.where(is_local, x[:, T - n:].astype(ring.dtype),
                                                ring[:, at]))
            return jax.lax.dynamic_update_index_in_dim(buf, ring, slot, 0)
        new["local"] = tuple(ring_write(b, r, x) for b, r, x in
                             zip(caches["local"], (ring_k, ring_v), (k, v)))

    def full_attention():
        kf, vf = (jax.lax.dynamic_index_in_dim(b, slot, 0, keepdims=False) for b in new["full"])
        return masked_attention(q.astype(kf.dtype), kf, vf, ctx["mask"])

    def local_attention():
        kl, vl = (jnp.concatenate([r, x.astype(r.dtype)], axis=1)
                  for r, x in ((ring_k, k), (ring_v, v)))  # [B, R + T, K, H]
        return masked_attention(q.astype(kl.dtype), kl, vl, ctx["mask_local"])

    if "full" not in caches:
        return local_attention(), new
    if "local" not in caches:
        return full_attention(), new
    return jax.lax.cond(is_local, local_attention, full_attention), new
