"""The Llama-style model: layers, attention paths, the projection layer, roles, remat.

    llama        Llama, DecoderBlock, Attention, MLP; init_params, abstract_params, count_params
    layers       RMSNorm, rope_tables, apply_rope, attention_mask
    attention    causal_attention (cuDNN or XLA), attention_path (which one, and why)
    projection   Projection (owns each weight and its einsum; the ProjectedWeight seam it calls,
                 `project`, lives below the model in jaxmem.einsum)
    roles        param_role, param_roles, count_by_role
    remat        RematPolicy (by name), TAGS
    fp8          fp8_einsum, quantize, scaled_matmul

Below the model and not re-exported here: jaxmem.einsum (the einsums, `project`,
`ProjectedWeight`), jaxmem.sharding (`constrain`, `activation_sharding`), jaxmem.remat
(`RematError`, the policy grammar).
"""

from jaxmem.model.attention import AttentionPath, attention_path, causal_attention
from jaxmem.model.layers import RMSNorm, apply_rope, attention_mask, rope_tables
from jaxmem.model.llama import (MLP, Attention, DecoderBlock, Llama, abstract_params, count_params,
                                init_params)
from jaxmem.model.projection import Projection
from jaxmem.model.remat import TAGS, RematPolicy
from jaxmem.model.roles import ROLES, count_by_role, param_role, param_roles

__all__ = [
    "Attention", "AttentionPath", "DecoderBlock", "Llama", "MLP", "Projection", "RMSNorm", "ROLES",
    "RematPolicy", "TAGS", "abstract_params", "apply_rope", "attention_mask", "attention_path",
    "causal_attention", "count_by_role", "count_params", "init_params", "param_role",
    "param_roles", "rope_tables",
]
