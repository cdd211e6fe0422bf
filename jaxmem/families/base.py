"""The family record and its registry (jaxmem.families reads them; each family module
registers itself here)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from jaxmem.config.model import ConfigError, ModelConfig


@dataclass(frozen=True)
class Family:
    name: str
    architecture: str
    fields: Callable[[dict], dict]
    hf_keys: Callable[[ModelConfig], dict]


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    FAMILIES[family.name] = family
    return family


def refuse(d: dict, key: str, ok, what: str) -> None:
    """ConfigError naming `key` when config.json sets it to a value `ok` rejects."""
    if key in d and d[key] is not None and not ok(d[key]):
        raise ConfigError(f"config.json: {key}={json.dumps(d[key])} is not supported ({what})")
