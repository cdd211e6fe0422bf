"""Next-token cross-entropy over a batch dict, in fp32, ignoring padding.

A batch is a dict of int arrays [B, T]: `inputs`, `targets`, and `mask` (1 for real tokens,
0 for padding). The same mask is the attention padding mask and the loss weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array):
    """(sum of token losses, number of weighted tokens), both fp32.

    logits [B, T, V] (fp32), targets [B, T] int, weights [B, T] in {0, 1}.
    """
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [B, T]
    w = weights.astype(jnp.float32)
    return jnp.sum((logz - picked) * w), jnp.sum(w)


def lm_loss(model, params, batch) -> jax.Array:
    """Mean next-token loss of `model` with `params` on `batch` (fp32 scalar)."""
    mask = batch["mask"]
    logits = model.apply({"params": params}, batch["inputs"], padding_mask=mask)  # [B, T, V]
    total, count = cross_entropy(logits, batch["targets"], mask)
    return total / jnp.maximum(count, 1.0)


def synthetic_batch(rng: jax.Array, batch_size: int, seq_len: int, vocab_size: int,
                    pad_fraction: float = 0.0):
    """A random batch (for tests and memory measurements); the last `pad_fraction` is padding."""
    tokens = jax.random.randint(rng, (batch_size, seq_len + 1), 0, vocab_size, jnp.int32)
    n_real = seq_len - int(round(pad_fraction * seq_len))
    mask = (jnp.arange(seq_len) < n_real).astype(jnp.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "mask": jnp.broadcast_to(mask, (batch_size, seq_len))}


def abstract_batch(batch_size: int, seq_len: int):
    """Batch shapes for ahead-of-time compilation."""
    s = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    return {"inputs": s, "targets": s, "mask": s}
