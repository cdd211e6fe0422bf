"""The jaxmem Llama as a PyTorch `nn.Module`, for side-by-side comparison with the JAX model.

Same architecture and numerics as `jaxmem.families.decoder` (checked by `tests/test_torch_parity.py`):

    embedding -> L x block (RMSNorm, RoPE, GQA attention, SwiGLU MLP) -> RMSNorm -> LM head

* RoPE uses Hugging Face's rotate_half layout (halves, not interleaved pairs), computed in fp32
  and cast back, exactly like `jaxmem.model.apply_rope`; no q/k permutation is needed when
  converting weights (`experiments/compare/convert.py`).
* RMSNorm normalizes in fp32, multiplies by the weight in fp32, then casts back to the input
  dtype -- jaxmem's order. Hugging Face casts back *before* multiplying by the weight; the two
  agree in fp32 and differ by one bf16 rounding in bf16.
* Attention is `F.scaled_dot_product_attention` with `enable_gqa=True` (no repeated k/v copies)
  and the boolean mask of `jaxmem.model.attention_mask`, or `is_causal=True` without padding.
* Logits are returned in fp32. Under autocast the head matmul runs in the autocast dtype and is
  upcast afterwards (the Hugging Face recipe); jaxmem instead accumulates it in fp32
  (`preferred_element_type`), so bf16 logits differ by one rounding of the output.

Module and parameter names are those of Hugging Face's `LlamaForCausalLM` (`model.layers.0.
self_attn.q_proj.weight`, ...), so its `state_dict` loads HF checkpoints directly.

Set `model.gradient_checkpointing = True` to wrap every decoder layer in
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`; also set
`model.checkpoint_context_fn` (e.g. via `experiments.compare.torch_train.set_remat(model, "selective")`)
for selective activation checkpointing inside each layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from jaxmem.families.config import ModelConfig


def _normal_(weight: torch.Tensor, fan_in: int) -> torch.Tensor:
    # jaxmem's initializer: normal with stddev fan_in ** -0.5 (embedding: fan_in 1, stddev 1).
    with torch.no_grad():
        return weight.normal_(0.0, fan_in ** -0.5)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float):
    """cos/sin tables [B, T, H/2] in fp32 for integer positions [B, T] (jaxmem.model.rope_tables)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim
    inv_freq = 1.0 / theta ** exponent  # [H/2]
    angles = positions.float()[..., None] * inv_freq  # [B, T, H/2]
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [B, heads, T, H] by position: rotate_half layout, fp32, cast back."""
    x1, x2 = x.float().chunk(2, dim=-1)  # [B, heads, T, H/2] each
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, H/2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def attention_mask(padding_mask: torch.Tensor | None, seq_len: int) -> torch.Tensor | None:
    """[B, 1, T, S] bool: causal AND key-is-not-padding, OR the diagonal (jaxmem.families.decoder)."""
    if padding_mask is None:
        return None
    device = padding_mask.device
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()  # [T, S]
    mask = causal[None] & padding_mask.bool()[:, None, :]  # [B, T, S]
    mask = mask | torch.eye(seq_len, dtype=torch.bool, device=device)[None]
    return mask[:, None]  # [B, 1, T, S]


class LlamaAttention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.resolved_head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = N, K, H
        self.q_proj = nn.Linear(D, N * H, bias=False)
        self.k_proj = nn.Linear(D, K * H, bias=False)
        self.v_proj = nn.Linear(D, K * H, bias=False)
        self.o_proj = nn.Linear(N * H, D, bias=False)

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        N, K, H = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, N, H).transpose(1, 2)  # [B, N, T, H]
        k = self.k_proj(x).view(B, T, K, H).transpose(1, 2)  # [B, K, T, H]
        v = self.v_proj(x).view(B, T, K, H).transpose(1, 2)  # [B, K, T, H]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if mask is None:
            ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        ctx = ctx.transpose(1, 2).reshape(B, T, N * H)  # [B, T, N*H]
        return self.o_proj(ctx)  # [B, T, D]


class LlamaMLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        D, Fw = c.hidden_size, c.intermediate_size
        self.gate_proj = nn.Linear(D, Fw, bias=False)
        self.up_proj = nn.Linear(D, Fw, bias=False)
        self.down_proj = nn.Linear(Fw, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        # Hugging Face's registration order, so state_dict keys come out in HF's order.
        self.self_attn = LlamaAttention(c)
        self.mlp = LlamaMLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """tokens [B, T] -> logits [B, T, V] fp32; parameters named as in Hugging Face."""

    def __init__(self, config: ModelConfig, gradient_checkpointing: bool = False):
        super().__init__()
        self.config = config
        self.gradient_checkpointing = gradient_checkpointing
        self.checkpoint_context_fn = None  # torch.utils.checkpoint's context_fn (selective)
        self.model = LlamaModel(config)
        if not config.tie_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self):
        """jaxmem's init: normal(fan_in ** -0.5) for matrices, stddev 1 embedding, unit norms."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                with torch.no_grad():
                    p.fill_(1.0)
            elif name == "model.embed_tokens.weight":
                _normal_(p, 1)
            else:
                _normal_(p, p.shape[1])  # Linear weight [out, in]: fan_in is `in`

    @property
    def head_weight(self) -> torch.Tensor:  # [V, D]
        return self.model.embed_tokens.weight if self.config.tie_embeddings else self.lm_head.weight

    def forward(self, tokens, padding_mask=None, positions=None):
        """padding_mask [B, T]: True/1 for real tokens (None: no padding); positions [B, T]."""
        c = self.config
        B, T = tokens.shape
        x = self.model.embed_tokens(tokens)  # [B, T, D]
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        cos, sin = rope_tables(positions, c.resolved_head_dim, c.rope_theta)  # [B, T, H/2]
        mask = attention_mask(padding_mask, T)  # [B, 1, T, S] or None
        for layer in self.model.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                kw = {"context_fn": self.checkpoint_context_fn} if self.checkpoint_context_fn else {}
                x = checkpoint(layer, x, cos, sin, mask, use_reentrant=False, **kw)
            else:
                x = layer(x, cos, sin, mask)
        x = self.model.norm(x)
        return F.linear(x, self.head_weight).float()  # [B, T, V]


def loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over tokens with mask == 1, fp32 (what jaxmem.train.loss.token_loss computes)."""
    token_loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten().long(),
                                 reduction="none")  # [B*T]
    w = mask.flatten().float()
    return (token_loss * w).sum() / w.sum().clamp(min=1.0)


def num_params(model: nn.Module) -> int:
    """Unique parameters (a tied embedding counts once), comparable with ModelConfig.num_params."""
    return sum(p.numel() for p in model.parameters())


__all__ = ["LlamaForCausalLM", "RMSNorm", "apply_rope", "attention_mask", "loss", "num_params",
           "rope_tables"]
