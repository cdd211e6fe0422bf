"""A Llama-style decoder in Flax Linen.

Token embedding -> L x DecoderBlock (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP) ->
RMSNorm -> LM head (tied to the embedding or not). Logits are always fp32.

The blocks are stacked with `nn.scan` (parameters get a leading layer axis L) and each is
wrapped in `nn.remat` with the chosen policy: measured on XLA, remat inside a scan is what
actually lowers peak memory (docs/architecture.md, "Why scan").

Parameter names follow Hugging Face's Llama (`q_proj`, `gate_proj`, `input_layernorm`, ...), so
conversion to and from a PyTorch `state_dict` is a reshape and a transpose per tensor. Every
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

from jaxmem.config.model import ModelConfig
from jaxmem.model.attention import causal_attention, masked_attention
from jaxmem.model.lean import swiglu
from jaxmem.model.layers import RMSNorm, apply_rope, attention_mask, cache_mask, rope_tables, scaled_normal
from jaxmem.einsum import Einsum, default_einsum, logits_einsum, project
from jaxmem.model.projection import Projection
from jaxmem.model.remat import TAGS, RematPolicy
from jaxmem.sharding import constrain, constrain_weight, gather_weight, local_rows
from jaxmem.model.tiled import mlp_tile, tiled_mlp, tiles_under


class Attention(nn.Module):
    """Grouped-query self-attention: N query heads share K kv heads (no repeated k/v copies)."""

    config: ModelConfig
    einsum: Einsum = default_einsum

    @nn.compact
    def __call__(self, x, cos, sin, mask, segment_ids=None, cache=None, cache_index=None):
        """-> (output [B, T, D], the updated (k, v) cache or None).

        cache: (k, v), each [B, S, K, H] in the compute dtype: this call's keys and values are
            written at slots cache_index..cache_index+T-1 and the queries attend to the cache
            under `mask` ([B, 1, T, S], layers.cache_mask). None: self-attention over x.
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
        if c.qk_norm:  # over the head dim, shared by the heads, before RoPE (Qwen3)
            q = RMSNorm(c.rms_norm_eps, name="q_norm")(q)
            k = RMSNorm(c.rms_norm_eps, name="k_norm")(k)
        q = checkpoint_name(apply_rope(q, cos, sin), "query")
        k = checkpoint_name(apply_rope(k, cos, sin), "key")
        v = checkpoint_name(v, "value")
        if cache is None:
            ctx = causal_attention(q, k, v, mask, segment_ids)  # [B, T, N, H]
        else:  # decoding: write this call's k, v into the cache, attend to all of it
            k_cache, v_cache = (jax.lax.dynamic_update_slice_in_dim(
                buf, new.astype(buf.dtype), cache_index, axis=1) for buf, new in zip(cache, (k, v)))
            cache = (k_cache, v_cache)  # [B, S, K, H] each
            ctx = masked_attention(q.astype(k_cache.dtype), k_cache, v_cache, mask)  # [B, T, N, H]
        ctx = checkpoint_name(ctx.astype(q.dtype), "attn_context")
        return proj("o_proj", "BTNH,NHD->BTD", (N, H, D), N * H)(ctx), cache  # [B, T, D]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). tile: run it in sequence tiles where that saves
    memory (jaxmem.model.tiled; Llama decides when it may)."""

    config: ModelConfig
    einsum: Einsum = default_einsum
    tile: bool = False

    @nn.compact
    def __call__(self, x):
        D, F = self.config.hidden_size, self.config.intermediate_size
        proj = functools.partial(Projection, einsum=self.einsum)  # name, subscripts, shape, fan_in
        chunk = mlp_tile(local_rows(x.shape[0]), x.shape[1], F)  # sized by a device's rows
        tileable = self.einsum is default_einsum or hasattr(self.einsum, "prepare_weight")  # fp8
        if self.tile and tileable and chunk < x.shape[1]:
            ws = [proj(n, "", shape, fan_in).weight() for n, shape, fan_in in
                  (("gate_proj", (D, F), D), ("up_proj", (D, F), D), ("down_proj", (F, D), F))]
            return tiled_mlp(x, *ws, self.einsum, chunk)  # [B, T, D]
        gate = proj("gate_proj", "BTD,DF->BTF", (D, F), D)(x)  # [B, T, F]
        gate = checkpoint_name(gate, "mlp_gate")
        up = checkpoint_name(proj("up_proj", "BTD,DF->BTF", (D, F), D)(x), "mlp_up")  # [B, T, F]
        # silu(gate) * up; its backward keeps gate and up only (jaxmem.model.lean)
        hidden = checkpoint_name(swiglu(gate, up), "mlp_hidden")  # [B, T, F]
        return proj("down_proj", "BTF,FD->BTD", (F, D), F)(hidden)  # [B, T, D]


class DecoderBlock(nn.Module):
    """Pre-norm residual block; `__call__` has scan's (carry, broadcast...) -> (carry, out) form."""

    config: ModelConfig
    einsum: Einsum = default_einsum
    tile_mlp: bool = False

    @nn.compact
    def __call__(self, x, cos, sin, mask, segment_ids=None, cache=None, cache_index=None):
        c = self.config
        x = checkpoint_name(x, "block_input")  # the scan's per-layer residual, named: offloadable
        h = checkpoint_name(RMSNorm(c.rms_norm_eps, name="input_layernorm")(x), "attn_norm")
        a, cache = Attention(c, self.einsum, name="self_attn")(h, cos, sin, mask, segment_ids,
                                                               cache, cache_index)
        x = x + checkpoint_name(a, "attn_out")
        h = checkpoint_name(RMSNorm(c.rms_norm_eps, name="post_attention_layernorm")(x), "mlp_norm")
        x = x + checkpoint_name(MLP(c, self.einsum, self.tile_mlp, name="mlp")(h), "mlp_out")
        return constrain(x, "block"), cache  # [B, T, D] the scan carry; this layer's cache


