"""Context parallelism: the sequence split over the `context` mesh axis, causal load balanced.

    with context_parallel(mesh):            # jaxmem.train.placement installs it with the rules
        batch = balance(batch, c)           # the sequence permuted once, at the step's edge
        ... the model traced as usual ...   # attention: `context_attention` below

Layout. A row of T tokens is cut into 2c chunks of L = T / 2c; device i of the `context` axis
holds chunk i and its mirror 2c-1-i (`slot_index`). Causal attention work is then the same on
every device (a chunk near the start sees few keys, its mirror many). The permutation is applied
once to every [.., T] array of the batch (tokens, targets, mask, segment ids, positions: made
explicit first so RoPE keeps the true positions) before the model, and everything per token
(embedding, norms, MLP, RoPE, the loss: a sum over tokens) is indifferent to the order of T.
Only attention compares positions; it masks by the true index (`slot_index`), not by slot.

Attention. Inside a `shard_map` over the mesh, each device all-gathers K and V (and the segment
ids) over `context` and attends its T/c local queries to all T keys with the query-chunked,
memory-linear XLA path (`attention.indexed_attention`). The backward's dK, dV are reduce-
scattered back (the transpose of the all-gather). Per layer and device this holds the gathered
K, V ([B, T, K, H] each, compute dtype) and one chunk of fp32 probabilities; it moves
2 x (c-1)/c x B x T x K x H elements forward and the same again (reduce-scatter) backward
(docs/long-context.md). The choice is MaxText's (all-gather, load-balanced): with GQA, K and V
are small against the activations (8B: K x H = 1024 against D = 4096), and it needs no ring.

With no context mesh installed (one device, or context=1) nothing here is used and the model's
graph is the one it always was.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

AXIS = "context"
BATCH = ("data", "fsdp")

_MESH: contextvars.ContextVar = contextvars.ContextVar("jaxmem_context_mesh", default=None)


@contextlib.contextmanager
def context_parallel(mesh):
    """Attention traced inside the block runs context-parallel on `mesh` (None, or a mesh whose
    `context` axis has size 1: not at all)."""
    use = mesh if mesh is not None and dict(mesh.shape).get(AXIS, 1) > 1 else None
    token = _MESH.set(use)
    try:
        yield
    finally:
        _MESH.reset(token)


def context_mesh():
    """The installed mesh with context > 1, or None."""
    return _MESH.get()


def slot_index(T: int, c: int) -> np.ndarray:
    """int [T]: the true sequence index of each slot of the balanced layout (device i's slots
    are c-contiguous blocks of T/c: chunk i, then chunk 2c-1-i)."""
    L = T // (2 * c)
    chunks = np.stack([np.array([i, 2 * c - 1 - i]) for i in range(c)]).reshape(-1)  # [2c]
    return (chunks[:, None] * L + np.arange(L)[None, :]).reshape(-1)


def balance(batch: dict, c: int, axis: int = -1) -> dict:
    """The batch's [.., T] arrays in the balanced layout, with `positions` (0..T-1 when absent)
    made explicit; c == 1: the batch itself."""
    if c == 1:
        return batch
    T = batch["inputs"].shape[axis]
    if T % (2 * c):
        raise ValueError(f"context parallelism over {c} devices needs a sequence length "
                         f"divisible by {2 * c}, got {T}")
    out = dict(batch)
    if "positions" not in out:
        x = out["inputs"]
        out["positions"] = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), x.shape)
    idx = slot_index(T, c)
    return {k: jnp.take(v, idx, axis=axis) for k, v in out.items()}


def context_attention(q, k, v, segment_ids, mesh, indexed_attention, window=None):
    """Causal attention of q [B, T, N, H] over k, v [B, T, K, H] (slots in the balanced layout,
    T split over `context`) -> [B, T, N, H]; segment ids [B, T] (packed rows) or None.

    indexed_attention(q, k, v, q_idx, k_idx[, q_seg, k_seg, window]): each device's local
    attention, masked by true sequence index (jaxmem.model.attention.indexed_attention, passed
    in by its caller so that this module does not import attention, which imports it).
    window: a sliding window W (static int) or None. It is applied as a mask by true index
    (q - k < W): correct, but every local query chunk still reads all T gathered keys, so a
    window saves no memory or work here."""
    c = mesh.shape[AXIS]
    T = q.shape[1]
    t = dict(mesh.shape).get("tensor", 1)
    heads = "tensor" if t > 1 and q.shape[2] % t == 0 and k.shape[2] % t == 0 else None
    act = P(BATCH, AXIS, heads, None)
    seg = P(BATCH, AXIS)
    k_idx = jnp.asarray(slot_index(T, c))  # [T]: the gathered keys' true indices

    def body(q, k, v, *ids):
        i = jax.lax.axis_index(AXIS)
        q_idx = jax.lax.dynamic_slice_in_dim(k_idx, i * (T // c), T // c)  # [T/c]
        k_all = jax.lax.all_gather(k, AXIS, axis=1, tiled=True)  # [B, T, K, H]
        v_all = jax.lax.all_gather(v, AXIS, axis=1, tiled=True)
        if ids:
            s_all = jax.lax.all_gather(ids[0], AXIS, axis=1, tiled=True)  # [B, T]
            return indexed_attention(q, k_all, v_all, q_idx, k_idx, ids[0], s_all, window)
        return indexed_attention(q, k_all, v_all, q_idx, k_idx, None, None, window)

    args = (q, k, v) + (() if segment_ids is None else (segment_ids,))
    specs = (act, act, act) + (() if segment_ids is None else (seg,))
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=act, check_vma=False)(*args)
