"""The decoder every registered family configures (jaxmem.families), in Flax Linen.

Token embedding -> L x DecoderBlock (RMSNorm, RoPE, grouped-query attention, gated MLP) ->
RMSNorm -> LM head (tied to the embedding or not). Logits are always fp32. The variation points
are ModelConfig fields a family sets (QK-norm, q/k/v biases, the norms' placement, (1 + w) norms,
GeGLU, the embedding scale, sliding-window layers and their RoPE base), as flax's gemma example
does with its config enums. Its parts (`embed_lookup`, `layer_context`, `layer_facts`,
`DecoderBlock`, `final_norm`) are what `Decoder` composes and what --optimizer-in-backward
(jaxmem.train.inbackward) composes too.

The blocks are stacked with `nn.scan` (parameters get a leading layer axis L) and each is
wrapped in `nn.remat` with the chosen policy: measured on XLA, remat inside a scan is what
actually lowers peak memory (docs/architecture.md, "Why scan").

Parameter names are the checkpoints' (`q_proj`, `gate_proj`, `input_layernorm`, ...: every
registered family's use them), so conversion to and from a PyTorch `state_dict` is a reshape
and a transpose per tensor (jaxmem.families.names). Every
weight matrix is owned by a `Projection` (jaxmem.model.projection), the one place where fp8
matmuls, LoRA and quantized weights plug in; `einsum` is the multiply it uses.

The model computes in the dtype of the parameters it is given: the train step casts fp32 master
weights to the compute dtype before calling `apply` (jaxmem.model.precision). Norm statistics,
softmax, logits and the loss stay fp32 regardless.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxmem.families.config import ModelConfig
from jaxmem.families.names import EMBEDDING, HEAD
from jaxmem.model.attention import causal_attention, masked_attention
from jaxmem.model.cached import attend_cached
from jaxmem.model.fetch import fetching, in_host_memory
from jaxmem.model.lean import GATED
from jaxmem.model.layers import (RMSNorm, apply_rope, attention_mask, cache_mask, rope_tables,
                                 scaled_normal, window_cache_mask)
from jaxmem.einsum import Einsum, default_einsum, logits_einsum, project
from jaxmem.model.projection import Projection
from jaxmem.model.remat import RematPolicy
from jaxmem.sharding import constrain, constrain_weight, gather_weight, local_rows
from jaxmem.model.tiled import mlp_tile, tiled_mlp, tiles_under


class Attention(nn.Module):
    """Grouped-query self-attention: N query heads share K kv heads (no repeated k/v copies)."""

    config: ModelConfig
    einsum: Einsum = default_einsum

    @nn.compact
    def __call__(self, x, ctx: dict, local=None, cache=None):
        """-> (output [B, T, D], the updated cache or None).

        ctx: the layers' shared inputs (`layer_context`): RoPE tables, the mask, segment ids,
            and while decoding the cache index and masks.
        local: whether this is a sliding-window layer: a Python bool, or a traced one where the
            stack mixes both kinds (`ModelConfig.mixed_layers`; the scan passes each layer's).
        cache: (k, v), each [B, S, K, H] in the compute dtype: this call's keys and values are
            written at slots ctx["cache_index"].. and the queries attend to the cache under
            ctx["mask"] ([B, 1, T, S], layers.cache_mask). A dict of the stacked caches of
            each kind when the model has local layers (jaxmem.model.cached). None: self-attention
            over x.
        """
        c = self.config
        D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.resolved_head_dim
        proj = functools.partial(Projection, einsum=self.einsum)  # name, subscripts, shape, fan_in
        q = proj("q_proj", "BTD,DNH->BTNH", (D, N, H), D)(x)  # [B, T, N, H]
        k = proj("k_proj", "BTD,DKH->BTKH", (D, K, H), D)(x)  # [B, T, K, H]
        v = proj("v_proj", "BTD,DKH->BTKH", (D, K, H), D)(x)  # [B, T, K, H]
        if c.qkv_bias:  # Qwen2: [N, H] and [K, H] biases, added in the compute dtype
            q, k, v = (y + self.param(f"{n}_bias", nn.initializers.zeros, y.shape[2:],
                                      jnp.float32).astype(y.dtype)
                       for n, y in (("q", q), ("k", k), ("v", v)))
        if c.qk_norm:  # before RoPE
            q, k = (_qk_norm(c, name, y) for name, y in (("q_norm", q), ("k_norm", k)))
        cos, sin = _rope_of(ctx, local)
        q = apply_rope(q, cos, sin)
        if c.query_pre_attn_scalar is not None and c.query_pre_attn_scalar != H:
            # scores scaled by query_pre_attn_scalar^-1/2 where the kernels scale by H^-1/2
            q = q * jnp.asarray((H / c.query_pre_attn_scalar) ** 0.5, q.dtype)
        q = checkpoint_name(q, "query")
        k = checkpoint_name(apply_rope(k, cos, sin), "key")
        v = checkpoint_name(v, "value")
        if cache is None:
            ctx_ = _attend(c, q, k, v, ctx["mask"], ctx["segment_ids"], local)  # [B, T, N, H]
        elif isinstance(cache, dict):
            ctx_, cache = attend_cached(c, q, k, v, ctx, local, cache)
        else:  # decoding: write this call's k, v into the cache, attend to all of it
            k_cache, v_cache = (jax.lax.dynamic_update_slice_in_dim(
                buf, new.astype(buf.dtype), ctx["cache_index"], axis=1)
                for buf, new in zip(cache, (k, v)))
            cache = (k_cache, v_cache)  # [B, S, K, H] each
            ctx_ = masked_attention(q.astype(k_cache.dtype), k_cache, v_cache,
                                    ctx["mask"])  # [B, T, N, H]
        ctx_ = checkpoint_name(ctx_.astype(q.dtype), "attn_context")
        return proj("o_proj", "BTNH,NHD->BTD", (N, H, D), N * H)(ctx_), cache  # [B, T, D]


def _qk_norm(c: ModelConfig, name: str, y):
    """The QK-norm of y [B, T, heads, H]: over each head's H, one [H] scale for all (Qwen3,
    Gemma 3), or over the whole projection [heads * H] before the split (OLMo 2)."""
    norm = RMSNorm(c.rms_norm_eps, c.norm_plus_one, name=name)
    if c.qk_norm_scope == "head":
        return norm(y)  # [B, T, heads, H]
    B, T, n, H = y.shape
    return norm(y.reshape(B, T, n * H)).reshape(B, T, n, H)  # [B, T, heads * H] normed


def _rope_of(ctx: dict, local):
    """The (cos, sin) tables of a layer: the local layers' own where they differ."""
    if ctx.get("rope_local") is None or local is False or local is None:
        return ctx["rope"]
    if local is True:
        return ctx["rope_local"]
    return tuple(jnp.where(local, a, b) for a, b in zip(ctx["rope_local"], ctx["rope"]))


