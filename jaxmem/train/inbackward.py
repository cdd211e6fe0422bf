"""`--optimizer-in-backward`: the train step with each layer's update applied inside the
backward pass, so the gradient tree never exists whole (one device).

    train_step(state, batch) -> (state, metrics)      same state, batch and metrics as
                                                      jaxmem.train.step.make_train_step's

    x_0 = embed(tokens)
    for l in 0..L-1:  x_{l+1} = block(params_l, x_l)     keep x_l only (what --remat full keeps)
    loss, (d_norm, d_head), dx = vjp(final norm + fused LM-head loss)(x_L)
    update norm and head now                              (their gradients die here)
    for l in L-1..0:                                      one loop whose carry holds the stacked
        d_params_l, dx = vjp(block)(params_l, x_l)(dx)    params and optimizer state: layer l
        update layer l in place                           is recomputed, differentiated and
                                                          updated, written back with
                                                          dynamic_update_slice (XLA keeps the
                                                          donated buffers: no second copy)
    d_embed = vjp(embed)(dx); update the embedding

The gradients alive at once are one layer's plus the head's or the embedding's, instead of the
whole tree (llama-3-8b bf16: 14.96 GiB; docs/memory.md has the compiled figures). The update of
each part is the ordinary step's to the bit (jaxmem.train.layerwise); the gradients are those of
the same forward, differentiated layer by layer instead of by one jax.grad (fp32 losses equal
the ordinary step's to 1e-6 over 10 steps: tests/test_inbackward.py).

What it cannot do, refused by `check` (one line naming the flags):
- clipping by the global gradient norm (--clip > 0): the norm is known only after every
  layer has been updated;
- grad accumulation: each micro-batch would update the weights;
- a loss scale (fp16's dynamic or static scaling): skipping a step on an overflow needs every
  gradient before any update. Without one, a part whose gradients are not finite is left as it
  was (weights and moments) and the others are updated; the step then counts as non-finite
  (`skipped`, skips_in_a_row, --max-consecutive-skips) though the rest of it was applied;
- LoRA / QLoRA, a device mesh, and remat policies other than `full` (each layer is recomputed in
  the backward, which is what `full` means).

grad_norm is reported from the per-part sums of squares (the same norm, summed in another order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem.config.model import ConfigError
from jaxmem.loss.chunked import chunked_cross_entropy, resolve_loss_chunk
from jaxmem.model.layers import RMSNorm, attention_mask, rope_tables
from jaxmem.model.llama import DecoderBlock
from jaxmem.model.precision import cast_params
from jaxmem.model.projection import logits_einsum, project
from jaxmem.optim import NoOpLossScale, all_finite, row_chunks
from jaxmem.train.layerwise import LayerwiseUpdate
from jaxmem.train.loss import cross_entropy
from jaxmem.train.optim import OptimizerName, schedule


def check(cfg, loss_scale=None) -> None:
    """Raise ConfigError (one line, naming the flags) where `cfg` (a StepConfig) cannot run with
    --optimizer-in-backward; `loss_scale` the run's initial one."""
    flag = "--optimizer-in-backward"
    if cfg.optim.clip > 0:
        raise ConfigError(f"{flag} cannot clip by the global gradient norm (--clip "
                          f"{cfg.optim.clip:g}): each layer is updated before the next one's "
                          f"gradients exist; pass --clip 0")
    if cfg.grad_accum != 1:
        raise ConfigError(f"{flag} cannot accumulate gradients (--grad-accum {cfg.grad_accum}): "
                          f"every micro-batch would update the weights; use --grad-accum 1")
    if loss_scale is not None and not isinstance(loss_scale, NoOpLossScale):
        raise ConfigError(f"{flag} cannot scale the loss (--precision {cfg.precision.name} / "
                          f"--loss-scale): skipping an overflowing step needs every gradient "
                          f"before any update; use --loss-scale none or bf16 / bf16-sr")
    if cfg.peft is not None:
        raise ConfigError(f"{flag} is for full fine-tunes; drop --lora-rank (LoRA's adapter "
                          f"gradients are small already)")
    if cfg.remat.kind != "full":
        raise ConfigError(f"{flag} recomputes each layer in the backward pass (what --remat full "
                          f"does); pass --remat full, not --remat {cfg.remat}")
    if OptimizerName(cfg.optim.optimizer) == OptimizerName.ADAFACTOR:
        raise ConfigError(f"{flag} supports adamw, adamw8bit and lion, not adafactor (its "
                          f"factored moments do not split by layer)")


