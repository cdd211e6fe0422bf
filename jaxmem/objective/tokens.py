"""Next-token cross-entropy over a batch dict, in fp32, ignoring padding: the causal-LM
objective's loss (jaxmem.objective.CausalLM), here below jaxmem.train so that the objectives,
which the train step imports, import nothing of jaxmem.train.

A batch is a dict of int arrays [B, T]: `inputs`, `targets`, and `mask` (1 for real tokens,
0 for padding). The mask is the loss weight; attention sees it only when asked
(`attention_padding=True`, for left-padded batches): with right padding the causal mask already
hides padded keys from every real query.

Packed batches carry two more int32 keys: `segment_ids` (0 = padding, k = the k-th example of
the row) and `positions` (0 at each example's first token). They go to the model as they are:
attention stays within a segment and RoPE restarts per example, so a packed row's loss and
gradients are those of its examples run one by one (tests/test_packing.py). Without them the
model is called exactly as before (bitwise).

`token_loss` is the loss of the train step (jaxmem.train.step, through the objective) and of
every memory and remat measurement (jaxmem.memory.compiled, tests/test_remat.py,
tests/test_planner.py), so what is measured is what trains.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem.loss.chunked import chunked_cross_entropy, resolve_loss_chunk
from jaxmem.model.precision import cast_params


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array):
    """(sum of token losses, number of weighted tokens), both fp32.

    logits [B, T, V] (fp32), targets [B, T] int, weights [B, T] in {0, 1}.
    """
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [B, T]
    w = weights.astype(jnp.float32)
    return jnp.sum((logz - picked) * w), jnp.sum(w)


def token_loss(model, params, batch, attention_padding: bool = False, compute_dtype=None,
               loss_chunk: int | None = 0):
    """(sum of token losses, number of real tokens), both fp32: the train step's loss.

    compute_dtype: cast the params (norm scales excepted) to it first. The cast belongs inside
        the differentiated function, so the gradients come back in the stored params' dtype
        (fp32 for the amp masters) and the backward keeps the compute copies it multiplies by.
    attention_padding: pass `mask` to attention as well (left-padded batches); False runs
        attention causal-only (cuDNN flash attention on GPU) and padding is removed by the
        loss weights alone.
    loss_chunk: 0 computes the [B, T, V] logits (eval keeps them); None (auto) or N > 0 fuses
        the LM head into the loss in sequence chunks (jaxmem.loss.chunked), never holding
        the logits. The train step passes its StepConfig.loss_chunk.
    The caller divides by the token count it wants (the train step: the whole step's tokens).
    """
    if compute_dtype is not None:
        params = cast_params(params, compute_dtype)
    pad = batch["mask"] if attention_padding else None
    packed = {k: batch[k] for k in ("segment_ids", "positions") if k in batch}  # [B, T] each
    B, T = batch["inputs"].shape
    chunk = resolve_loss_chunk(loss_chunk, B, T, model.config)
    if chunk:
        x, head, layout = model.apply({"params": params}, batch["inputs"], padding_mask=pad,
                                      return_hidden=True, **packed)  # [B, T, D], [V, D] or [D, V]
        return chunked_cross_entropy(x, head, batch["targets"], batch["mask"], chunk,
                                     layout=layout)
    logits = model.apply({"params": params}, batch["inputs"], padding_mask=pad,
                         **packed)  # [B, T, V] fp32
    return cross_entropy(logits, batch["targets"], batch["mask"])
