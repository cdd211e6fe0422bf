import functools
import jax, jax.numpy as jnp, numpy as np
from jax import lax

L, D = 4, 256
DEV, HOST = jax.memory.Space.Device, jax.memory.Space.Host

def upd_fn(w, g):            # stand-in for an optimizer update of one layer (fp32 math, bf16 store)
    return (w.astype(jnp.float32) * 0.999 - 1e-3 * g).astype(w.dtype)

def step_single(w, g, *, offload):
    """reverse loop over layers; w [L, D, D] stacked (host or device), g [L, D, D] on device"""
    def body(i, w):
        l = L - 1 - i
        wl = lax.dynamic_index_in_dim(w, l, 0, keepdims=False)
        if offload:
            wl = jax.device_put(wl, DEV)
        new = upd_fn(wl, g[l])
        if offload:
            new = jax.device_put(new, HOST)
        return lax.dynamic_update_index_in_dim(w, new, l, 0)
    return lax.fori_loop(0, L, body, w)

def adam_layer(w, m, v, g, t=1):
    m = 0.9 * m + 0.1 * g
    v = 0.999 * v + 0.001 * g * g
    wf = w.astype(jnp.float32) - 1e-3 * (m / (1 - 0.9**t)) / (jnp.sqrt(v / (1 - 0.999**t)) + 1e-8)
    return wf.astype(w.dtype), m, v

def step_adam(w, m, v, g, *, offload, prefetch):
    """w bf16, m/v fp32 stacks [L, D, D]; reverse loop; optional double-buffered prefetch:
    the carry holds layer l's device copies, fetched in iteration l+1 (i.e. one ahead)."""
    put_d = (lambda x: jax.device_put(x, DEV)) if offload else (lambda x: x)
    put_h = (lambda x: jax.device_put(x, HOST)) if offload else (lambda x: x)
    get = lambda s, l: lax.dynamic_index_in_dim(s, l, 0, keepdims=False)
    setl = lambda s, x, l: lax.dynamic_update_index_in_dim(s, x, l, 0)
    if not prefetch:
        def body(i, c):
            w, m, v = c
            l = L - 1 - i
            nw, nm, nv = adam_layer(put_d(get(w, l)), put_d(get(m, l)), put_d(get(v, l)), g[l])
            return setl(w, put_h(nw), l), setl(m, put_h(nm), l), setl(v, put_h(nv), l)
        return lax.fori_loop(0, L, body, (w, m, v))
    # prefetch: buf = device copy of layer l; fetch l-1 (clamped) before updating l
    fetch = lambda s, l: put_d(get(s, l))
    buf0 = (fetch(w, L - 1), fetch(m, L - 1), fetch(v, L - 1))
    def body(i, c):
        w, m, v, (bw, bm, bv) = c
        l = L - 1 - i
        nl = jnp.maximum(l - 1, 0)
        nxt = (fetch(w, nl), fetch(m, nl), fetch(v, nl))     # issued before the update of l
        nw, nm, nv = adam_layer(bw, bm, bv, g[l])
        return setl(w, put_h(nw), l), setl(m, put_h(nm), l), setl(v, put_h(nv), l), nxt
    w, m, v, _ = lax.fori_loop(0, L, body, (w, m, v, buf0))
    return w, m, v

def data(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    w = jax.random.normal(k[0], (L, D, D), jnp.float32).astype(jnp.bfloat16)
    m = jax.random.normal(k[1], (L, D, D), jnp.float32) * 0.01
    v = jnp.abs(jax.random.normal(k[2], (L, D, D), jnp.float32)) * 1e-4
    g = jax.random.normal(k[3], (L, D, D), jnp.float32)
    return w, m, v, g
