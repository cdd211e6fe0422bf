"""Model families: what each architecture jaxmem reads adds to the shared decoder.

A family is registered by its config.json `model_type` and gives:

    architecture      config.json's "architectures" entry (what transformers instantiates)
    fields(d)         its ModelConfig fields beyond the shared ones (the decoder's variation
                      points, e.g. qk_norm), refusing by key what it cannot represent
    hf_keys(c)        the config.json keys it writes beyond the shared ones
    module(c, remat, einsum)  its Flax module: the shared Decoder (jaxmem.families.decoder), its
                      variation points read from ModelConfig; its parameters are made, shaped
                      and counted from it (jaxmem.families.params), never by a closed form
    tensor_specs(c)   its Hugging Face tensor table: the shared decoder's, or its own `tensors`
    text_config(d)    a multimodal config.json's text decoder keys, where the family reads one
                      (Gemma 3's Gemma3ForConditionalGeneration), and the tensor `prefixes`

    presets           its named ModelConfigs (published shapes); PRESETS / get_preset gather
                      every family's

ModelConfig (the fields) is jaxmem.families.config's. The shared part of the mapping (shapes,
RoPE, the refusals every family shares) is jaxmem.io.hf's. `for_hf(d)` picks the family of a
config.json and refuses, naming the key, a mixture of experts and a multimodal checkpoint.
"""

from __future__ import annotations

import json

from jaxmem.errors import ConfigError
# they register, in this order (the presets' order: Llama's byte-vocabulary `tiny` first)
from jaxmem.families import llama, qwen3, qwen2, mistral, gemma3, olmo2, phi3  # noqa: F401, I001
from jaxmem.families.base import FAMILIES, MODEL_TYPES, Family, refuse, register  # noqa: F401
from jaxmem.families.config import ModelConfig

# every family's presets, by name
PRESETS: dict[str, ModelConfig] = {name: config for family in FAMILIES.values()
                                   for name, config in family.presets.items()}

# keys whose presence makes a config.json something jaxmem does not build
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
_MULTIMODAL_KEYS = ("vision_config", "audio_config")


def text_decoder(d: dict) -> tuple[Family, dict, str | None]:
    """(family, the text decoder's config.json keys, a note of what was left out) of a
    config.json dict: a multimodal checkpoint its family reads (Gemma 3) gives its language
    model's keys and says the vision tower is left out; ConfigError naming the key otherwise."""
    family = MODEL_TYPES.get(d.get("model_type", "llama"))
    if family is not None and family.text_config is not None and d.get("model_type") != \
            family.hf_model_type:
        return family, family.text_config(d), (
            f"note: {d.get('architectures', [d['model_type']])[0]}: reading its language model; "
            f"the vision tower and projector are left out")
    return for_hf(d), d, None


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
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"config.json: model_type={model_type!r} is not supported (families: "
                          f"{', '.join(sorted(FAMILIES))})")
    return MODEL_TYPES[model_type]


def model(config, remat=None, einsum=None):
    """The Flax module of `config`'s family (its `module`, the shared Decoder by default),
    built with the remat policy and the einsum its projections multiply with."""
    from jaxmem.einsum import default_einsum  # noqa: PLC0415
    from jaxmem.model.remat import RematPolicy  # noqa: PLC0415

    return get(config.family).module(config, remat or RematPolicy(), einsum or default_einsum)


def get(name: str) -> Family:
    """The registered family `name` (ModelConfig.family); ConfigError naming the known ones."""
    if name not in FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; known: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


def architectures() -> str:
    """The checkpoints jaxmem reads, for help texts: every registered family's architecture."""
    return ", ".join(sorted(f.architecture for f in FAMILIES.values()))


def get_preset(name: str, **overrides) -> ModelConfig:
    """The named preset with field overrides (`None` overrides are ignored)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name].replace(**{k: v for k, v in overrides.items() if v is not None})
