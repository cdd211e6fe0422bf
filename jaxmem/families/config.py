"""ModelConfig: a frozen dataclass of the decoder's shapes and variation points, and the
byte-level tokenizer's ids (the default vocabulary).

Every family (jaxmem.families) maps its config.json onto these fields and keeps its own presets;
the full-size presets carry the published shapes, so `jax.eval_shape` on them reproduces the
published parameter counts without allocating a byte (see `tests/test_model.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jaxmem.errors import ConfigError
from jaxmem.families.norms import PLACEMENTS, NormPlacement

# Byte-level tokenizer ids (see jaxmem.data): bytes are 0..255, then the special tokens.
PAD_TOKEN_ID = 256
BOS_TOKEN_ID = 257
EOS_TOKEN_ID = 258
BYTE_VOCAB_SIZE = 259


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and variation points of the decoder (jaxmem.families.decoder).

    `head_dim` defaults to `hidden_size // num_heads` (None); Llama 3.2 3B is the one preset
    where the published head dim is set explicitly (128 with 24 heads of a 3072 width).
    """

    vocab_size: int = BYTE_VOCAB_SIZE
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # RoPE frequency scaling: "default" (none) or "llama3" (Llama 3.1 / 3.2: low frequencies
    # divided by `rope_factor`, high ones kept, a smooth blend between; see
    # jaxmem.model.layers.rope_inv_freq, transformers' `_compute_llama3_parameters`).
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    # The model family (jaxmem.families: its config.json mapping, HF names and presets) and the
    # decoder's variation points it sets. qk_norm: an RMSNorm over the head dim on q and k
    # before RoPE (Qwen3); qkv_bias: biases on the q, k and v projections (Qwen2).
    family: str = "llama"
    qk_norm: bool = False
    qkv_bias: bool = False
    # What the QK-norm normalizes over: "head" (each head's H, one [H] scale the heads share:
    # Qwen3, Gemma 3) or "projection" (all of q_proj's / k_proj's output before the split
    # into heads, [N*H] and [K*H] scales: OLMo 2).
    qk_norm_scope: str = "head"
    # norm_placement: where a block's RMSNorms sit (jaxmem.families.norms): "pre" (before
    # attention and the MLP), "sandwich" (Gemma 3: before and after each), "post" (OLMo 2:
    # after each only).
    norm_placement: str = "pre"
    # Gemma 3's variation points. norm_plus_one: RMSNorm scales by (1 + w), w initialised 0;
    # mlp_activation:
    # "silu" (SwiGLU) or "gelu_tanh" (GeGLU); embed_scale: embeddings times sqrt(hidden_size);
    # query_pre_attn_scalar: attention scores scaled by its -1/2 power instead of head_dim's.
    norm_plus_one: bool = False
    mlp_activation: str = "silu"
    embed_scale: bool = False
    query_pre_attn_scalar: int | None = None
    # Sliding-window attention: a local layer's query at position q sees keys q-W < k <= q
    # (W = sliding_window). layer_types: "sliding_attention" / "full_attention" per layer, as
    # config.json spells them (None: every layer local when sliding_window is set, else full).
    # rope_local_theta: the local layers' RoPE base (None: rope_theta); RoPE scaling
    # (rope_type llama3 / linear) applies to the full-attention layers only.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    # Partial rotary (Phi-3 / Phi-4-mini): RoPE turns the first int(head_dim * factor) dims of
    # each head (rotate_half within them, frequencies over them), the rest pass unrotated.
    partial_rotary_factor: float = 1.0

    def __post_init__(self):
        self._check_shapes()
        self._check_rope()
        if not isinstance(self.family, str) or not self.family:
            raise ConfigError(f"ModelConfig.family must be a family's name, got {self.family!r}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if self.qk_norm_scope not in ("head", "projection"):
            raise ConfigError(f"ModelConfig.qk_norm_scope must be 'head' or 'projection', "
                              f"got {self.qk_norm_scope!r}")
        if self.norm_placement not in PLACEMENTS:
            raise ConfigError(f"ModelConfig.norm_placement must be one of "
                              f"{', '.join(map(repr, PLACEMENTS))}, got {self.norm_placement!r}")
        if self.mlp_activation not in ("silu", "gelu_tanh"):
            raise ConfigError(f"ModelConfig.mlp_activation must be 'silu' or 'gelu_tanh', "
                              f"got {self.mlp_activation!r}")
        self._check_attention_window()

    def _check_shapes(self) -> None:
        """ConfigError unless the sizes are positive integers, the heads divide the width (or
        head_dim is set) and the kv heads the heads, and RoPE turns an even number of dims."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.head_dim is not None and (not isinstance(self.head_dim, int) or self.head_dim <= 0):
            raise ConfigError(f"ModelConfig.head_dim must be a positive integer, got {self.head_dim!r}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ConfigError(
                f"ModelConfig.num_heads={self.num_heads} does not divide "
                f"hidden_size={self.hidden_size} (set head_dim explicitly to allow this)")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"ModelConfig.num_kv_heads={self.num_kv_heads} does not divide "
                              f"num_heads={self.num_heads}")
        if self.resolved_head_dim % 2:
            raise ConfigError(f"ModelConfig.head_dim={self.resolved_head_dim} must be even for RoPE")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or not self.rotary_dim:
            raise ConfigError(f"ModelConfig.partial_rotary_factor={self.partial_rotary_factor!r} "
                              f"must be in (0, 1] and turn an even, nonzero number of the "
                              f"{self.resolved_head_dim} head dims")

    def _check_rope(self) -> None:
        """ConfigError unless rope_theta is positive and rope_type is known, with the factors
        its scaling needs."""
        if not self.rope_theta > 0:
            raise ConfigError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if self.rope_type not in ("default", "llama3", "linear"):
            raise ConfigError(f"ModelConfig.rope_type must be 'default', 'llama3' or 'linear', "
                              f"got {self.rope_type!r}")
        if self.rope_type == "linear" and not self.rope_factor > 0:
            raise ConfigError(f"ModelConfig linear RoPE needs rope_factor > 0, "
                              f"got {self.rope_factor!r}")
        if self.rope_type == "llama3" and not (
                self.rope_factor > 0 and self.rope_original_max_position_embeddings > 0
                and self.rope_high_freq_factor > self.rope_low_freq_factor > 0):
            raise ConfigError("ModelConfig llama3 RoPE needs rope_factor > 0, "
                              "rope_original_max_position_embeddings > 0 and "
                              "rope_high_freq_factor > rope_low_freq_factor > 0")

    def _check_attention_window(self) -> None:
        """ConfigError unless sliding_window is a positive integer or None and layer_types (made
        a tuple) names one known kind per layer, sliding ones only with a window."""
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or self.sliding_window <= 0):
            raise ConfigError(f"ModelConfig.sliding_window must be a positive integer or None, "
                              f"got {self.sliding_window!r}")
        if self.layer_types is None:
            return
        object.__setattr__(self, "layer_types", tuple(self.layer_types))  # a JSON list too
        kinds = set(self.layer_types) - {"sliding_attention", "full_attention"}
        if len(self.layer_types) != self.num_layers or kinds:
            raise ConfigError(f"ModelConfig.layer_types must give 'sliding_attention' or "
                              f"'full_attention' for each of the {self.num_layers} layers, "
                              f"got {list(self.layer_types)!r}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ConfigError("ModelConfig.layer_types names sliding_attention layers but "
                              "sliding_window is not set")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        """The head dims RoPE turns (the first ones; transformers' int(head_dim * factor))."""
        return int(self.resolved_head_dim * self.partial_rotary_factor)

    @property
    def norms(self) -> NormPlacement:
        """Where the block's norms sit: which feeds attention, which the MLP, which norm their
        outputs (jaxmem.families.norms)."""
        return PLACEMENTS[self.norm_placement]

    @property
    def qk_norm_widths(self) -> tuple[int, int]:
        """The widths of the QK-norm's q and k scales: H each, or N*H and K*H over the whole
        projections."""
        H = self.resolved_head_dim
        if self.qk_norm_scope == "projection":
            return self.num_heads * H, self.num_kv_heads * H
        return H, H

    @property
    def llama3_rope(self) -> tuple | None:
        """(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings) for
        llama3 RoPE scaling, None for plain RoPE (jaxmem.model.layers.rope_inv_freq)."""
        if self.rope_type != "llama3":
            return None
        return (self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                self.rope_original_max_position_embeddings)

    def rope_kwargs(self, local: bool = False) -> dict:
        """rope_tables' theta and scaling for a full-attention layer, or a local one (its own
        base, no scaling)."""
        if local:
            theta = self.rope_theta if self.rope_local_theta is None else self.rope_local_theta
            return {"theta": theta}
        return {"theta": self.rope_theta, "llama3": self.llama3_rope,
                "linear": self.rope_factor if self.rope_type == "linear" else None}

    @property
    def local_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it is a sliding-window (local) layer."""
        if self.sliding_window is None:
            return (False,) * self.num_layers
        if self.layer_types is None:
            return (True,) * self.num_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @property
    def mixed_layers(self) -> bool:
        """Local and full-attention layers in one stack (Gemma 3): the scan is told each
        layer's kind."""
        return len(set(self.local_layers)) == 2

    def replace(self, **overrides) -> "ModelConfig":
        """A copy with some fields changed; unknown fields raise ConfigError naming them."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ConfigError(f"unknown ModelConfig field(s): {', '.join(unknown)}")
        return dataclasses.replace(self, **overrides)


def upgrade_fields(d: dict) -> dict:
    """A model dict (a run's config.json "model" section or its "resolved_model") as this
    ModelConfig reads it: `sandwich_norms` (a bool; None in a model section: the preset's),
    written before `norm_placement` replaced it, becomes norm_placement "sandwich" or "pre".
    Other keys are left as they are; `d` is not changed."""
    if "sandwich_norms" not in d:
        return d
    d = dict(d)
    old = d.pop("sandwich_norms")
    if old is not None and d.get("norm_placement") is None:
        d["norm_placement"] = "sandwich" if old else "pre"
    return d
