"""What the `--optimizer-in-backward` step (jaxmem.train.inbackward) decides from shapes alone,
asked by the step and by the planner (jaxmem.memory.activations, jaxmem.memory.counted), so
both follow one rule:

    mlp_tiles(config, tokens)              the MLP in sequence tiles or untiled
    head_slice((D, V), block, tokens)      the vocabulary slice of the head's gradient (0: whole)
    streamed_gradients(step_config, tokens)   the params whose gradient never exists whole
"""

from __future__ import annotations

import jax

from jaxmem.families.decoder import abstract_params
from jaxmem.families.names import EMBEDDING, HEAD
from jaxmem.loss.chunked import AUTO_CHUNK_BYTES, resolve_loss_chunk
import jaxmem.optim._stochastic as sr


def mlp_tiles(c, tokens: int) -> bool:
    """Whether the in-backward step runs the MLP in sequence tiles (jaxmem.model.tiled, where
    that saves memory at all): only at more than 3 D tokens per micro-batch, where its [B, T, F]
    activations outweigh the tiles' fp32 weight-gradient sums (3 x D x F x 4 bytes, which the
    untiled MLP's bf16 gradients, the part's own, do not need). The planner asks this too."""
    return tokens > 3 * c.hidden_size


def head_slice(shape, block: int | None, tokens: int) -> int:
    """The vocabulary slice an untied head of `shape` [D, V] has its gradient made and applied
    in under --optimizer-in-backward (`_head_in_slices`; `block`: its optimizer state's
    `Parts.column_block`, None where it cannot be updated in columns), or 0: made whole. The
    largest divisor of V that is a multiple of `block` with one slice's update at most
    sr.CHUNK elements and its fp32 logits [B, T, Vc] (`tokens` = B x T) at most the fused
    loss's AUTO_CHUNK_BYTES; 0 where that leaves over 2,048 slices."""
    D, V = shape
    if not block:
        return 0
    fits = [w for w in range(block, V + 1, block) if V % w == 0 and D * w <= sr.CHUNK
            and tokens * w * 4 <= AUTO_CHUNK_BYTES]
    return max(fits) if fits and V // max(fits) <= 2048 else 0


def streamed_gradients(cfg, tokens: int) -> set[str]:
    """The top-level params (names) whose gradient this in-backward step (`cfg`, a StepConfig;
    `tokens` = B x T) never holds whole: an untied embedding's (made a row piece at a time
    where its update uses it) and an untied head's made in vocabulary slices (`head_slice`).
    What the planner's one-part gradient leaves out."""
    c = cfg.model
    if c.tie_embeddings:
        return set()
    out = {EMBEDDING}
    if resolve_loss_chunk(cfg.loss_chunk, 1, tokens, c):
        got = []

        def probe(params):  # abstract: the optimizer's parts of the head, nothing allocated
            opt = cfg.optimizer
            parts = opt.split(params, opt.tx.init(params), jax.random.PRNGKey(0))
            names = [k[0].key for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
            got.append(parts.column_block(names.index(HEAD)))
        jax.eval_shape(probe, abstract_params(c))
        if head_slice((c.hidden_size, c.vocab_size), got[0], tokens):
            out.add(HEAD)
    return out
