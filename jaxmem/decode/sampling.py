"""Sampling from a model's params with a KV cache: the prompts are prefilled in one call, then
one token per step against the cache, in one jitted `while_loop`.

    generate_ids(config, params, prompts, max_new_tokens, ...)  new ids per prompt (a batch)
    sample_tokens(config, params, prompt_ids, max_new_tokens, ...)  prompt + new ids (one)
    generate_text(config, params, tokenizer, prompt, ...)        the text, stop strings applied
    lower_sample(config, params, n_prompt, total, *, compute_dtype, ...)  the sampler, lowered
        for batch 1 (params may be `jax.ShapeDtypeStruct`s): what the memory planner compiles
    sample_tokens_uncached(...)  the old path: the whole buffer through the model for every new
        token (the tests' reference; 30x slower)

The cache is (k, v), each [L, B, S, K, H] (S = prompt + new tokens, K kv heads: GQA-shaped,
nothing repeated per query head) in the compute dtype; prompts of a batch are left-padded, each
row's RoPE positions count its own tokens from 0, padded slots are masked out of every key.
Only the last position's logits are ever computed ([B, V]; the prefill included), so the
end-of-run sample holds no [B, T, V] logits. Generation stops at the last position, or when every
row has produced one of `eos_ids`; tokens after a row's EOS are dropped.
Temperature 0 is greedy decoding; `top_k` samples among the K most likely tokens.

    python -m jaxmem.generate.bench    # small preset, 16 + 256 tokens: cached vs uncached tok/s
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.families.config import ModelConfig
from jaxmem import families
from jaxmem.model.precision import cast_params


def init_cache(config: ModelConfig, batch: int, length: int, dtype):
    """Zero (k, v) caches, each [L, B, S, K, H] in `dtype`.

    A model with sliding-window layers gets {"full": (k, v) [Lf, B, S, K, H], "local": (k, v)
    [Ll, B, R, K, H]} (the kinds it has): a local layer keeps a ring of R = min(W, S) slots,
    never the whole sequence."""
    K, H = config.num_kv_heads, config.resolved_head_dim
    kinds = config.local_layers
    if not any(kinds):
        shape = (config.num_layers, batch, length, K, H)
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    sizes = {"full": (kinds.count(False), length),
             "local": (kinds.count(True), min(config.sliding_window, length))}
    return {kind: (jnp.zeros((n, batch, s, K, H), dtype),) * 2
            for kind, (n, s) in sizes.items() if n}


def _pick(logits, key, temperature: float, top_k: int):
    """Next token per row from fp32 logits [B, V]."""
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]  # [B, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1)


@functools.lru_cache(maxsize=32)
def _sampler(config: ModelConfig, n_prompt: int, total: int, temperature: float, top_k: int,
             eos_ids: tuple, dtype_name: str):
    """The jitted sampler: (params, prompts [B, P], valid [B, P], key) -> (new ids [B, total-P],
    steps taken). Compiled once per shape and settings (lru_cache keeps the jit object)."""
    model = families.model(config)
    dtype = jnp.dtype(dtype_name)
    n_new = total - n_prompt
    eos = np.asarray(eos_ids or (-1,), np.int32)  # numpy: building the sampler runs no jax op

    def run(params, prompts, valid, key):
        params = cast_params(params, dtype)  # a no-op where they are stored in it already
        B = prompts.shape[0]
        cache = init_cache(config, B, total, dtype)
        kv_valid = jnp.zeros((B, total), bool).at[:, :n_prompt].set(valid)  # [B, S]
        # left padding: each row's first real token is at position 0
        positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)  # [B, P]
        logits, cache = model.apply({"params": params}, prompts, positions=positions, cache=cache,
                                    cache_index=0, kv_valid=kv_valid)  # [B, V]
        next_pos = positions[:, -1] + 1  # [B]

        def cond(c):
            return (c[0] < n_new) & ~jnp.all(c[5])

        def body(c):
            i, cache, kv_valid, logits, out, done, key = c
            key, sub = jax.random.split(key)
            tok = _pick(logits, sub, temperature, top_k).astype(jnp.int32)  # [B]
            out = jax.lax.dynamic_update_slice_in_dim(out, tok[:, None], i, axis=1)
            done = done | jnp.any(tok[:, None] == eos[None], axis=1)
            kv_valid = jax.lax.dynamic_update_slice_in_dim(
                kv_valid, jnp.ones((B, 1), bool), n_prompt + i, axis=1)
            # (the last step's forward is not needed; a lax.cond to skip it would copy the cache)
            logits, cache = model.apply({"params": params}, tok[:, None],
                                        positions=(next_pos + i)[:, None], cache=cache,
                                        cache_index=n_prompt + i, kv_valid=kv_valid)
            return i + 1, cache, kv_valid, logits, out, done, key

        init = (jnp.zeros((), jnp.int32), cache, kv_valid, logits,
                jnp.zeros((B, n_new), jnp.int32), jnp.zeros((B,), bool), key)
        c = jax.lax.while_loop(cond, body, init)
        return c[4], c[0]

    return jax.jit(run)


def lower_sample(config: ModelConfig, params, n_prompt: int, total: int, *, compute_dtype,
                 temperature: float = 0.0, top_k: int = 0, lower=None) -> jax.stages.Lowered:
    """The sampler for one prompt of `n_prompt` ids grown to `total`, lowered (not run): for the
    memory planner, which compiles it and reads `memory_analysis()`. params: arrays or
    `jax.ShapeDtypeStruct`s (as stored; the cast to compute_dtype happens inside); lower:
    lower(jitted, *args), default `jitted.lower(*args)` (jaxmem.target.lower for params in host
    memory)."""
    fn = _sampler(config, n_prompt, total, float(temperature), int(top_k), (),
                  jnp.dtype(compute_dtype).name)
    ids = jax.ShapeDtypeStruct((1, n_prompt), jnp.int32)
    valid = jax.ShapeDtypeStruct((1, n_prompt), jnp.bool_)
    args = (params, ids, valid, jax.eval_shape(lambda: jax.random.PRNGKey(0)))
    return lower(fn, *args) if lower is not None else fn.lower(*args)


def new_token_budget(n_prompt: int, max_new_tokens: int, limit: int) -> int:
    """How many new tokens fit after a prompt of `n_prompt` ids in `limit` positions."""
    if n_prompt >= limit:
        raise ValueError(f"the prompt is {n_prompt} tokens (BOS included) but the model has "
                         f"{limit} positions: shorten it to at most {limit - 1} tokens")
    return min(max_new_tokens, limit - n_prompt)


def generate_ids(config: ModelConfig, params, prompts, max_new_tokens: int,
                 temperature: float = 0.8, top_k: int = 0, seed: int = 0,
                 compute_dtype=jnp.float32, eos_ids=(), stats: dict | None = None
                 ) -> list[list[int]]:
    """New ids for each prompt (lists of ids) of one batch, each cut after its first EOS.

    stats: a dict that gets `compile_s` and `run_s` added (the sampler is compiled ahead of
        time, once per jitted function and argument shapes).

    The longest prompt sets the batch's budget: a prompt leaving no room within the model's
    positions raises ValueError (`new_token_budget`); the others are left-padded to it.
    """
    prompts = [list(p) for p in prompts]
    n_prompt = max(len(p) for p in prompts)
    total = n_prompt + new_token_budget(n_prompt, max_new_tokens, config.max_position_embeddings)
    ids = np.zeros((len(prompts), n_prompt), np.int32)
    valid = np.zeros((len(prompts), n_prompt), bool)
    for r, p in enumerate(prompts):
        ids[r, n_prompt - len(p):], valid[r, n_prompt - len(p):] = p, True
    fn = _sampler(config, n_prompt, total, float(temperature), int(top_k),
                  tuple(sorted(int(e) for e in eos_ids)), jnp.dtype(compute_dtype).name)
    args = (params, jnp.asarray(ids), jnp.asarray(valid), jax.random.PRNGKey(seed))
    t0 = time.perf_counter()
    compiled = _compiled(fn, args)
    t1 = time.perf_counter()
    out, steps = compiled(*args)
    out = np.asarray(out)[:, :int(steps)]
    if stats is not None:  # compile and run times, for the tokens/s line
        stats["compile_s"] = stats.get("compile_s", 0.0) + t1 - t0
        stats["run_s"] = stats.get("run_s", 0.0) + time.perf_counter() - t1
    result = []
    for row in out.tolist():
        ends = [i for i, t in enumerate(row) if t in set(eos_ids)]
        result.append(row[:ends[0] + 1] if ends else row)
    return result


_COMPILED: dict = {}


def _compiled(fn, args):
    """fn compiled for args' shapes and dtypes (kept: a batch of the same shapes reuses it)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    key = (fn, tree, tuple((x.shape, str(x.dtype)) for x in leaves))
    if key not in _COMPILED:
        if len(_COMPILED) > 16:
            _COMPILED.clear()
        _COMPILED[key] = fn.lower(*args).compile()
    return _COMPILED[key]


