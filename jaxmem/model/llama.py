"""A Llama-style decoder in Flax Linen.

Token embedding -> L x DecoderBlock (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP) ->
RMSNorm -> LM head (tied to the embedding or not). Logits are always fp32.

The blocks are stacked with `nn.scan` (parameters get a leading layer axis L) and each is
wrapped in `nn.remat` with the chosen policy: measured on XLA, remat inside a scan is what
actually lowers peak memory (DESIGN.md, "Why scan").

Parameter names follow Hugging Face's Llama (`q_proj`, `gate_proj`, `input_layernorm`, ...), so
conversion to and from a PyTorch `state_dict` is a reshape and a transpose per tensor.

The model computes in the dtype of the parameters it is given: the train step casts fp32 master
weights to the compute dtype before calling `apply` (jaxmem.train.precision). Norm statistics, softmax,
logits and the loss stay fp32 regardless.
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxmem.config.model import ModelConfig
from jaxmem.model.remat import RematPolicy

Einsum = Callable[[str, jax.Array, jax.Array], jax.Array]


def default_einsum(subscripts: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """Plain einsum in the activation dtype; jaxmem.model.fp8 supplies a drop-in fp8 version."""
    return jnp.einsum(subscripts, x, w.astype(x.dtype))


def _cpu_lacks(dtype) -> bool:
    """XLA:CPU has no fp16 x fp16 -> fp32 dot (attention, LM head); there we upcast operands.

    Only the CPU backend takes this path, where fp16 is emulated anyway and makes no memory claim.
    """
    return jnp.dtype(dtype) == jnp.float16 and jax.default_backend() == "cpu"


def _init(fan_in: int):
    return nn.initializers.normal(stddev=fan_in ** -0.5)


class RMSNorm(nn.Module):
    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float):
    """cos/sin tables [B, T, H/2] in fp32 for integer positions [B, T]."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate [B, T, heads, H] by position, Hugging Face's rotate_half layout (halves, not pairs)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [B, T, heads, H/2] each
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _xla_attention(q, k, v, mask):
    """XLA's attention: logits and softmax in fp32, the [B, N, T, S] probabilities materialized."""
    if mask is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return jax.nn.dot_product_attention(q, k, v, mask=mask)


@jax.custom_vjp
def _xla_attention_recomputed(q, k, v, mask):
    """`_xla_attention` whose backward recomputes the probabilities instead of keeping them.

    Flash attention (cuDNN, PyTorch's SDPA) keeps only its inputs and output for the backward;
    this does the same on the XLA path: the residuals are q, k, v and the mask, nothing
    [B, N, T, S]. Without it every remat policy but `full` keeps the fp32 probabilities (and
    logits or their compute-dtype copy) of every layer: 512 MiB per layer for llama-3.2-1b at
    seq 2048. The price is one more QK^T, softmax and PV per layer in the backward
    (docs/remat.md measures both).

    A custom_vjp, not `jax.checkpoint(..., policy=nothing_saveable)`: nested inside a block's
    remat, an inner checkpoint's policy is overridden by the outer one, and `dots` then saved
    QK^T again (measured with saved_residuals). The backward below only ever sees the
    residuals its forward returns, whatever the enclosing policy.
    """
    return _xla_attention(q, k, v, mask)


def _xla_attention_fwd(q, k, v, mask):
    return _xla_attention(q, k, v, mask), (q, k, v, mask)


def _xla_attention_bwd(res, d_ctx):
    q, k, v, mask = res
    _, vjp = jax.vjp(lambda q, k, v: _xla_attention(q, k, v, mask), q, k, v)
    return (*vjp(d_ctx), None)  # the mask is boolean: no cotangent


_xla_attention_recomputed.defvjp(_xla_attention_fwd, _xla_attention_bwd)


def _attention(q, k, v, mask):
    """Causal attention; cuDNN's fused flash attention where it applies, XLA's otherwise.

    `jax.nn.dot_product_attention(implementation=None)` always takes the XLA path (jax 0.10), so
    the cuDNN kernel is asked for explicitly: on a GPU, for bf16/fp16 inputs with the causal mask
    only. Shapes cuDNN rejects at trace time fall back to XLA. The XLA path computes logits and
    softmax in fp32 and recomputes them in the backward pass (`_xla_attention_recomputed`); the
    cuDNN kernel recomputes them itself.
    """
    if mask is None and jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
        try:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        except Exception:  # unsupported head dim / GPU generation / cuDNN version
            pass
    return _xla_attention_recomputed(q, k, v, mask)


class Attention(nn.Module):
    config: ModelConfig
    einsum: Einsum = default_einsum

    @nn.compact
    def __call__(self, x, cos, sin, mask):
        c = self.config
        D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.resolved_head_dim
        wq = self.param("q_proj", _init(D), (D, N, H), jnp.float32)
        wk = self.param("k_proj", _init(D), (D, K, H), jnp.float32)
        wv = self.param("v_proj", _init(D), (D, K, H), jnp.float32)
        wo = self.param("o_proj", _init(N * H), (N, H, D), jnp.float32)

        q = self.einsum("BTD,DNH->BTNH", x, wq)  # [B, T, N, H]
        k = self.einsum("BTD,DKH->BTKH", x, wk)  # [B, T, K, H]
        v = self.einsum("BTD,DKH->BTKH", x, wv)  # [B, T, K, H]
        q = checkpoint_name(apply_rope(q, cos, sin), "query")
        k = checkpoint_name(apply_rope(k, cos, sin), "key")
        v = checkpoint_name(v, "value")
        # GQA natively: N query heads share K kv heads.
        qkv = [t.astype(jnp.float32) for t in (q, k, v)] if _cpu_lacks(q.dtype) else (q, k, v)
        ctx = _attention(*qkv, mask)  # [B, T, N, H]
        ctx = checkpoint_name(ctx.astype(q.dtype), "attn_context")
        return self.einsum("BTNH,NHD->BTD", ctx, wo)  # [B, T, D]


