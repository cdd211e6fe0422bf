"""The projections LoRA can target, by short name: what `--lora-targets` accepts.

The short names are configuration (RunConfig validates them when a run is configured); which
parameter each one is belongs to the decoder (jaxmem.families.names.PROJECTIONS), and the
adapters themselves are jaxmem.peft.lora.
"""

from __future__ import annotations

from jaxmem.errors import ConfigError

# --lora-targets short names: a block's attention and MLP projections
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
ALL_TARGETS = ",".join(TARGETS)


def parse_targets(text: str) -> tuple[str, ...]:
    """'q,v' -> ('q', 'v'); ConfigError naming an unknown projection."""
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    for name in names:
        if name not in TARGETS:
            raise ConfigError(f"--lora-targets: unknown projection {name!r}; choose from "
                              f"{ALL_TARGETS}")
    if not names:
        raise ConfigError("--lora-targets names no projection")
    return names