def sample_tokens(config: ModelConfig, params, prompt_ids, max_new_tokens: int,
                  temperature: float = 0.8, top_k: int = 0, seed: int = 0,
                  compute_dtype=jnp.float32, eos_ids=()) -> list[int]:
    """Prompt ids + up to `max_new_tokens` sampled ids (KV cache).

    The prompt is never cut: one that leaves no room for a new token within the model's
    positions (max_position_embeddings) raises ValueError; otherwise the new tokens stop at the
    last position (`new_token_budget` says how many fit).
    """
    prompt_ids = list(prompt_ids)
    return prompt_ids + generate_ids(config, params, [prompt_ids], max_new_tokens, temperature,
                                     top_k, seed, compute_dtype, eos_ids)[0]


def sample_tokens_uncached(config: ModelConfig, params, prompt_ids, max_new_tokens: int,
                           temperature: float = 0.8, top_k: int = 0, seed: int = 0,
                           compute_dtype=jnp.float32) -> list[int]:
    """The sampler before the KV cache: a fixed-size buffer, the whole of it through the model
    for every new token. Kept as the reference the cached path is tested against."""
    prompt_ids = list(prompt_ids)
    n_prompt = len(prompt_ids)
    total = n_prompt + new_token_budget(n_prompt, max_new_tokens, config.max_position_embeddings)
    buf = jnp.zeros((1, total), jnp.int32).at[0, :n_prompt].set(jnp.asarray(prompt_ids, jnp.int32))
    run = uncached_sampler(config, n_prompt, total, float(temperature), int(top_k))
    out = run(cast_params(params, compute_dtype), buf, jax.random.PRNGKey(seed))
    return [int(t) for t in np.asarray(out)[0]]


