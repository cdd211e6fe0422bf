"""The projections LoRA can target, by short name: what `--lora-targets` accepts.

The names are configuration (RunConfig validates them when a run is configured); the adapters
themselves are jaxmem.peft.lora, which imports these.
"""

from __future__ import annotations

from jaxmem.config.model import ConfigError

# --lora-targets short name -> (group in a decoder block, parameter name = role)
TARGETS = {"q": ("self_attn", "q_proj"), "k": ("self_attn", "k_proj"),
           "v": ("self_attn", "v_proj"), "o": ("self_attn", "o_proj"),
           "gate": ("mlp", "gate_proj"), "up": ("mlp", "up_proj"), "down": ("mlp", "down_proj")}
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
