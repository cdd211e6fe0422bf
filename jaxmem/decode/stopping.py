"""What ends generation and what it computes in: EOS ids, stop strings, the sampling dtype.

    eos_ids(tokenizer)           the ids its checkpoint stops at, as transformers' generate: its
                                 generation_config.json's eos_token_id (Llama 3.1 Instruct lists
                                 <|end_of_text|>, <|eom_id|> and <|eot_id|> there), else its
                                 config.json's, else the tokenizer's EOS
    sample_dtype(given, run)     --dtype, else bf16 on a GPU (fp16 for an fp16 run), else the
                                 run's compute dtype
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxmem import target

DTYPES = ("float32", "bfloat16", "float16")


def eos_ids(tokenizer) -> tuple[int, ...]:
    """Sorted ids generation stops at: the tokenizer's `stop_ids` (its checkpoint's
    generation_config.json eos_token_id, else config.json's, else its EOS:
    jaxmem.data.special_tokens), else its EOS."""
    stops = getattr(tokenizer, "stop_ids", None) or (tokenizer.eos_id,)
    return tuple(sorted(set(int(i) for i in stops)))


def sample_dtype(given: str | None, run_dtype=jnp.float32):
    """The dtype generation computes in and keeps its KV cache in."""
    if given is not None:
        return jnp.dtype(given)
    run_dtype = jnp.dtype(run_dtype)
    if target.platform() == "gpu":  # JAX's backend, or a --target card
        return run_dtype if run_dtype == jnp.float16 else jnp.dtype(jnp.bfloat16)
    return run_dtype  # the CPU emulates bf16: a bf16 run samples as it trained, fp32 stays fp32
