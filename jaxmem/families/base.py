"""The family record and its registry (jaxmem.families reads them; each family module
registers itself here)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

from jaxmem.errors import ConfigError
from jaxmem.families.config import ModelConfig


@dataclass(frozen=True)
class Family:
    name: str
    architecture: str
    fields: Callable[[dict], dict]
    hf_keys: Callable[[ModelConfig], dict]
    model_type: str = ""  # config.json's model_type when it is not `name`
    # config.json's model_types read as this family besides model_type (a wrapper's, e.g.
    # Gemma 3's multimodal "gemma3"), and how to get the text decoder's keys out of one
    text_config: Callable[[dict], dict] | None = None
    reads: tuple[str, ...] = ()
    # where the decoder's tensors may sit in the checkpoint, first match wins ("model." is the
    # causal LM's; a multimodal checkpoint nests the language model)
    prefixes: tuple[str, ...] = ("model.",)
    # its HF tensor table (config) -> [TensorSpec]; None: the shared decoder's
    tensors: Callable | None = None
    # its named presets (name -> ModelConfig), published shapes
    presets: dict = field(default_factory=dict)
    # what one block keeps for its backward (config, B, T, compute dtype, remat, attention
    # path) -> [(what, bytes, dtype)]; None: the shared decoder's
    # (jaxmem.families.residuals.decoder_residuals)
    residuals: Callable | None = None

    def tensor_specs(self, config: ModelConfig) -> list:
        from jaxmem.families.names import decoder_tensors  # noqa: PLC0415

        return (self.tensors or decoder_tensors)(config)

    def block_residuals(self, config: ModelConfig, B: int, T: int, compute_dtype, remat,
                        attention: str = "xla") -> list:
        """[(what, bytes, dtype)] one block of `config` keeps for its backward at B x T tokens
        under `remat` (the planner's per-layer activations)."""
        from jaxmem.families.residuals import decoder_residuals  # noqa: PLC0415

        return (self.residuals or decoder_residuals)(config, B, T, compute_dtype, remat,
                                                     attention)

    def module(self, config: ModelConfig, remat, einsum):
        from jaxmem.families.decoder import Decoder  # noqa: PLC0415  (flax, on first use)

        return Decoder(config, remat, einsum)

    @property
    def hf_model_type(self) -> str:
        return self.model_type or self.name


FAMILIES: dict[str, Family] = {}
MODEL_TYPES: dict[str, Family] = {}  # config.json model_type -> family


def register(family: Family) -> Family:
    FAMILIES[family.name] = family
    for model_type in (family.hf_model_type, *family.reads):
        MODEL_TYPES[model_type] = family
    return family


def refuse(d: dict, key: str, ok, what: str) -> None:
    """ConfigError naming `key` when config.json sets it to a value `ok` rejects."""
    if key in d and d[key] is not None and not ok(d[key]):
        raise ConfigError(f"config.json: {key}={json.dumps(d[key])} is not supported ({what})")


def full_attention_only(d: dict, family: str) -> None:
    """Refuse a sliding window that config.json turns on (Qwen's checkpoints name one and leave
    it off: `use_sliding_window: false`)."""
    refuse(d, "use_sliding_window", lambda v: v is False,
           f"sliding-window attention is not built for {family}")
    refuse(d, "layer_types", lambda v: set(v) <= {"full_attention"},
           "every layer full attention only")


def window_off(c: ModelConfig) -> dict:
    """config.json keys of a Qwen checkpoint with its sliding window off."""
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": c.num_layers}