def _attend(c: ModelConfig, q, k, v, mask, segment_ids, local):
    """Causal attention of a layer, windowed where it is local (a cond on a traced `local`:
    both paths compiled, one run)."""
    if c.sliding_window is None or local is False or local is None:
        return causal_attention(q, k, v, mask, segment_ids)
    windowed = functools.partial(causal_attention, window=c.sliding_window)
    if local is True:
        return windowed(q, k, v, mask, segment_ids)
    return jax.lax.cond(local, lambda q, k, v: windowed(q, k, v, mask, segment_ids),
                        lambda q, k, v: causal_attention(q, k, v, mask, segment_ids), q, k, v)


class MLP(nn.Module):
    """A gated MLP: down(act(gate(x)) * up(x)), act silu (SwiGLU) or GELU-tanh (Gemma's GeGLU).
    tile: run it in sequence tiles where that saves memory (jaxmem.model.tiled; the Decoder
    decides when it may)."""

    config: ModelConfig
    einsum: Einsum = default_einsum
    tile: bool = False

    @nn.compact
    def __call__(self, x):
        D, F = self.config.hidden_size, self.config.intermediate_size
        gated = GATED[self.config.mlp_activation]
        proj = functools.partial(Projection, einsum=self.einsum)  # name, subscripts, shape, fan_in
        chunk = mlp_tile(local_rows(x.shape[0]), x.shape[1], F, D)  # sized by a device's rows
        tileable = self.einsum is default_einsum or hasattr(self.einsum, "prepare_weight")  # fp8
        if self.tile and tileable and chunk < x.shape[1]:
            ws = [proj(n, "", shape, fan_in).weight() for n, shape, fan_in in
                  (("gate_proj", (D, F), D), ("up_proj", (D, F), D), ("down_proj", (F, D), F))]
            return tiled_mlp(x, *ws, self.einsum, chunk, gated)  # [B, T, D]
        gate = proj("gate_proj", "BTD,DF->BTF", (D, F), D)(x)  # [B, T, F]
        gate = checkpoint_name(gate, "mlp_gate")
        up = checkpoint_name(proj("up_proj", "BTD,DF->BTF", (D, F), D)(x), "mlp_up")  # [B, T, F]
        # act(gate) * up; its backward keeps gate and up only (jaxmem.model.lean)
        hidden = checkpoint_name(gated(gate, up), "mlp_hidden")  # [B, T, F]
        return proj("down_proj", "BTF,FD->BTD", (F, D), F)(hidden)  # [B, T, D]


