"""Model families: what each architecture jaxmem reads adds to the shared decoder.

A family is registered by its config.json `model_type` and gives:

    architecture      config.json's "architectures" entry (what transformers instantiates)
    fields(d)         its ModelConfig fields beyond the shared ones (the decoder's variation
                      points, e.g. qk_norm), refusing by key what it cannot represent
    hf_keys(c)        the config.json keys it writes beyond the shared ones

The shared part of the mapping (shapes, RoPE, the refusals every family shares) is
jaxmem.io.hf's; the presets are jaxmem.config.model's. `for_hf(d)` picks the family of a
config.json and refuses, naming the key, a mixture of experts and a multimodal checkpoint.
"""

from __future__ import annotations

import json

from jaxmem.config.model import ConfigError
from jaxmem.families import llama, mistral, qwen2, qwen3  # noqa: F401  (they register themselves)
from jaxmem.families.base import FAMILIES, Family, refuse, register  # noqa: F401

# keys whose presence makes a config.json something jaxmem does not build
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
_MULTIMODAL_KEYS = ("vision_config", "audio_config")


def for_hf(d: dict) -> Family:
    """The family of a config.json dict; ConfigError naming the key it cannot build."""
    for key in _MOE_KEYS:
        if d.get(key):
            raise ConfigError(f"config.json: {key}={json.dumps(d[key])}: a mixture of experts "
                              f"({d.get('model_type', '?')}); jaxmem builds dense models")
    for key in _MULTIMODAL_KEYS:
        if d.get(key) is not None:
            raise ConfigError(f"config.json: {key} is set: a multimodal checkpoint "
                              f"({d.get('model_type', '?')}); jaxmem reads text decoders")
    model_type = d.get("model_type", "llama")
    if model_type not in FAMILIES:
        raise ConfigError(f"config.json: model_type={model_type!r} is not supported (families: "
                          f"{', '.join(FAMILIES)})")
    return FAMILIES[model_type]


def get(name: str) -> Family:
    """The registered family `name` (ModelConfig.family); ConfigError naming the known ones."""
    if name not in FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]
