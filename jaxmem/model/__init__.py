"""The Llama-style model: layers, attention paths, the projection layer, roles, remat, sharding.

    llama        Llama, DecoderBlock, Attention, MLP; init_params, abstract_params, count_params
    layers       RMSNorm, rope_tables, apply_rope, attention_mask
    attention    causal_attention (cuDNN or XLA), attention_path (which one, and why)
    projection   Projection (owns each weight; multiplies through jaxmem.lora.project)
    roles        param_role, param_roles, count_by_role
    sharding     constrain, activation_sharding (the activation-sharding hook)
    remat        RematPolicy (by name), TAGS
    fp8          fp8_einsum, quantize, scaled_matmul
"""

from jaxmem.model.attention import AttentionPath, attention_path, causal_attention
from jaxmem.model.layers import RMSNorm, apply_rope, attention_mask, rope_tables
from jaxmem.model.llama import (MLP, Attention, DecoderBlock, Llama, abstract_params, count_params,
                                init_params)
from jaxmem.model.projection import Projection, logits_einsum
from jaxmem.model.remat import TAGS, RematError, RematPolicy
from jaxmem.model.roles import ROLES, count_by_role, param_role, param_roles
from jaxmem.model.sharding import KINDS, activation_sharding, constrain

__all__ = [
    "Attention", "AttentionPath", "DecoderBlock", "KINDS", "Llama", "MLP",
    "Projection", "RMSNorm", "ROLES", "RematError", "RematPolicy", "TAGS",
    "abstract_params", "activation_sharding", "apply_rope", "attention_mask", "attention_path",
    "causal_attention", "constrain", "count_by_role", "count_params",
    "init_params", "logits_einsum", "param_role", "param_roles", "rope_tables",
]
