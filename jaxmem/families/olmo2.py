"""OLMo 2 (1B to 32B): norms after attention and the MLP only (norm_placement "post": each
output normed before it joins the residual stream, no norm before either), and a QK-norm over
the whole q and k projections before the split into heads ([N*H] and [K*H] scales); otherwise
Llama's decoder, full attention, untied embeddings (transformers' Olmo2ForCausalLM).

Presets: the published shapes, from OLMo-core's TransformerConfig.olmo2_1B_v2 / olmo2_7B /
olmo2_13B / olmo2_32B (allenai/OLMo-core, src/olmo_core/nn/transformer/config.py) and
fairseq2's olmo2 registrar, with the Hub checkpoints' padded vocabulary of 100,352 (the
tokenizer has 100,278) and 4,096 positions: allenai/OLMo-2-0425-1B, OLMo-2-1124-7B,
OLMo-2-1124-13B, OLMo-2-0325-32B (1.48B, 7.30B, 13.7B, 32.2B parameters)."""

from jaxmem.families.base import Family, full_attention_only, refuse, register
from jaxmem.families.config import ModelConfig

_OLMO2 = dict(family="olmo2", vocab_size=100352, max_position_embeddings=4096,
              rope_theta=500000.0, rms_norm_eps=1e-6, norm_placement="post", qk_norm=True,
              qk_norm_scope="projection")

PRESETS = {
    "olmo-2-0425-1b": ModelConfig(hidden_size=2048, intermediate_size=8192, num_layers=16,
                                  num_heads=16, num_kv_heads=16, **_OLMO2),
    "olmo-2-1124-7b": ModelConfig(hidden_size=4096, intermediate_size=11008, num_layers=32,
                                  num_heads=32, num_kv_heads=32, **_OLMO2),
    "olmo-2-1124-13b": ModelConfig(hidden_size=5120, intermediate_size=13824, num_layers=40,
                                   num_heads=40, num_kv_heads=40, **_OLMO2),
    "olmo-2-0325-32b": ModelConfig(hidden_size=5120, intermediate_size=27648, num_layers=64,
                                   num_heads=40, num_kv_heads=8, **_OLMO2),
}


def _fields(d: dict) -> dict:
    # OLMo 1's clipping of q/k/v (Olmo2Config has none; a converted config.json may carry it)
    refuse(d, "clip_qkv", lambda v: False, "OLMo 2 clips nothing; OLMo 1's clip_qkv is not built")
    # OLMo 3's sliding-window layers are model_type olmo3; an olmo2 config.json naming one is not
    # a model transformers' Olmo2ForCausalLM builds either
    refuse(d, "sliding_window", lambda v: False, "OLMo 2 attends to every position")
    full_attention_only(d, "olmo2")
    return {"norm_placement": "post", "qk_norm": True, "qk_norm_scope": "projection"}


OLMO2 = register(Family("olmo2", "Olmo2ForCausalLM", fields=_fields, hf_keys=lambda c: {},
                        presets=PRESETS))
