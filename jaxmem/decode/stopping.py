"""What ends generation and what it computes in: EOS ids, stop strings, the sampling dtype.

    eos_ids(tokenizer, hf_dir)   the tokenizer's EOS plus every `eos_token_id` of the checkpoint's
                                 config.json and generation_config.json (Llama 3 Instruct lists
                                 <|end_of_text|>, <|eom_id|> and <|eot_id|> there)
    sample_dtype(given, run)     --dtype, else bf16 on a GPU (fp16 for an fp16 run), else the
                                 run's compute dtype
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp

from jaxmem import target

GENERATION_CONFIG = "generation_config.json"
DTYPES = ("float32", "bfloat16", "float16")


def _ids(value) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def eos_ids(tokenizer, hf_dir=None) -> tuple[int, ...]:
    """Sorted EOS ids: the tokenizer's, and those of hf_dir's config.json and
    generation_config.json where present (unreadable files raise ValueError naming them)."""
    ids = set(_ids(getattr(tokenizer, "eos_id", None)))
    if hf_dir is not None:
        for name in ("config.json", GENERATION_CONFIG):
            path = Path(hf_dir) / name
            if not path.is_file():
                continue
            try:
                d = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}: unreadable ({e})") from None
            ids.update(_ids(d.get("eos_token_id")) if isinstance(d, dict) else ())
    return tuple(sorted(ids))


def sample_dtype(given: str | None, run_dtype=jnp.float32):
    """The dtype generation computes in and keeps its KV cache in."""
    if given is not None:
        return jnp.dtype(given)
    run_dtype = jnp.dtype(run_dtype)
    if target.platform() == "gpu":  # JAX's backend, or a --target card
        return run_dtype if run_dtype == jnp.float16 else jnp.dtype(jnp.bfloat16)
    return run_dtype  # the CPU emulates bf16: a bf16 run samples as it trained, fp32 stays fp32