class DecoderBlock(nn.Module):
    """Residual block; `__call__` has scan's (carry, broadcast...) -> (carry, out) form.

    Its norms sit where `config.norms` says (jaxmem.families.norms): before attention and the
    MLP (Llama), also after each (Gemma 3's sandwich), or after each only (OLMo 2), an output
    normed before it joins the residual stream; the checkpoints' names."""

    config: ModelConfig
    einsum: Einsum = default_einsum
    tile_mlp: bool = False
    # "attention": x -> the residual stream after the attention; "mlp": that stream -> the
    # MLP's output, before any post-norm and the residual (the in-backward step's MLP, run in
    # slabs of F by a block whose config has the slab's F); "all": the block
    part: str = "all"

    @nn.compact
    def __call__(self, x, ctx: dict, layer: dict | None = None, cache=None):
        """x [B, T, D] (or, decoding a model with local layers, (x, the caches): the scan's
        carry); ctx: `layer_context`'s; layer: this layer's scanned facts ({"local": bool,
        "slot": int}) where the stack mixes kinds, else None."""
        c, p = self.config, self.config.norms
        norm = functools.partial(RMSNorm, c.rms_norm_eps, c.norm_plus_one)
        carried = isinstance(x, tuple)
        if carried:
            x, cache = x
        local = layer["local"] if layer and "local" in layer else c.local_layers[0]
        if layer is not None and "slot" in layer:
            ctx = {**ctx, "slot": layer["slot"]}
        if self.part != "mlp":
            x = checkpoint_name(x, "block_input")  # the scan's per-layer residual: offloadable
            h = x if p.before_attention is None else checkpoint_name(
                norm(name=p.before_attention)(x), "attn_norm")
            a, cache = Attention(c, self.einsum, name="self_attn")(h, ctx, local, cache)
            if p.after_attention is not None:
                a = norm(name=p.after_attention)(a)
            x = x + checkpoint_name(a, "attn_out")
            if self.part == "attention":
                return x, cache
        h = x if p.before_mlp is None else checkpoint_name(norm(name=p.before_mlp)(x),
                                                           "mlp_norm")
        m = MLP(c, self.einsum, self.tile_mlp, name="mlp")(h)
        if self.part == "mlp":
            return m, None
        if p.after_mlp is not None:
            m = norm(name=p.after_mlp)(m)
        x = x + checkpoint_name(m, "mlp_out")
        x = constrain(x, "block")  # [B, T, D]
        if carried:
            return (x, cache), None
        return x, cache  # the scan carry; this layer's cache


