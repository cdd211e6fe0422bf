"""Configuration: the model's shape (`ModelConfig`, presets) and the whole run (`RunConfig`).

    (ModelConfig is jaxmem.families.config's, the presets each family's, ConfigError
    jaxmem.errors'; all re-exported here)
    jaxmem.config.run     RunConfig and its sections, config.json schema (to_dict / from_dict)
    jaxmem.config.flags   CLI flags generated from RunConfig's field metadata
"""

from jaxmem.errors import ConfigError
from jaxmem.families import PRESETS, get_preset
from jaxmem.families.config import ModelConfig
from jaxmem.config.run import (SCHEMA_VERSION, DataSection, ModelSection, OptimConfig,
                               PrecisionSection, RematSection, RunConfig, RunSection, SampleSection)

__all__ = ["ConfigError", "DataSection", "ModelConfig", "ModelSection", "OptimConfig", "PRESETS",
           "PrecisionSection", "RematSection", "RunConfig", "RunSection", "SCHEMA_VERSION",
           "SampleSection", "get_preset"]
