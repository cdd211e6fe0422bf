"""Synthetic and abstract batches; `cross_entropy` and `token_loss` (the causal-LM loss) are
jaxmem.objective.tokens', re-exported here where the train step's callers have always found them."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem.objective.tokens import cross_entropy, token_loss  # noqa: F401  (re-exported)


def synthetic_batch(rng: jax.Array, batch_size: int, seq_len: int, vocab_size: int,
                    pad_fraction: float = 0.0):
    """A random batch (for tests and memory measurements); the last `pad_fraction` is padding."""
    tokens = jax.random.randint(rng, (batch_size, seq_len + 1), 0, vocab_size, jnp.int32)
    n_real = seq_len - int(round(pad_fraction * seq_len))
    mask = (jnp.arange(seq_len) < n_real).astype(jnp.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "mask": jnp.broadcast_to(mask, (batch_size, seq_len))}


def abstract_batch(batch_size: int, seq_len: int, packed: bool = False):
    """Batch shapes for ahead-of-time compilation (packed: with segment_ids and positions)."""
    s = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    keys = ("inputs", "targets", "mask") + (("segment_ids", "positions") if packed else ())
    return {k: s for k in keys}