def _in_host_memory(x) -> bool:
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def layer_to_device(layer_params):
    """One layer's params inside the layer scan, with every leaf kept in host memory copied to
    the device (`--offload-base host`, jaxmem.peft.offload). The copy is tagged "base_layer",
    which no remat policy saves: the backward fetches the layer again instead of keeping all L
    device copies."""
    def fetch(x):
        if not _in_host_memory(x):
            return x
        return checkpoint_name(jax.device_put(x, jax.memory.Space.Device), "base_layer")
    return jax.tree_util.tree_map(fetch, layer_params)


def _fetching(block, remat: RematPolicy):
    """`block` reading its params through layer_to_device. Under remat none the block is
    rematerialized keeping every tagged activation (remat.TAGS) and nothing else: saving all
    residuals would keep values computed from each fetched layer (its transposes, an NF4
    weight's leaves), i.e. L device copies of the base (seen in the CUDA lowering: fetches in
    the forward loop only, weight-shaped carries out of it)."""
    block = nn.map_variables(block, "params", trans_in_fn=layer_to_device, init=True)
    if not remat.enabled:
        policy = jax.checkpoint_policies.save_only_these_names(*TAGS)
        block = nn.remat(block, policy=policy, prevent_cse=False)
    return block


class Llama(nn.Module):
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
        x = constrain(jnp.take(embed, tokens, axis=0), "embed")  # [B, T, D]
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        cos, sin = rope_tables(positions, c.resolved_head_dim, c.rope_theta,
                               c.llama3_rope)  # [B, T, H/2]
        if cache is not None:
            return self._decode(x, cos, sin, cache, cache_index, kv_valid, embed)
        mask = None if segment_ids is not None else attention_mask(padding_mask, T)

        block = self._block(DecoderBlock, self.remat)
        if self.remat.enabled:
            block = nn.remat(block, policy=self.remat.jax_policy(), prevent_cse=False)
        stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=(nn.broadcast,) * 4, length=c.num_layers)
        # Tile the MLP only where no remat policy wants its tagged activations (jaxmem.model.tiled)
        tile = tiles_under(self.remat)
        x, _ = stack(c, self.einsum, tile, name="layers")(x, cos, sin, mask,
                                                          segment_ids)  # [B, T, D]

        x = RMSNorm(c.rms_norm_eps, name="norm")(x)
        # The head multiplies in fp32 accumulation to fp32 logits whatever the compute dtype.
        if c.tie_embeddings:
            if return_hidden:
                return x, embed, "VD"  # [B, T, D], the head as [V, D] (no transpose)
            logits = project("BTD,DV->BTV", x, embed.T, logits_einsum)  # [B, T, V]
        else:
            head = Projection("lm_head", "BTD,DV->BTV", (D, V), D, logits_einsum)
            if return_hidden:
                # gathered once for all the loss's chunks (on a mesh), not once per chunk
                return x, gather_weight(head.weight(), "lm_head"), "DV"  # [B, T, D], [D, V]
            logits = head(x)
        return constrain(logits, "logits")  # [B, T, V] fp32

    def _block(self, block, remat: RematPolicy):
        """DecoderBlock, or where the given layer params sit in host memory (the frozen base
        under --offload-base host) a block that copies them to the device one layer at a time."""
        layers = self.variables.get("params", {}).get("layers")
        if layers is None or not any(map(_in_host_memory, jax.tree_util.tree_leaves(layers))):
            return block  # the program is the one without offload, unchanged
        return _fetching(block, remat)

    def _decode(self, x, cos, sin, cache, cache_index, kv_valid, embed):
        """The blocks over the cache (no remat: nothing is differentiated), then the head on the
        last position only: [B, V], never [B, T, V] (a prompt's prefill included)."""
        c = self.config
        mask = cache_mask(kv_valid, cache_index, x.shape[1])  # [B, 1, T, S]
        stack = nn.scan(self._block(DecoderBlock, RematPolicy("full")),
                        variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=(nn.broadcast,) * 4 + (0, nn.broadcast), length=c.num_layers)
        x, cache = stack(c, self.einsum, False, name="layers")(
            x, cos, sin, mask, None, cache, cache_index)  # [B, T, D], ([L, B, S, K, H],) * 2
        x = RMSNorm(c.rms_norm_eps, name="norm")(x[:, -1:])  # [B, 1, D]
        if c.tie_embeddings:
            logits = project("BTD,DV->BTV", x, embed.T, logits_einsum)  # [B, 1, V]
        else:
            logits = Projection("lm_head", "BTD,DV->BTV", (c.hidden_size, c.vocab_size),
                                c.hidden_size, logits_einsum)(x)  # [B, 1, V]
        return logits[:, 0], cache  # [B, V] fp32


