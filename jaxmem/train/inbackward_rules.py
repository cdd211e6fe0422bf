"""What the `--optimizer-in-backward` step (jaxmem.train.inbackward) decides from shapes alone,
asked by the step and by the planner (jaxmem.memory.activations, jaxmem.memory.counted), so
both follow one rule:

    mlp_tiles(config, tokens, remat)       the MLP in sequence tiles or untiled
    mlp_slabs(step_config, tokens, on_host)   the width of the MLP's slabs of F (0: whole)
    head_slice((D, V), block, tokens)      the vocabulary slice of the head's gradient (0: whole)
    streamed_gradients(step_config, tokens)   the params whose gradient never exists whole
"""

from __future__ import annotations

import functools

import jax

from jaxmem.families.params import abstract_params
from jaxmem.families.names import EMBEDDING, HEAD, LAYERS
from jaxmem.loss.chunked import AUTO_CHUNK_BYTES, resolve_loss_chunk
from jaxmem.model.tiled import tiles_under, tiling_pays
from jaxmem.optim import rounding_chunk


def mlp_tiles(c, tokens: int, remat) -> bool:
    """Whether the in-backward step runs the MLP in sequence tiles (jaxmem.model.tiled, where
    that saves memory at all): only at more than 3 D tokens per micro-batch, where its [B, T, F]
    activations outweigh the tiles' fp32 weight-gradient sums (3 x D x F x 4 bytes, which the
    untiled MLP's bf16 gradients, the part's own, do not need), and not under a `+untiled`
    `remat` policy (RematPolicy.mlp_tiles). The planner asks this too."""
    return tiles_under(remat) and tiling_pays(tokens, c.hidden_size)


SLAB = 2**22  # elements of one MLP weight's slab at most (its update's temporaries: ~25 B each)


def mlp_slab_width(c, block: int | None) -> int:
    """The width w of the slabs of F the in-backward step runs a layer's MLP in
    (`inbackward_slabs`: each slab recomputed, differentiated and its weights' slabs updated at
    once, so neither the layer's MLP weights copied whole nor their gradients exist), or 0: the
    MLP whole. The largest divisor of F that is a multiple of `block` (the weights' states'
    `slab_block`, None: they cannot be cut) with D x w at most SLAB elements, where that makes
    2 or more slabs; 0 where the block norms the MLP's output (Gemma 3's sandwich, OLMo 2's
    post-norms: the norm needs the whole output, not a slab's share)."""
    D, F = c.hidden_size, c.intermediate_size
    if not block or c.norms.after_mlp is not None or D * F <= SLAB:
        return 0
    fits = [w for w in range(block, F, block) if F % w == 0 and D * w <= SLAB]
    return max(fits) if fits else 0


def mlp_slabs(cfg, tokens: int, params_on_host: bool = False) -> int:
    """The slab width the in-backward step (`cfg`, a StepConfig; `tokens` = B x T) runs each
    layer's MLP in (jaxmem.train.inbackward_slabs), 0: whole. Only with the weights on the
    device (`params_on_host`: --offload-params host streams whole layers), untiled
    (`mlp_tiles`), not fp8's einsum, and each MLP weight's optimizer state cut along F
    (`Parts.slab_block`); then `mlp_slab_width`."""
    c = cfg.model
    if params_on_host or cfg.precision.fp8 or mlp_tiles(c, tokens, cfg.remat):
        return 0
    try:
        block = _mlp_block(cfg)
    except TypeError:  # a StepConfig that does not hash: probed each time
        block = _mlp_block.__wrapped__(cfg)
    return mlp_slab_width(c, block) if block else 0


@functools.lru_cache(maxsize=64)
def _mlp_block(cfg) -> int | None:
    """The multiple of F every MLP weight's optimizer state can be cut at (`Parts.slab_block`),
    None where one cannot or the layer has no MLP weight (an abstract probe, asked once per
    StepConfig: the planner asks per phase and per candidate of a search)."""
    from jaxmem.train.inbackward_slabs import mlp_weights
    c = cfg.model
    weights = mlp_weights(c, abstract_params(c)[LAYERS])
    if not weights:
        return None
    blocks = []

    def probe(params):  # abstract: the optimizer's parts, nothing allocated
        opt = cfg.optimizer
        parts = opt.split(params, opt.tx.init(params), jax.random.PRNGKey(0))
        names = [k[0].key for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        first = names.index(LAYERS)
        blocks.extend(parts.slab_block(first + k, ax) for k, (_, ax) in weights.items())
    jax.eval_shape(probe, abstract_params(c))
    if any(b is None for b in blocks) or any(max(blocks) % b for b in blocks):
        return None
    return max(blocks)


def head_slice(shape, block: int | None, tokens: int) -> int:
    """The vocabulary slice an untied head of `shape` [D, V] has its gradient made and applied
    in under --optimizer-in-backward (`_head_in_slices`; `block`: its optimizer state's
    `Parts.column_block`, None where it cannot be updated in columns), or 0: made whole. The
    largest divisor of V that is a multiple of `block` with one slice's update at most
    `rounding_chunk()` elements and its fp32 logits [B, T, Vc] (`tokens` = B x T) at most the
    fused loss's AUTO_CHUNK_BYTES; 0 where that leaves over 2,048 slices."""
    D, V = shape
    if not block:
        return 0
    chunk = rounding_chunk()
    fits = [w for w in range(block, V + 1, block) if V % w == 0 and D * w <= chunk
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
