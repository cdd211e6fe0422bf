"""`--optimizer-in-backward`: the train step with each layer's update applied inside the
backward pass, so the gradient tree never exists whole (one device).

    train_step(state, batch) -> (state, metrics)      same state, batch and metrics as
                                                      jaxmem.train.step.make_train_step's

    x_0 = embed(tokens)
    for l in 0..L-1:  x_{l+1} = block(params_l, x_l)     keep x_l only (what --remat full keeps)
    loss, lse = fused LM-head loss(final norm(x_L))
    for each vocabulary slice v of the head:              an untied head: each slice's gradient
        d_head_v, dh += backward of the loss over v       applied to its columns at once (a
        update the head's columns v in place              tied one, or a state that cannot be
    dx = vjp(final norm)(dh); update the norm             cut so: its whole gradient, then the
                                                          update)
    for l in L-1..0:                                      one loop whose carry holds the stacked
        d_params_l, dx = vjp(block)(params_l, x_l)(dx)    params and optimizer state: layer l
        update layer l in place                           is recomputed, differentiated and
                                                          updated, written back with
                                                          dynamic_update_slice (XLA keeps the
                                                          donated buffers: no second copy)
    d_embed = vjp(embed)(dx); update the embedding

Where `inbackward_rules.mlp_slabs` says (the 8B: 14 slabs of 1,024), a layer's MLP goes in
slabs of F inside that loop, each slab's weight gradients applied at once
(jaxmem.train.inbackward_slabs): neither the layer's MLP weights copied out of their stacks
whole nor its MLP gradients exist. The untied LM head's gradient is made a vocabulary slice at
a time and each slice is applied at once (`_head_in_slices`: its whole [D, V] gradient never
exists). With --offload-optimizer host
alone (jaxmem.train.placement) the optimizer state lives in pinned host memory and each
layer's update brings it a sub-piece at a time (jaxmem.optim's layer_rows: no layer of state
beside the backward; the fetches are exposed). With --offload-params host the stacked params
live there too: the forward scan copies params_l to the device
(jaxmem.model.fetch.layer_to_device); the reverse loop is double-buffered: its carry also holds
layer l's host-resident slices on the device (weights for the recompute and the update, the
state's rows: Parts.fetch), fetched during iteration l + 1, and iteration l starts fetching
layer l - 1's (each leaf's once layer l's gradient of it exists; an optimization_barrier orders
those reads before layer l's writes into the same host stacks, without which XLA copies each
whole stack), then writes layer l's updated slices back (jaxmem.optim.split's parts: one more
layer of slices on the device). With everything on the device the program is unchanged.

The gradients alive at once are one layer's plus the head's or the embedding's, instead of the
whole tree (llama-3-8b bf16: 14.96 GiB; docs/memory.md has the compiled figures). The update of
each part is the ordinary step's (RunOptimizer.split: adamw8bit's bitwise, adamw's and lion's
within one bf16 ulp, as XLA fuses optax's arithmetic); the gradients are those of
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
- LoRA / QLoRA, a device mesh, and remat policies other than `full` and `offload:block_input`
  (each layer is recomputed in the backward from its input; `offload:block_input` keeps those
  inputs, x_l, in pinned host memory and copies each back for its layer's backward: L x B x T
  x D of the compute dtype off the device, 8 GiB for the 8B at 1 x 32k).

grad_norm is reported from the per-part sums of squares (the same norm, summed in another order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem.errors import ConfigError
from jaxmem.loss.chunked import forward, over_vocab, resolve_loss_chunk
from jaxmem.families.decoder import DecoderBlock, embed_lookup, final_norm, head_of, layer_context, layer_facts
from jaxmem.families.params import abstract_params
from jaxmem.families.names import EMBEDDING, FINAL_NORM, HEAD, LAYERS
from jaxmem.model.fetch import in_host_memory, layer_to_device, to_device
from jaxmem.model.precision import cast_params
from jaxmem.model.tiled import tiles_under
from jaxmem.objective.base import precomputed_reference
from jaxmem.einsum import logits_einsum
from jaxmem.optim import NoOpLossScale, NotSplittable, Parts, all_finite, row_chunks
from jaxmem.optim import cols
from jaxmem.train.inbackward_rules import head_slice, mlp_slabs
from jaxmem.train.inbackward_slabs import layer_in_slabs, plan as slab_plan
from jaxmem.train.optim import schedule


OFFLOAD_INPUTS = "offload:block_input"  # the one remat policy besides full: x_l on the host


def _offloads_inputs(remat) -> bool:
    """Whether `remat` is OFFLOAD_INPUTS (with or without `+untiled`)."""
    return remat.kind == "offload" and remat.names == ("block_input",)


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
    cfg.trainable.check_in_backward(flag)
    if cfg.remat.kind != "full" and not _offloads_inputs(cfg.remat):
        raise ConfigError(f"{flag} recomputes each layer in the backward pass from its input "
                          f"(what --remat full does); pass --remat full, or --remat "
                          f"{OFFLOAD_INPUTS} to keep the inputs in host memory, not --remat "
                          f"{cfg.remat}")
    opt = cfg.optimizer
    try:  # the optimizer's own refusal, by its state's type (abstract: nothing allocated)
        jax.eval_shape(lambda p: opt.split(p, opt.tx.init(p), jax.random.PRNGKey(0)).states,
                       abstract_params(cfg.model))
    except NotSplittable as e:
        raise ConfigError(f"{flag} updates each layer on its own, which --optimizer "
                          f"{cfg.optim.optimizer} cannot: {e}") from None


def make_train_step_in_backward(cfg, step_key, loss_scale=None):
    """The pure train step of `cfg` (a StepConfig) with the optimizer applied inside the
    backward pass (module docstring); `step_key(rng, step)` the stochastic-rounding key of a
    step (jaxmem.train.step's). jaxmem.train.step.make_train_step returns it for a StepConfig
    with `optimizer_in_backward`, and `jit_train_step` jits it with the state donated."""
    check(cfg, loss_scale)
    return _InBackwardStep(cfg, step_key)


class _Updates:
    """The step's new leaves and optimizer states, filled part by part as gradients appear, with
    the running sum of squared gradients and whether every part's gradients were finite."""

    def __init__(self, parts: Parts, params):
        self.parts = parts
        paths_leaves, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        self.leaves = [x for _, x in paths_leaves]
        self.states = parts.states
        self.index = {tuple(k.key for k in path): i for i, (path, _) in enumerate(paths_leaves)}
        self.stacked = [i for i, (path, _) in enumerate(paths_leaves) if path[0].key == LAYERS]
        self.new_leaves, self.new_states = list(self.leaves), list(self.states)
        self.sumsq, self.finite = jnp.zeros((), jnp.float32), jnp.asarray(True)

    def leaf(self, name: str, g, stats=None) -> None:
        """Update the top-level leaf `name` with gradient `g` (or `g(n, j)`, its j-th of n row
        pieces); `stats` its (sum of squares, finite) where `g` is pieces."""
        i = self.index[(name,) if (name,) in self.index else (name, "scale")]
        ss, finite = stats or (jnp.sum(jnp.square(g.astype(jnp.float32))), all_finite(g))
        self.add(ss, finite)
        self.new_leaves[i], self.new_states[i] = self.parts.leaf(i, g, self.leaves[i],
                                                                 self.states[i], finite)

    def layer(self, l, grads: dict, ps: dict, sts: dict, finite, fetched: dict | None = None):
        """Layer `l` of each stacked leaf i in grads {i: layer l's gradient} (every one, or a
        part's), ps and sts {i: the whole stacked leaf / state}, fetched {i: Parts.fetch's list}
        or None -> (ps, sts) with layer l of those leaves updated in place."""
        new = {i: self.parts.layer(i, l, grads[i], ps[i], sts[i], finite,
                                   *([fetched[i]] if fetched else [])) for i in grads}
        return ({**ps, **{i: p for i, (p, _) in new.items()}},
                {**sts, **{i: s for i, (_, s) in new.items()}})

    @staticmethod
    def stats(grads: dict):
        """(the sum of squares in fp32, all finite) of a part's gradients {i: array}."""
        return (sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grads.values()),
                all_finite(grads))

    def add(self, sumsq, finite) -> None:
        self.sumsq, self.finite = self.sumsq + sumsq, self.finite & finite