def init_params(config: ModelConfig, rng: jax.Array, seq_len: int = 8, dtype=None):
    """Parameters for `config` (allocates them): Flax's fp32 init, or with `dtype` every
    floating leaf in `dtype`.

    With `dtype` (fp32 too) the values are bitwise Flax's init cast to `dtype`, evaluated by
    jaxmem.model.typed_init: no fp32 copy of a bf16 model, no full-size threefry buffers on
    CPU. llama-3-8b in bf16 compiles on CPU to 14.96 GiB of output and 0.58 GiB of
    temporaries: `jax.jit(lambda k: init_params(cfg, k, dtype=jnp.bfloat16)).lower(key).compile()`.
    """
    tokens = jnp.zeros((1, min(seq_len, config.max_position_embeddings)), jnp.int32)

    def init(key):
        return Llama(config).init(key, tokens)["params"]

    if dtype is None:
        return jax.jit(init)(rng)
    from jaxmem.model.typed_init import init_in_dtype
    return jax.jit(lambda key: init_in_dtype(init, key, dtype))(rng)


def abstract_params(config: ModelConfig, dtype=None):
    """Parameter shapes and dtypes as `jax.ShapeDtypeStruct`s, without allocating anything."""
    abstract = jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0), seq_len=1))
    if dtype is None:
        return abstract
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype) if jnp.issubdtype(
        x.dtype, jnp.floating) else x, abstract)


def count_params(params) -> int:
    """Elements over all leaves (arrays or `jax.ShapeDtypeStruct`s)."""
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