def make_train_step_in_backward(cfg, step_key, loss_scale=None):
    """The pure train step of `cfg` (a StepConfig) with the optimizer applied inside the
    backward pass (module docstring); `step_key(rng, step)` the stochastic-rounding key of a
    step (jaxmem.train.step's). jaxmem.train.step.make_train_step returns it for a StepConfig
    with `optimizer_in_backward`, and `jit_train_step` jits it with the state donated."""
    check(cfg, loss_scale)
    c = cfg.model
    model = cfg.build_model()
    dtype = cfg.precision.compute_dtype
    lr_at = schedule(cfg.optim)
    block = DecoderBlock(c, model.einsum, tile_mlp=True)  # as under --remat full
    norm = RMSNorm(c.rms_norm_eps)

    def train_step(state, batch, frozen=None):
        del frozen
        if not isinstance(state.loss_scale, NoOpLossScale):
            check(cfg, state.loss_scale)
        mb = jax.tree_util.tree_map(lambda x: x[0], batch)
        tokens, targets, weights = mb["inputs"], mb["targets"], mb["mask"]
        B, T = tokens.shape
        total_tokens = jnp.maximum(jnp.sum(batch["mask"]).astype(jnp.float32), 1.0)
        segment_ids = mb.get("segment_ids")
        positions = mb.get("positions")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        cos, sin = rope_tables(positions, c.resolved_head_dim, c.rope_theta, c.llama3_rope)
        pad = weights if cfg.attention_padding else None
        mask = None if segment_ids is not None else attention_mask(pad, T)
        chunk = resolve_loss_chunk(cfg.loss_chunk, B, T, c)
        cast = (lambda p: cast_params(p, dtype)) if dtype is not None else (lambda p: p)

        def layer(lp, x):
            return block.apply({"params": cast(lp)}, x, cos, sin, mask, segment_ids)[0]

        def head_loss(hp, x):  # final norm, LM head and the loss: Llama's return_hidden path
            hp = cast(hp)
            h = norm.apply({"params": hp["norm"]}, x)  # [B, T, D]
            w, layout = ((hp["embed_tokens"], "VD") if c.tie_embeddings
                         else (hp["lm_head"], "DV"))
            if chunk:
                total, _ = chunked_cross_entropy(h, w, targets, weights, chunk, layout=layout)
            else:
                logits = project("BTD,DV->BTV", h, w.T if layout == "VD" else w,
                                 logits_einsum)  # [B, T, V]
                total, _ = cross_entropy(logits, targets, weights)
            return total / total_tokens

        params = state.params
        upd = LayerwiseUpdate(cfg.optim, cfg.precision.stochastic_rounding, params,
                              state.opt_state, step_key(state.rng, state.step))
        leaves = jax.tree_util.tree_leaves(params)
        states = upd.leaf_states()
        index = {tuple(k.key for k in path): i for i, path in enumerate(upd.paths)}
        new_leaves, new_states = list(leaves), list(states)
        sumsq, finite_all = jnp.zeros((), jnp.float32), jnp.asarray(True)

        def update_leaf(name, g, stats=None):
            nonlocal sumsq, finite_all
            i = index[(name,) if (name,) in index else (name, "scale")]
            ss, finite = stats or (jnp.sum(jnp.square(g.astype(jnp.float32))), all_finite(g))
            sumsq, finite_all = sumsq + ss, finite_all & finite
            new_leaves[i], new_states[i] = upd.leaf(i, g, leaves[i], states[i], finite)

        # forward: the embedding, then the layers keeping each one's input
        x0 = jnp.take(cast({"embed_tokens": params["embed_tokens"]})["embed_tokens"], tokens,
                      axis=0)  # [B, T, D]
        xL, xs = jax.lax.scan(lambda x, lp: (layer(lp, x), x), x0, params["layers"])
        head = {"norm": params["norm"]}
        head["embed_tokens" if c.tie_embeddings else "lm_head"] = (
            params["embed_tokens"] if c.tie_embeddings else params["lm_head"])
        loss, head_vjp = jax.vjp(head_loss, head, xL)
        d_head, dx = head_vjp(jnp.ones_like(loss))
        update_leaf("norm", d_head["norm"]["scale"])
        if not c.tie_embeddings:
            update_leaf("lm_head", d_head["lm_head"])

        # backward through the layers, each updated as its gradients appear
        stacked = upd.stacked
        treedef_l = jax.tree_util.tree_structure(params["layers"])
        carry0 = (dx, {i: leaves[i] for i in stacked}, {i: states[i] for i in stacked},
                  jnp.zeros((), jnp.float32), jnp.asarray(True))

        def back(k, carry):
            dx, ps, sts, ss, fin = carry
            l = c.num_layers - 1 - k
            lp = treedef_l.unflatten([jax.lax.dynamic_index_in_dim(ps[i], l, 0, keepdims=False)
                                      for i in stacked])
            x = jax.lax.dynamic_index_in_dim(xs, l, 0, keepdims=False)
            _, vjp = jax.vjp(layer, lp, x)
            d_lp, dx = vjp(dx)
            grads = dict(zip(stacked, jax.tree_util.tree_leaves(d_lp)))
            finite = all_finite(grads)
            ss = ss + sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grads.values())
            ps, sts = upd.layer(l, grads, ps, sts, finite)
            return dx, ps, sts, ss, fin & finite

        dx, ps, sts, ss, fin = jax.lax.fori_loop(0, c.num_layers, back, carry0)
        for i in stacked:
            new_leaves[i], new_states[i] = ps[i], sts[i]
        sumsq, finite_all = sumsq + ss, finite_all & fin

        # the embedding's gradient, a row piece at a time where the update uses it: the
        # whole one ([V, D], 1 GiB at 8B in bf16) never exists
        embed = params["embed_tokens"]
        V, D = embed.shape
        rows, dx_rows = tokens.reshape(-1), dx.reshape(-1, D)

        def d_embed(n, j):  # rows [j V / n, (j + 1) V / n) of d(embed): take's transpose
            P = V // n
            at = rows - j * P
            at = jnp.where((at >= 0) & (at < P), at, P)  # other pieces' tokens: dropped
            g = jnp.zeros((P, D), dx.dtype).at[at].add(dx_rows, mode="drop").astype(embed.dtype)
            if c.tie_embeddings:  # the head's share
                g = g + jax.lax.dynamic_slice_in_dim(d_head["embed_tokens"], j * P, P, 0)
            return g

        n = row_chunks(embed.shape)

        def embed_stats(j, acc):
            g = d_embed(n, j)
            return acc[0] + jnp.sum(jnp.square(g.astype(jnp.float32))), acc[1] & all_finite(g)

        update_leaf("embed_tokens", d_embed, jax.lax.fori_loop(
            0, n, embed_stats, (jnp.zeros((), jnp.float32), jnp.asarray(True))))

        new_params = upd.treedef.unflatten(new_leaves)
        skips = jnp.where(finite_all, 0, state.skips_in_a_row + 1).astype(jnp.int32)
        new_state = state.replace(
            step=state.step + 1, applied=state.applied + 1, skips_in_a_row=skips,
            data_position=state.data_position + cfg.grad_accum, params=new_params,
            opt_state=upd.finish(new_states))
        metrics = {"loss": loss, "grad_norm": jnp.sqrt(sumsq),
                   "loss_scale": state.loss_scale.loss_scale, "skipped": skips > 0,
                   "lr": lr_at(state.applied), "tokens": total_tokens, "skips_in_a_row": skips}
        return new_state, metrics

    return train_step
