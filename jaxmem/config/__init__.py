"""Configuration: the model's shape (`ModelConfig`, presets) and the whole run (`RunConfig`).

    jaxmem.config.model   ModelConfig, PRESETS, get_preset, byte-tokenizer ids, ConfigError
    jaxmem.config.run     RunConfig and its sections, config.json schema (to_dict / from_dict)
    jaxmem.config.flags   CLI flags generated from RunConfig's field metadata
"""

from jaxmem.config.model import PRESETS, ConfigError, ModelConfig, get_preset
from jaxmem.config.run import (SCHEMA_VERSION, DataSection, ModelSection, OptimConfig,
                               PrecisionSection, RematSection, RunConfig, RunSection, SampleSection)

__all__ = ["ConfigError", "DataSection", "ModelConfig", "ModelSection", "OptimConfig", "PRESETS",
           "PrecisionSection", "RematSection", "RunConfig", "RunSection", "SCHEMA_VERSION",
           "SampleSection", "get_preset"]
