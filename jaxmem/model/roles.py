"""Parameter roles: what each parameter of the model is, from its path in the params tree.

    param_role(path)      ('layers', 'self_attn', 'q_proj') -> "q_proj"
    param_roles(params)   the params tree with each leaf replaced by its role
    count_by_role(params) elements per role, e.g. {"norm": 2 * L * D + D, ...}

Code that treats parameters differently (weight decay, keeping norms fp32, sharding rules, the
memory planner's count of never-cast params) asks for the role instead of matching parameter
names itself, so the names live in one table, next to the model that declares them.

A path is a tuple of str keys or a jax KeyPath (as `tree_map_with_path` gives). The role is that
of the first key naming a parameter (the `PARAM_NAMES` table); keys after it belong to a weight
object standing in for the array (jaxmem.model.projection), e.g. an int8 weight's quantization
scale at ('layers', 'mlp', 'up_proj', .scale) has the role of up_proj. A path with no known
name raises ValueError naming it: a new parameter must be given a role here, not guessed.
"""

from __future__ import annotations

from collections import Counter

import jax

from jaxmem.paths import key_name as _key_name, path_text

ROLES = ("embedding", "norm", "q_proj", "k_proj", "v_proj", "o_proj",
         "gate_proj", "up_proj", "down_proj", "lm_head", "bias")

# Parameter name as jaxmem.families.decoder / layers declare it -> role.
PARAM_NAMES = {
    "embed_tokens": "embedding",
    "scale": "norm",  # RMSNorm's weight (input_layernorm, post_attention_layernorm, norm)
    "q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "o_proj": "o_proj",
    "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
    "lm_head": "lm_head",
    "q_bias": "bias", "k_bias": "bias", "v_bias": "bias",  # Qwen2's attention biases
}


def param_role(path) -> str:
    """The role (one of ROLES) of the parameter at `path`; ValueError for an unknown path."""
    for key in path:
        role = PARAM_NAMES.get(_key_name(key))
        if role is not None:
            return role
    raise ValueError(f"parameter {path_text(path) or '(root)'} has no role: none of its keys is a "
                     f"known parameter name ({', '.join(PARAM_NAMES)}); add it to "
                     f"jaxmem.model.roles.PARAM_NAMES")


def param_roles(params):
    """The tree of `params` with each leaf replaced by its role string."""
    return jax.tree_util.tree_map_with_path(lambda path, _: param_role(path), params)


def count_by_role(params) -> dict[str, int]:
    """Elements per role, over arrays or `jax.ShapeDtypeStruct`s (every role, zeros included)."""
    counts = Counter({role: 0 for role in ROLES})
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        counts[param_role(path)] += int(leaf.size)
    return dict(counts)