@functools.lru_cache(maxsize=8)
def uncached_sampler(config: ModelConfig, n_prompt: int, total: int, temperature: float,
                     top_k: int):
    """The old jitted loop: (params, buf [1, total], key) -> buf filled from n_prompt on."""
    model = families.model(config)

    def run(params, buf, key):
        def body(pos, carry):
            buf, key = carry
            logits = model.apply({"params": params}, buf)[:, pos - 1]  # [1, V] fp32
            key, sub = jax.random.split(key)
            nxt = _pick(logits, sub, temperature, top_k)[0]
            return buf.at[0, pos].set(nxt.astype(jnp.int32)), key

        return jax.lax.fori_loop(n_prompt, total, body, (buf, key))[0]

    return jax.jit(run)


def cut_at_stop(text: str, stops) -> tuple[str, bool]:
    """`text` up to (not including) the first of the stop strings; whether one was found."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


def generate_text(config, params, tokenizer, prompt: str, max_new_tokens: int = 200,
                  temperature: float = 0.8, top_k: int = 40, seed: int = 0,
                  compute_dtype=jnp.float32, note=None, eos_ids=None, stop=()) -> str:
    """The prompt and its continuation as text, ended at an EOS id (default: the tokenizer's
    stop ids, jaxmem.decode.stopping.eos_ids) or before a stop string. `note(msg)` is told when
    the model's context (max_position_embeddings) shortens the output below `max_new_tokens`."""
    ids = tokenizer.encode_prompt(prompt or "")  # BOS, or the special tokens a post-processor adds
    budget = new_token_budget(len(ids), max_new_tokens, config.max_position_embeddings)
    if budget < max_new_tokens and note is not None:
        note(f"note: output shortened to {budget} new tokens (asked {max_new_tokens}): the "
             f"prompt's {len(ids)} tokens + the new ones fill the model's "
             f"{config.max_position_embeddings} positions")
    if eos_ids is None:
        from jaxmem.decode.stopping import eos_ids as stop_ids  # noqa: PLC0415
        eos = stop_ids(tokenizer)
    else:
        eos = tuple(eos_ids)
    new = generate_ids(config, params, [ids], max_new_tokens, temperature,
                       min(top_k, config.vocab_size), seed, compute_dtype, eos)[0]
    return complete_text(tokenizer, ids, new, stop)[0]


def complete_text(tokenizer, prompt_ids, new_ids, stop=()) -> tuple[str, str, bool]:
    """(prompt + continuation, the continuation, whether a stop string ended it): the
    continuation is cut before the first stop string (never searched for in the prompt)."""
    head, text = tokenizer.decode(prompt_ids), tokenizer.decode(list(prompt_ids) + list(new_ids))
    tail = text[len(head):] if text.startswith(head) else tokenizer.decode(new_ids)
    tail, stopped = cut_at_stop(tail, stop)
    return head + tail, tail, stopped
