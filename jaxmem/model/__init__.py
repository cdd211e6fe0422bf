"""The decoder's building blocks: layers, attention paths, the projection layer, remat.

    layers       RMSNorm, rope_tables, apply_rope, attention_mask
    attention    causal_attention (cuDNN or XLA, windowed where a layer is local),
                 attention_path (which one, and why)
    projection   Projection (owns each weight and its einsum; the ProjectedWeight seam it calls,
                 `project`, lives below the model in jaxmem.einsum)
    remat        RematPolicy (by name), TAGS
    roles        param_role, param_roles, count_by_role (the decoder's parameter names -> role)
    fp8          fp8_einsum, quantize, scaled_matmul

The decoder built from them, its parameter names and roles are the families' (jaxmem.families:
`model(config)`, jaxmem.families.decoder, jaxmem.model.roles). Below the model and not
re-exported here: jaxmem.einsum (the einsums, `project`, `ProjectedWeight`), jaxmem.sharding
(`constrain`, `activation_sharding`), jaxmem.remat (`RematError`, the policy grammar).
"""

from jaxmem.model.attention import AttentionPath, attention_path, causal_attention
from jaxmem.model.layers import RMSNorm, apply_rope, attention_mask, rope_tables
from jaxmem.model.projection import Projection
from jaxmem.model.remat import TAGS, RematPolicy
from jaxmem.model.roles import ROLES, count_by_role, param_role, param_roles

__all__ = [
    "AttentionPath", "Projection", "RMSNorm", "ROLES", "RematPolicy", "TAGS", "apply_rope",
    "attention_mask", "attention_path", "causal_attention", "count_by_role", "param_role",
    "param_roles", "rope_tables",
]
