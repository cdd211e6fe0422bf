"""Sampling from a Llama's params: one jitted `fori_loop` over a fixed-size token buffer.

Temperature 0 is greedy decoding; `top_k` samples among the K most likely tokens. No KV cache:
each new token reruns the model over the buffer, which is fine for the small models this is
meant to inspect.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.config.model import ModelConfig
from jaxmem.model.llama import Llama
from jaxmem.train.precision import cast_params


def sample_tokens(config: ModelConfig, params, prompt_ids, max_new_tokens: int,
                  temperature: float = 0.8, top_k: int = 0, seed: int = 0,
                  compute_dtype=jnp.float32) -> list[int]:
    """Prompt ids + up to `max_new_tokens` sampled ids (capped by max_position_embeddings)."""
    limit = config.max_position_embeddings
    prompt_ids = list(prompt_ids)[-max(1, limit - max_new_tokens):]
    n_prompt = len(prompt_ids)
    total = min(limit, n_prompt + max_new_tokens)
    buf = jnp.zeros((1, total), jnp.int32).at[0, :n_prompt].set(jnp.asarray(prompt_ids, jnp.int32))
    model = Llama(config)
    params = cast_params(params, compute_dtype)

    @jax.jit
    def run(params, buf, key):
        def body(pos, carry):
            buf, key = carry
            logits = model.apply({"params": params}, buf)[0, pos - 1]  # [V] fp32
            key, sub = jax.random.split(key)
            if temperature <= 0:
                nxt = jnp.argmax(logits)
            else:
                logits = logits / temperature
                if top_k:
                    kth = jax.lax.top_k(logits, top_k)[0][-1]
                    logits = jnp.where(logits < kth, -jnp.inf, logits)
                nxt = jax.random.categorical(sub, logits)
            return buf.at[0, pos].set(nxt.astype(jnp.int32)), key

        return jax.lax.fori_loop(n_prompt, total, body, (buf, key))[0]

    return [int(t) for t in np.asarray(run(params, buf, jax.random.PRNGKey(seed)))[0]]


def generate_text(config, params, tokenizer, prompt: str, max_new_tokens: int = 200,
                  temperature: float = 0.8, top_k: int = 40, seed: int = 0,
                  compute_dtype=jnp.float32) -> str:
    ids = tokenizer.encode_prompt(prompt)  # BOS, or the special tokens a post-processor adds
    out = sample_tokens(config, params, ids, max_new_tokens, temperature,
                        min(top_k, config.vocab_size), seed, compute_dtype)
    return tokenizer.decode(out)