def embed_lookup(c: ModelConfig, embed, tokens):
    """The embedding rows of tokens [B, T] -> [B, T, D], times sqrt(D) (rounded to the
    embedding's dtype, as transformers does) where the family scales them (Gemma)."""
    x = jnp.take(embed, tokens, axis=0)  # [B, T, D]
    if c.embed_scale:
        x = x * jnp.asarray(c.hidden_size ** 0.5, x.dtype)
    return x


def layer_context(c: ModelConfig, tokens_shape, positions=None, padding_mask=None,
                  segment_ids=None) -> dict:
    """The inputs every layer shares: RoPE tables (the local layers' own where their base
    differs), the attention mask and the segment ids."""
    B, T = tokens_shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    H = c.rotary_dim  # the head dim, or the rotated part of it (partial rotary)
    rope = rope_tables(positions, H, **c.rope_kwargs())  # [B, T, H/2] x 2
    local = None
    if any(c.local_layers) and c.rope_kwargs(local=True) != c.rope_kwargs():
        local = rope_tables(positions, H, **c.rope_kwargs(local=True))
    mask = None if segment_ids is not None else attention_mask(padding_mask, T)
    return {"rope": rope, "rope_local": local, "mask": mask, "segment_ids": segment_ids}


def layer_facts(c: ModelConfig) -> dict | None:
    """Per layer, scanned beside its params where the stack mixes local and full-attention
    layers: {"local": [L] bool, "slot": [L] its index among the layers of its kind}."""
    if not c.mixed_layers:
        return None
    kinds = c.local_layers
    slot = [sum(1 for j in range(i) if kinds[j] == kinds[i]) for i in range(len(kinds))]
    return {"local": jnp.asarray(kinds), "slot": jnp.asarray(slot, jnp.int32)}


def final_norm(c: ModelConfig, **kw) -> RMSNorm:
    """The RMSNorm before the LM head."""
    return RMSNorm(c.rms_norm_eps, c.norm_plus_one, **kw)


def head_of(c: ModelConfig, params: dict):
    """(the head, its layout) in a params tree: the tied embedding [V, D] ("VD") or the lm_head
    [D, V] ("DV"), as `Decoder._head` multiplies them."""
    return (params[EMBEDDING], "VD") if c.tie_embeddings else (params[HEAD], "DV")


