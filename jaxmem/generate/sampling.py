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
    """Prompt ids + up to `max_new_tokens` sampled ids.

    The prompt is never cut: one that leaves no room for a new token within the model's
    positions (max_position_embeddings) raises ValueError; otherwise the new tokens stop at the
    last position (`new_token_budget` says how many fit).
    """
    limit = config.max_position_embeddings
    prompt_ids = list(prompt_ids)
    n_prompt = len(prompt_ids)
    total = n_prompt + new_token_budget(n_prompt, max_new_tokens, limit)
    buf = jnp.zeros((1, total), jnp.int32).at[0, :n_prompt].set(jnp.asarray(prompt_ids, jnp.int32))
    params = cast_params(params, compute_dtype)
    run = _sampler(config, n_prompt, total, temperature, top_k)
    return [int(t) for t in np.asarray(run(params, buf, jax.random.PRNGKey(seed)))[0]]


def _sampler(config: ModelConfig, n_prompt: int, total: int, temperature: float, top_k: int):
    """jit(params, buf [1, total] int32, key) -> buf with positions n_prompt.. filled."""
    model = Llama(config)

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

    return run


def lower_sample(config: ModelConfig, params, n_prompt: int, total: int, *, compute_dtype,
                 temperature: float = 0.0, top_k: int = 0) -> jax.stages.Lowered:
    """The sampler `sample_tokens` runs for a prompt of `n_prompt` ids and `total` positions,
    lowered (not run) for its params cast to `compute_dtype`; params may be abstract
    (jax.ShapeDtypeStruct). `.compile().memory_analysis()` is what the sample holds
    (jaxmem.memory.phases plans the end-of-run sample with it)."""
    # cast_params on shapes: the dtypes sample_tokens' cast gives, nothing allocated
    params = jax.eval_shape(lambda p: cast_params(p, compute_dtype), params)
    buf = jax.ShapeDtypeStruct((1, total), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    return _sampler(config, n_prompt, total, temperature, top_k).lower(params, buf, key)


def new_token_budget(n_prompt: int, max_new_tokens: int, limit: int) -> int:
    """How many new tokens fit after a prompt of `n_prompt` ids in `limit` positions."""
    if n_prompt >= limit:
        raise ValueError(f"the prompt is {n_prompt} tokens (BOS included) but the model has "
                         f"{limit} positions: shorten it to at most {limit - 1} tokens")
    return min(max_new_tokens, limit - n_prompt)


def generate_text(config, params, tokenizer, prompt: str, max_new_tokens: int = 200,
                  temperature: float = 0.8, top_k: int = 40, seed: int = 0,
                  compute_dtype=jnp.float32, note=None) -> str:
    """The prompt and its continuation as text. `note(msg)` is told when the model's context
    (max_position_embeddings) shortens the output below `max_new_tokens`."""
    ids = tokenizer.encode_prompt(prompt or "")  # BOS, or the special tokens a post-processor adds
    budget = new_token_budget(len(ids), max_new_tokens, config.max_position_embeddings)
    if budget < max_new_tokens and note is not None:
        note(f"note: output shortened to {budget} new tokens (asked {max_new_tokens}): the "
             f"prompt's {len(ids)} tokens + the new ones fill the model's "
             f"{config.max_position_embeddings} positions")
    out = sample_tokens(config, params, ids, max_new_tokens, temperature,
                        min(top_k, config.vocab_size), seed, compute_dtype)
    return tokenizer.decode(out)
