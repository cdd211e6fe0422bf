"""The objective interface (see jaxmem.objective) and the causal-LM objective, the default.

A batch is a dict of arrays [..., B, T] (the step's [K, B, T], a micro-batch's [B, T]):
`inputs`, `targets`, `mask` (the trained targets), and whatever else an objective's
`batch_keys` name. `sums` and `head_sums` take one micro-batch; `counts` any leading shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxmem.einsum import logits_einsum, project
from jaxmem.loss.chunked import chunked_cross_entropy, chunked_token_logps, resolve_loss_chunk
from jaxmem.model.precision import cast_params
from jaxmem.objective.tokens import cross_entropy, token_loss


class Objective:
    """The interface; every method is answered by each subclass (callers never ask which)."""

    name: str = ""
    batch_keys: tuple[str, ...] = ("inputs", "targets", "mask")
    preference: str | None = None  # the data rows' tokenization (None: SFT rows)
    reference: bool = False  # needs the reference model's per-sequence log-probs
    # the in-backward step may take this objective's head gradient a vocabulary slice at a
    # time (jaxmem.train.inbackward._head_in_slices: the token cross-entropy's own backward);
    # otherwise it differentiates `head_sums` whole
    head_in_slices: bool = False
    rows_per_example: int = 1  # batch rows per example: 2 for a pair
    unit: str = "tokens"  # the count (a key of `counts`) a mean is over: what eval reports

    def counts(self, batch) -> dict:
        """The step's normalisers (fp32 scalars) from the batch's masks: no weights involved."""
        raise NotImplementedError

    def head_sums(self, h, head, layout: str, batch, chunk: int, ref=None) -> dict:
        """The sums of one micro-batch from its final hidden states h [B, T, D] (after the final
        norm) and the head ([D, V], or "VD": the tied embedding [V, D]); chunk: the fused loss's
        (0: [B, T, V] logits); ref: the reference's per-sequence log-prob sums [B] or None."""
        raise NotImplementedError

    def sums(self, model, params, batch, attention_padding: bool = False, compute_dtype=None,
             loss_chunk: int | None = 0, ref=None) -> dict:
        """The sums of one micro-batch [B, T] under `params` (see `head_sums`)."""
        chunk = resolve_loss_chunk(loss_chunk, *batch["inputs"].shape, model.config)
        h, head, layout = hidden(model, params, batch, attention_padding, compute_dtype)
        return self.head_sums(h, head, layout, batch, chunk, ref)

    def value(self, sums: dict, counts: dict, xp=jnp):
        """(loss, metrics): linear in `sums`, so micro-batches and eval batches add. xp: the
        array module (numpy for the evaluation's float64 totals on the host)."""
        raise NotImplementedError

    def flags(self) -> dict:
        """This objective as RunConfig fields ({"objective.objective": ..., ...})."""
        raise NotImplementedError


def hidden(model, params, batch, attention_padding: bool = False, compute_dtype=None):
    """(final hidden states [B, T, D], the head, its layout): the model's return_hidden path,
    with the params cast to `compute_dtype` inside (as `token_loss` does)."""
    if compute_dtype is not None:
        params = cast_params(params, compute_dtype)
    pad = batch["mask"] if attention_padding else None
    packed = {k: batch[k] for k in ("segment_ids", "positions") if k in batch}
    return model.apply({"params": params}, batch["inputs"], padding_mask=pad,
                       return_hidden=True, **packed)


def logits_of(h, head, layout: str):
    """[B, T, V] fp32 logits of the hidden states (the unfused path, --loss-chunk 0)."""
    return project("BTD,DV->BTV", h, head.T if layout == "VD" else head,
                   logits_einsum).astype(jnp.float32)


def sequence_sums(logp, batch):
    """(per-row sums of the trained targets' log-probs [B], per-row counts of them [B])."""
    m = batch["mask"].astype(jnp.float32)
    return jnp.sum(logp * m, axis=-1), jnp.sum(m, axis=-1)


def row_logps(model, params, batch, attention_padding: bool = False, compute_dtype=None,
              loss_chunk: int | None = 0):
    """Each row's sum of its trained targets' log-probs [B] (fp32) under `params`, through the
    fused head: a reference model's per-sequence log-probs (the step's adapters-off pass and
    the precomputed table alike)."""
    chunk = resolve_loss_chunk(loss_chunk, *batch["inputs"].shape, model.config)
    h, head, layout = hidden(model, params, batch, attention_padding, compute_dtype)
    return sequence_sums(token_logps(h, head, layout, batch["targets"], chunk), batch)[0]


def precomputed_reference(batch):
    """The batch's precomputed reference sums [B] (`ref_logps` [B, T] holds each row's in
    column 0: jaxmem.train.reference), or None where it carries none."""
    return jnp.sum(batch["ref_logps"], axis=-1) if "ref_logps" in batch else None


def token_logps(h, head, layout: str, targets, chunk: int):
    """Each target's log-probability [B, T] (fp32): fused in sequence chunks (no [B, T, V]
    logits; jaxmem.loss.chunked.chunked_token_logps) unless chunk is 0."""
    if chunk:
        return chunked_token_logps(h, head, targets, chunk, layout=layout)
    logits = logits_of(h, head, layout)
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None],
                               axis=-1)[..., 0]


@dataclass(frozen=True)
class CausalLM(Objective):
    """Next-token cross-entropy over the trained targets (`mask`), averaged over the step's
    trained tokens: the train step's loss since the start, bitwise."""

    name = "causal-lm"
    head_in_slices = True

    def counts(self, batch) -> dict:
        return {"tokens": jnp.sum(batch["mask"]).astype(jnp.float32)}

    def sums(self, model, params, batch, attention_padding=False, compute_dtype=None,
             loss_chunk=0, ref=None):
        total, _ = token_loss(model, params, batch, attention_padding, compute_dtype, loss_chunk)
        return {"loss": total}

    def head_sums(self, h, head, layout, batch, chunk, ref=None):
        if chunk:
            total, _ = chunked_cross_entropy(h, head, batch["targets"], batch["mask"], chunk,
                                             layout=layout)
        else:
            total, _ = cross_entropy(logits_of(h, head, layout), batch["targets"], batch["mask"])
        return {"loss": total}

    def value(self, sums, counts, xp=jnp):
        return sums["loss"] / xp.maximum(counts["tokens"], 1.0), {}

    def flags(self) -> dict:
        return {"objective.objective": "causal-lm"}
