"""Phi-3 / Phi-4-mini (Phi3ForCausalLM): the shared decoder with partial rotary (RoPE on the
first int(head_dim * partial_rotary_factor) dims of each head) and fused checkpoint tensors:
`qkv_proj.weight` holds q's rows, then k's, then v's, and `gate_up_proj.weight` gate's rows then
up's (transformers' Phi3MLP: `gate, up = gate_up_states.chunk(2, dim=-1)`). jaxmem keeps its
separate q/k/v/gate/up params (and LoRA targets); the table reads each as a slice of the fused
tensor (jaxmem.families.names.fuse).

What a Phi3 config.json may set that jaxmem does not build is refused by key: LongRoPE
(`rope_scaling` type longrope / su / yarn: refused by the shared RoPE mapping), a sliding window
that could bite (smaller than max_position_embeddings; Phi-4-mini's 262144 > 131072 never
does, so it is read as no window), biases, and residual / embedding dropout (jaxmem trains
without dropout, as for attention_dropout)."""

from jaxmem.errors import ConfigError
from jaxmem.families.base import Family, refuse, register
from jaxmem.families.config import ModelConfig
from jaxmem.families.names import decoder_tensors, fuse

PRESETS = {
    # microsoft/Phi-4-mini-instruct's config.json (transformers 4.45 spelling): vocab 200064,
    # 3072 wide, 32 layers, 24 heads of 128, 8 kv heads, partial_rotary_factor 0.75 (96 rotary
    # dims), rope_theta 1e4, tied embeddings, SiLU; 3,836,021,760 params. Its rope_scaling is
    # LongRoPE (131072 positions, short factors and a cos/sin scale at every length), which
    # jaxmem cannot represent: this preset is the model at its original 4096 positions without
    # LongRoPE (same shapes and parameter count; not the published model's numerics).
    "phi-4-mini": ModelConfig(family="phi3", vocab_size=200064, hidden_size=3072,
                              intermediate_size=8192, num_layers=32, num_heads=24,
                              num_kv_heads=8, max_position_embeddings=4096, rope_theta=10000.0,
                              rms_norm_eps=1e-5, tie_embeddings=True, partial_rotary_factor=0.75),
}

_QKV = [("layers", "self_attn", p) for p in ("q_proj", "k_proj", "v_proj")]
_GATE_UP = [("layers", "mlp", p) for p in ("gate_proj", "up_proj")]


def _tensors(c: ModelConfig) -> list:
    """The shared decoder's table with q, k, v parts of qkv_proj and gate, up of gate_up_proj."""
    specs = fuse(decoder_tensors(c), _QKV, "model.layers.{i}.self_attn.qkv_proj.weight")
    return fuse(specs, _GATE_UP, "model.layers.{i}.mlp.gate_up_proj.weight")


def _rotary_factor(d: dict) -> float:
    """partial_rotary_factor from rope_parameters (transformers 5) or the top level (4.x)."""
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    value = params.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    value = 1.0 if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(f"config.json: partial_rotary_factor={value!r} must be a number in "
                          f"(0, 1]")
    return float(value)


def _fields(d: dict) -> dict:
    for key in ("rope_parameters", "rope_scaling"):
        src = d.get(key) if isinstance(d.get(key), dict) else {}
        kind = src.get("rope_type", src.get("type"))
        if kind not in (None, "default"):
            raise ConfigError(f"config.json: {key}.rope_type={kind!r} is not supported (Phi3's "
                              f"RoPE is the default one or LongRoPE; jaxmem builds the default)")
    refuse(d, "sliding_window", lambda v: v >= d.get("max_position_embeddings", 4096),
           "a window no shorter than max_position_embeddings only: read as no window")
    for key in ("resid_pdrop", "embd_pdrop"):
        refuse(d, key, lambda v: v == 0, "jaxmem has no dropout")
    refuse(d, "lm_head_bias", lambda v: v is False, "no bias on jaxmem's LM head")
    return {"partial_rotary_factor": _rotary_factor(d)}


def _hf_keys(c: ModelConfig) -> dict:
    # pad_token_id None unless the export names one: Phi3Config's default (32000) would lie
    # outside a smaller vocabulary
    return {"partial_rotary_factor": c.partial_rotary_factor, "sliding_window": None,
            "pad_token_id": None,
            "original_max_position_embeddings": c.max_position_embeddings,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                                "partial_rotary_factor": c.partial_rotary_factor}}


PHI3 = register(Family("phi3", "Phi3ForCausalLM", fields=_fields, hf_keys=_hf_keys,
                       tensors=_tensors, presets=PRESETS))