class _InBackwardStep:
    """train_step(state, batch, frozen=None) -> (state, metrics), the module docstring's
    algorithm: forward keeping each layer's input, the head's update, the layers' updates in a
    reverse loop, the embedding's update a row piece at a time."""

    def __init__(self, cfg, step_key):
        self.cfg, self.step_key, self.c = cfg, step_key, cfg.model
        model = cfg.build_model()
        self.dtype = cfg.precision.compute_dtype
        self.lr_at = schedule(cfg.optim)
        # the model's own parts (jaxmem.families.decoder): no second copy of the forward pass;
        # the MLP in sequence tiles (as under --remat full) where its activations outweigh the
        # tiles' fp32 weight-gradient sums (3 x D x F x 4 bytes, 672 MiB at 8B): B x T > 3 D
        # tokens, which the MLP itself decides by the batch's shape (jaxmem.model.tiled)
        self.einsum = model.einsum
        self.block = DecoderBlock(self.c, model.einsum, tile_mlp=tiles_under(cfg.remat))
        self.norm = final_norm(self.c)
        self.facts = layer_facts(self.c)  # each layer's kind where local and global mix

    def cast(self, p):
        return cast_params(p, self.dtype) if self.dtype is not None else p

    def _inputs(self, batch) -> dict:
        """One micro-batch's tokens, targets, weights, the layers' shared inputs (the model's
        `layer_context`) and the loss chunk."""
        c, cfg = self.c, self.cfg
        mb = jax.tree_util.tree_map(lambda x: x[0], batch)
        tokens, weights = mb["inputs"], mb["mask"]
        B, T = tokens.shape
        pad = weights if cfg.attention_padding else None
        return {"tokens": tokens, "targets": mb["targets"], "weights": weights,
                "total": jnp.maximum(jnp.sum(batch["mask"]).astype(jnp.float32), 1.0),
                "ctx": layer_context(c, (B, T), mb.get("positions"), pad, mb.get("segment_ids")),
                "chunk": resolve_loss_chunk(cfg.loss_chunk, B, T, c), "mb": mb,
                "counts": cfg.objective.counts(batch)}

    def _layer(self, lp, x, a, fact=None):
        """Layer `lp` on x; fact: its scanned kind (`layer_facts`) or None."""
        return self.block.apply({"params": self.cast(lp)}, x, a["ctx"], fact)[0]

    def _head_loss(self, hp, x, a):
        """Final norm, LM head and the objective: the Decoder's return_hidden path; (loss, the
        objective's metrics)."""
        hp = self.cast(hp)
        h = self.norm.apply({"params": hp[FINAL_NORM]}, x)  # [B, T, D]
        w, layout = head_of(self.c, hp)
        mb, objective = a["mb"], self.cfg.objective
        return objective.value(objective.head_sums(h, w, layout, mb, a["chunk"],
                                                   precomputed_reference(mb)), a["counts"])

    def __call__(self, state, batch, frozen=None):
        del frozen
        cfg, c = self.cfg, self.c
        if not isinstance(state.loss_scale, NoOpLossScale):
            check(cfg, state.loss_scale)
        a = self._inputs(batch)
        params = state.params
        u = _Updates(cfg.optimizer.split(params, state.opt_state,
                                         self.step_key(state.rng, state.step)), params)
        # forward: the embedding, then the layers keeping each one's input
        x0 = embed_lookup(c, self.cast({EMBEDDING: params[EMBEDDING]})[EMBEDDING],
                          a["tokens"])  # [B, T, D]
        # --offload-params host: each layer's host-resident leaves copied in as the scan reaches it
        # --remat offload:block_input: each layer's input kept in pinned host memory
        keep = (lambda x: jax.device_put(x, jax.memory.Space.Host)) if \
            _offloads_inputs(self.cfg.remat) else (lambda x: x)
        xL, xs = jax.lax.scan(
            lambda x, lf: (self._layer(layer_to_device(lf[0]), x, a, lf[1]), keep(x)),
            x0, (params[LAYERS], self.facts))
        d_head, vc, objective_metrics = {}, self._head_slice(u, params, a), {}
        if vc:  # the head's gradient a vocabulary slice at a time, each updated at once
            loss, dx = self._head_in_slices(u, params, xL, a, vc)
        else:
            head = {FINAL_NORM: params[FINAL_NORM]}
            head_name = EMBEDDING if c.tie_embeddings else HEAD
            head[head_name] = params[head_name]
            loss, head_vjp, objective_metrics = jax.vjp(
                lambda hp, x: self._head_loss(hp, x, a), head, xL, has_aux=True)
            d_head, dx = head_vjp(jnp.ones_like(loss))
            u.leaf(FINAL_NORM, d_head[FINAL_NORM]["scale"])
            if not c.tie_embeddings:
                u.leaf(HEAD, d_head[HEAD])
        dx = self._layers_backward(u, params, xs, dx, a)
        self._embedding(u, params[EMBEDDING], a["tokens"], dx, d_head)
        skips = jnp.where(u.finite, 0, state.skips_in_a_row + 1).astype(jnp.int32)
        new_state = state.replace(
            step=state.step + 1, applied=state.applied + 1, skips_in_a_row=skips,
            data_position=state.data_position + cfg.grad_accum,
            params=u.treedef.unflatten(u.new_leaves), opt_state=u.parts.finish(u.new_states))
        metrics = {"loss": loss, "grad_norm": jnp.sqrt(u.sumsq),
                   "loss_scale": state.loss_scale.loss_scale, "skipped": skips > 0,
                   "lr": self.lr_at(state.applied), "tokens": a["total"], "skips_in_a_row": skips,
                   **objective_metrics}
        return new_state, metrics

    def _head_slice(self, u: _Updates, params, a) -> int:
        """`head_slice` of this step's head (0 where it is tied, the loss unfused, or the
        objective's head gradient cannot be taken a vocabulary slice at a time)."""
        if self.c.tie_embeddings or not a["chunk"] or not self.cfg.objective.head_in_slices:
            return 0
        return head_slice(params[HEAD].shape, u.parts.column_block(u.index[(HEAD,)]),
                          a["tokens"].size)

    def _head_in_slices(self, u: _Updates, params, xL, a, vc: int):
        """(loss, d x_L): the final norm and the fused loss forward (its logsumexp kept), then
        its backward over vocabulary slices of the head (jaxmem.loss.chunked.over_vocab), each
        slice's gradient applied to the head's columns and their optimizer state at once
        (Parts.columns): the head's whole gradient ([D, V], 0.98 GiB at 8B in bf16) never
        exists. Then the final norm's update. A slice whose gradient is not finite is left as
        it was (each slice is a part)."""
        i, dtype = u.index[(HEAD,)], params[HEAD].dtype
        cast = lambda name, x: self.cast({name: x})[name]  # noqa: E731
        h, norm_vjp = jax.vjp(lambda s, x: self.norm.apply({"params": cast(FINAL_NORM, s)}, x),
                              params[FINAL_NORM], xL)
        w32 = a["weights"].astype(jnp.float32)
        total, lse = forward(a["chunk"], logits_einsum, "DV", h, cast(HEAD, params[HEAD]),
                             a["targets"], w32)

        def read(carry, start):  # columns not yet written hold the weights as they were
            return cast(HEAD, cols(carry[0], start, vc))

        def write(carry, start, g):
            p, s, ss, fin = carry
            g = g.astype(dtype)
            finite = all_finite(g)
            p, s = u.parts.columns(i, start, g, p, s, finite)
            return p, s, ss + jnp.sum(jnp.square(g.astype(jnp.float32))), fin & finite

        carry = (params[HEAD], u.states[i], jnp.zeros((), jnp.float32), jnp.asarray(True))
        dh, (p, s, ss, fin) = over_vocab(logits_einsum, "DV", h, a["targets"], w32, lse,
                                         1.0 / a["total"], vc, params[HEAD].shape[1], read,
                                         write, carry)
        u.new_leaves[i], u.new_states[i] = p, s
        u.add(ss, fin)
        d_norm, dx = norm_vjp(dh)
        u.leaf(FINAL_NORM, d_norm["scale"])
        return total / a["total"], dx

    def _layers_backward(self, u: _Updates, params, xs, dx, a):
        """Backward through the layers, last first, each updated as its gradients appear (one
        loop whose carry holds the stacked params and optimizer states; where any of them lives
        in host memory, also layer l's slices of those on the device, fetched during iteration
        l + 1: the module docstring); returns d x_0."""
        stacked, L = u.stacked, self.c.num_layers
        treedef_l = jax.tree_util.tree_structure(params[LAYERS])
        ps0, sts0 = {i: u.leaves[i] for i in stacked}, {i: u.states[i] for i in stacked}
        ahead = any(map(in_host_memory, jax.tree_util.tree_leaves(ps0)))
        # the MLP in slabs of F where the rule says (jaxmem.train.inbackward_slabs)
        slabs = slab_plan(self.c, params[LAYERS], stacked,
                          mlp_slabs(self.cfg, a["tokens"].size, ahead))

        def fetch(at, ps, sts):  # {i: layer at[i]'s host-resident slices of leaf i, on the device}
            return {i: u.parts.fetch(at[i], ps[i], sts[i]) for i in stacked}

        carry0 = (dx, ps0, sts0, jnp.zeros((), jnp.float32), jnp.asarray(True)) + (
            (fetch({i: L - 1 for i in stacked}, ps0, sts0),) if ahead else ())

        def back(k, carry):
            (dx, ps, sts, ss, fin), cur = carry[:5], (carry[5] if ahead else None)
            l = L - 1 - k
            x = to_device(jax.lax.dynamic_index_in_dim(xs, l, 0, keepdims=False),
                          in_host_memory(xs))
            fact = jax.tree_util.tree_map(lambda f: f[l], self.facts)
            if slabs is not None:
                dx, ps, sts, ss_l, fin_l = layer_in_slabs(self, u, slabs, l, ps, sts, x, dx, a,
                                                          fact)
                return dx, ps, sts, ss + ss_l, fin & fin_l
            lp = layer_to_device(treedef_l.unflatten([
                jax.lax.dynamic_index_in_dim(ps[i], l, 0, keepdims=False)
                if cur is None or cur[i][0] is None else cur[i][0][0] for i in stacked]))
            _, vjp = jax.vjp(lambda lp, x: self._layer(lp, x, a, fact), lp, x)
            d_lp, dx = vjp(dx)
            grads = dict(zip(stacked, jax.tree_util.tree_leaves(d_lp)))
            ss_l, finite = u.stats(grads)
            ss = ss + ss_l
            nxt = ()
            if ahead:  # layer l - 1's slices of leaf i start coming in once layer l's gradient
                # of leaf i exists (the last trip fetches layer 0 again); the barrier orders all
                # those reads before this layer's writes into the same host stacks (without it
                # XLA copies each whole host stack)
                at = {i: jax.lax.optimization_barrier((jnp.maximum(l - 1, 0), grads[i]))[0]
                      for i in stacked}
                nxt, ps, sts = jax.lax.optimization_barrier((fetch(at, ps, sts), ps, sts))
                nxt = (nxt,)
            ps, sts = u.layer(l, grads, ps, sts, finite, cur)
            return (dx, ps, sts, ss, fin & finite) + nxt

        dx, ps, sts, ss, fin = jax.lax.fori_loop(0, L, back, carry0)[:5]
        for i in stacked:
            u.new_leaves[i], u.new_states[i] = ps[i], sts[i]
        u.add(ss, fin)
        return dx

    def _embedding(self, u: _Updates, embed, tokens, dx, d_head) -> None:
        """The embedding's update, its gradient made a row piece at a time where the update
        uses it: the whole one ([V, D], 1 GiB at 8B in bf16) never exists."""
        V, D = embed.shape
        if self.c.embed_scale:  # the transpose of embed_lookup's scale (in the compute dtype)
            dx = dx * jnp.asarray(D ** 0.5, dx.dtype)
        rows, dx_rows = tokens.reshape(-1), dx.reshape(-1, D)
        tied = self.c.tie_embeddings

        def d_embed(n, j):  # rows [j V / n, (j + 1) V / n) of d(embed): take's transpose
            P = V // n
            at = rows - j * P
            at = jnp.where((at >= 0) & (at < P), at, P)  # other pieces' tokens: dropped
            g = jnp.zeros((P, D), dx.dtype).at[at].add(dx_rows, mode="drop").astype(embed.dtype)
            if tied:  # the head's share
                g = g + jax.lax.dynamic_slice_in_dim(d_head[EMBEDDING], j * P, P, 0)
            return g

        n = row_chunks(embed.shape)

        def embed_stats(j, acc):
            g = d_embed(n, j)
            return acc[0] + jnp.sum(jnp.square(g.astype(jnp.float32))), acc[1] & all_finite(g)

        u.leaf(EMBEDDING, d_embed, jax.lax.fori_loop(
            0, n, embed_stats, (jnp.zeros((), jnp.float32), jnp.asarray(True))))