class MLP(nn.Module):
    config: ModelConfig
    einsum: Einsum = default_einsum

    @nn.compact
    def __call__(self, x):
        D, F = self.config.hidden_size, self.config.intermediate_size
        w_gate = self.param("gate_proj", _init(D), (D, F), jnp.float32)
        w_up = self.param("up_proj", _init(D), (D, F), jnp.float32)
        w_down = self.param("down_proj", _init(F), (F, D), jnp.float32)
        gate = checkpoint_name(self.einsum("BTD,DF->BTF", x, w_gate), "mlp_gate")  # [B, T, F]
        up = checkpoint_name(self.einsum("BTD,DF->BTF", x, w_up), "mlp_up")  # [B, T, F]
        hidden = checkpoint_name(nn.silu(gate) * up, "mlp_hidden")  # [B, T, F]
        return self.einsum("BTF,FD->BTD", hidden, w_down)  # [B, T, D]


class DecoderBlock(nn.Module):
    """Pre-norm residual block; `__call__` has scan's (carry, broadcast...) -> (carry, out) form."""

    config: ModelConfig
    einsum: Einsum = default_einsum

    @nn.compact
    def __call__(self, x, cos, sin, mask):
        c = self.config
        h = checkpoint_name(RMSNorm(c.rms_norm_eps, name="input_layernorm")(x), "attn_norm")
        a = Attention(c, self.einsum, name="self_attn")(h, cos, sin, mask)
        x = x + checkpoint_name(a, "attn_out")
        h = checkpoint_name(RMSNorm(c.rms_norm_eps, name="post_attention_layernorm")(x), "mlp_norm")
        x = x + checkpoint_name(MLP(c, self.einsum, name="mlp")(h), "mlp_out")
        return x, None


def attention_mask(padding_mask: jax.Array | None, seq_len: int) -> jax.Array | None:
    """[B, 1, T, S] boolean mask: causal AND key-is-not-padding, or None for causal only.

    A padded query still attends to itself, so no softmax row is empty (no NaN); its output is
    ignored by the loss, and no real query ever attends to a padded key.
    """
    if padding_mask is None:
        return None
    causal = jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool))  # [T, S]
    mask = causal[None] & padding_mask.astype(bool)[:, None, :]  # [B, T, S]
    mask = mask | jnp.eye(seq_len, dtype=bool)[None]
    return mask[:, None]  # [B, 1, T, S]


class Llama(nn.Module):
    config: ModelConfig
    remat: RematPolicy = RematPolicy()
    einsum: Einsum = default_einsum

    @nn.compact
    def __call__(self, tokens, padding_mask=None, positions=None):
        """tokens [B, T] int -> logits [B, T, V] fp32.

        padding_mask [B, T]: True for real tokens, False for padding (None: no padding).
        positions [B, T]: RoPE positions (default 0..T-1).
        """
        c = self.config
        B, T = tokens.shape
        # std D^-0.5: with tied embeddings the head then gives unit-variance logits at init.
        embed = self.param("embed_tokens", _init(c.hidden_size), (c.vocab_size, c.hidden_size),
                           jnp.float32)
        dtype = embed.dtype
        x = jnp.take(embed, tokens, axis=0)  # [B, T, D]
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        cos, sin = rope_tables(positions, c.resolved_head_dim, c.rope_theta)  # [B, T, H/2]
        mask = attention_mask(padding_mask, T)

        block = DecoderBlock
        if self.remat.enabled:
            block = nn.remat(DecoderBlock, policy=self.remat.jax_policy(), prevent_cse=False)
        stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                        in_axes=(nn.broadcast, nn.broadcast, nn.broadcast), length=c.num_layers)
        x, _ = stack(c, self.einsum, name="layers")(x, cos, sin, mask)  # [B, T, D]

        x = RMSNorm(c.rms_norm_eps, name="norm")(x)
        if c.tie_embeddings:
            head = embed.T  # [D, V]
        else:
            head = self.param("lm_head", _init(c.hidden_size), (c.hidden_size, c.vocab_size),
                              jnp.float32)
        # fp32 accumulation and fp32 logits whatever the compute dtype.
        if _cpu_lacks(dtype):
            x, dtype = x.astype(jnp.float32), jnp.float32
        return jnp.einsum("BTD,DV->BTV", x, head.astype(dtype), preferred_element_type=jnp.float32)


def init_params(config: ModelConfig, rng: jax.Array, seq_len: int = 8):
    """fp32 parameters for `config` (allocates them)."""
    tokens = jnp.zeros((1, min(seq_len, config.max_position_embeddings)), jnp.int32)
    return jax.jit(lambda key: Llama(config).init(key, tokens)["params"])(rng)


def abstract_params(config: ModelConfig):
    """Parameter shapes and dtypes as `jax.ShapeDtypeStruct`s, without allocating anything."""
    return jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0), seq_len=1))


def count_params(params) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