class Decoder(nn.Module):
    """tokens -> fp32 logits. `einsum` multiplies the blocks' projections (fp8_einsum for fp8)."""

    config: ModelConfig
    remat: RematPolicy = RematPolicy()
    einsum: Einsum = default_einsum

    @nn.compact
    def __call__(self, tokens, padding_mask=None, positions=None, return_hidden=False,
                 segment_ids=None, cache=None, cache_index=None, kv_valid=None):
        """tokens [B, T] int -> logits [B, T, V] fp32.

        padding_mask [B, T]: True for real tokens, False for padding (None: no padding).
        positions [B, T]: RoPE positions (default 0..T-1); for packed rows they restart at 0 in
            each segment.
        segment_ids [B, T]: packed rows (0 = padding, k = the k-th example): attention stays
            within a segment on every path (jaxmem.model.attention); padding_mask is then unused
            (segment 0 is the padding).
        cache, cache_index, kv_valid: decode against a KV cache (jaxmem.decode.sampling):
            cache = (k, v), each [L, B, S, K, H] in the compute dtype; the T tokens are written at
            slots cache_index.., kv_valid [B, S] says which slots hold real tokens (this call's
            included). Returns (logits [B, V] of the last position only, the updated cache).
        return_hidden: return (final hidden states [B, T, D], the head, its layout) instead of
            the logits, for a loss that applies the head itself in chunks
            (jaxmem.loss.chunked): the tied embedding [V, D] with "VD", or the lm_head
            [D, V] (or its weight object) with "DV".
        """
        c = self.config
        B, T = tokens.shape
        D, V = c.hidden_size, c.vocab_size
        # std D^-0.5: with tied embeddings the head then gives unit-variance logits at init.
        embed = self.param("embed_tokens", scaled_normal(D), (V, D), jnp.float32)
        embed = constrain_weight(embed, "embed_tokens")  # its gradient split like it on a mesh
        x = constrain(embed_lookup(c, embed, tokens), "embed")  # [B, T, D]
        ctx = layer_context(c, (B, T), positions, padding_mask, segment_ids)
        if cache is not None:
            return self._decode(x, ctx, cache, cache_index, kv_valid, embed)

        block = self._block(DecoderBlock, self.remat)
        if self.remat.enabled:
            block = nn.remat(block, policy=self.remat.jax_policy(), prevent_cse=False)
        facts = layer_facts(c)
        stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=(nn.broadcast, nn.broadcast if facts is None else 0),
                        length=c.num_layers)
        # Tile the MLP only where no remat policy wants its tagged activations (jaxmem.model.tiled)
        tile = tiles_under(self.remat)
        x, _ = stack(c, self.einsum, tile, name="layers")(x, ctx, facts)  # [B, T, D]

        out = self._head(x, embed, return_hidden)
        return out if return_hidden else constrain(out, "logits")  # [B, T, V] fp32

    def _head(self, x, embed, return_hidden: bool = False):
        """The final norm, then the head, tied or not: the model's one "norm + head" part (the
        logits, the loss's return_hidden path, the decode's last position). Outside the module
        the same choice of head is `head_of`. The head multiplies in fp32 accumulation to fp32
        logits whatever the compute dtype."""
        c = self.config
        x = final_norm(c, name="norm")(x)
        if c.tie_embeddings:
            if return_hidden:
                return x, embed, "VD"  # [B, T, D], the head as [V, D] (no transpose)
            return project("BTD,DV->BTV", x, embed.T, logits_einsum)  # [B, T, V]
        head = Projection("lm_head", "BTD,DV->BTV", (c.hidden_size, c.vocab_size),
                          c.hidden_size, logits_einsum)
        if return_hidden:
            # gathered once for all the loss's chunks (on a mesh), not once per chunk
            return x, gather_weight(head.weight(), "lm_head"), "DV"  # [B, T, D], [D, V]
        return head(x)

    def _block(self, block, remat: RematPolicy):
        """DecoderBlock, or where the given layer params sit in host memory (the frozen base
        under --offload-base host) a block that copies them to the device one layer at a time."""
        layers = self.variables.get("params", {}).get("layers")
        if layers is None or not any(map(in_host_memory, jax.tree_util.tree_leaves(layers))):
            return block  # the program is the one without offload, unchanged
        return fetching(block, remat)

    def _decode(self, x, ctx, cache, cache_index, kv_valid, embed):
        """The blocks over the cache (no remat: nothing is differentiated), then the head on the
        last position only: [B, V], never [B, T, V] (a prompt's prefill included).

        cache: (k, v) each [L, B, S, K, H], scanned a layer at a time; or, where the model has
        local layers, `init_cache`'s dict of per-kind stacks, carried whole (Attention)."""
        c = self.config
        T = x.shape[1]
        ctx = {**ctx, "cache_index": cache_index, "mask": cache_mask(kv_valid, cache_index, T)}
        block = self._block(DecoderBlock, RematPolicy("full"))
        facts = layer_facts(c)
        if isinstance(cache, dict):
            if "local" in cache:
                R = cache["local"][0].shape[2]
                ctx["mask_local"] = window_cache_mask(kv_valid, cache_index, T, R,
                                                      c.sliding_window)  # [B, 1, T, R + T]
            if facts is None:  # one kind: layer l is slot l of its stack
                facts = {"slot": jnp.arange(c.num_layers, dtype=jnp.int32)}
            stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                            in_axes=(nn.broadcast, 0), length=c.num_layers)
            (x, cache), _ = stack(c, self.einsum, False, name="layers")((x, cache), ctx, facts)
        else:
            stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                            in_axes=(nn.broadcast, nn.broadcast, 0), length=c.num_layers)
            x, cache = stack(c, self.einsum, False, name="layers")(
                x, ctx, None, cache)  # [B, T, D], ([L, B, S, K, H],) * 2
        return self._head(x[:, -1:], embed)[:, 0], cache  # [B, V] fp32
