"""Generation with a KV cache (jaxmem.decode.sampling) against the old sampler, which runs the
whole buffer through the model for every token (`sample_tokens_uncached`, the reference).

    python -m pytest -q tests/test_kvcache.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.families.config import ModelConfig
from jaxmem.decode.sampling import (generate_ids, init_cache, lower_sample, sample_tokens,
                                      sample_tokens_uncached, uncached_sampler)
from jaxmem.families.decoder import Decoder
from jaxmem.families.params import abstract_params

PROMPTS = ([3, 17, 9, 40, 2], [5, 6], [7, 1, 8, 2, 9, 30, 31, 12])


def config(tied: bool) -> ModelConfig:
    return ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, max_position_embeddings=48,
                       tie_embeddings=tied)


def init(cfg):
    return Decoder(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.slow  # 3.2 s cold on 2 cores (default run kept under 5 min)
def test_greedy_with_the_cache_equals_the_old_path_token_for_token(tied):
    cfg = config(tied)
    params = init(cfg)
    with jax.default_matmul_precision("highest"):
        want = sample_tokens_uncached(cfg, params, PROMPTS[0], 16, temperature=0.0)
        got = sample_tokens(cfg, params, PROMPTS[0], 16, temperature=0.0)
    assert len(got) == len(PROMPTS[0]) + 16 and len(set(got[5:])) > 3  # not one token repeated
    assert got == want


def test_sampling_with_the_cache_draws_what_the_old_path_draws():
    """Same seed, same keys per step: top-k sampling at temperature 1 gives the same tokens."""
    cfg = config(True)
    params = init(cfg)
    with jax.default_matmul_precision("highest"):
        want = sample_tokens_uncached(cfg, params, PROMPTS[0], 16, temperature=1.0, top_k=5,
                                      seed=3)
        got = sample_tokens(cfg, params, PROMPTS[0], 16, temperature=1.0, top_k=5, seed=3)
    assert got == want


@pytest.mark.slow  # 3.7 s cold on 2 cores (default run kept under 5 min)
def test_a_left_padded_batch_equals_each_prompt_alone():
    """Prompts of 5, 2 and 8 tokens in one batch (left-padded, per-row positions) give each
    prompt's own greedy continuation."""
    cfg = config(False)
    params = init(cfg)
    with jax.default_matmul_precision("highest"):
        batch = generate_ids(cfg, params, PROMPTS, 8, temperature=0.0)
        alone = [generate_ids(cfg, params, [p], 8, temperature=0.0)[0] for p in PROMPTS]
    assert batch == alone and all(len(r) == 8 for r in batch)


def test_generation_stops_at_eos_and_cuts_each_row_after_its_first():
    cfg = config(False)
    params = init(cfg)
    with jax.default_matmul_precision("highest"):
        free = generate_ids(cfg, params, PROMPTS[:2], 12, temperature=0.0)
        eos = free[0][3]  # the 4th token row 0 produces, and its first
        assert free[0].index(eos) == 3
        first = {r: row.index(eos) if eos in row else None for r, row in enumerate(free)}
        stats = {}
        cut = generate_ids(cfg, params, PROMPTS[:2], 12, temperature=0.0, eos_ids=(eos, 60),
                           stats=stats)
    for r, row in enumerate(free):
        want = row if first[r] is None else row[:first[r] + 1]
        assert cut[r] == want
    assert cut[0][-1] == eos and len(cut[0]) == first[0] + 1 <= 4
    assert stats["run_s"] > 0 and stats["compile_s"] > 0
    # one row only: the loop itself ends at the EOS (steps taken == tokens kept)
    with jax.default_matmul_precision("highest"):
        assert generate_ids(cfg, params, PROMPTS[:1], 12, temperature=0.0,
                            eos_ids=(eos,)) == [free[0][:4]]


def test_cache_is_gqa_shaped_in_the_compute_dtype_and_no_full_logits():
    """The cache holds K kv heads in the compute dtype; the lowered sampler never makes the
    [1, total, V] logits the old sampler made every step (params abstract: nothing allocated)."""
    cfg = config(False)
    k, v = init_cache(cfg, 3, 20, jnp.bfloat16)
    assert k.shape == v.shape == (2, 3, 20, cfg.num_kv_heads, cfg.resolved_head_dim)
    assert k.dtype == jnp.bfloat16
    params = abstract_params(cfg)
    lowered = lower_sample(cfg, params, 5, 29, compute_dtype=jnp.bfloat16)
    text = lowered.as_text()
    assert "tensor<2x1x29x2x8xbf16>" in text  # the cache, layers stacked: [L, B, S, K, H]
    assert "1x29x61xf32" not in text and "tensor<1x1x61xf32>" in text  # last position only
    old = uncached_sampler(cfg, 5, 29, 0.0, 0).lower(
        params, jax.ShapeDtypeStruct((1, 29), jnp.int32),
        jax.eval_shape(lambda: jax.random.PRNGKey(0))).as_text()
    assert "tensor<1x29x61xf32>" in old  # the negative control: the old path's full logits
    compiled = lowered.compile()
    assert compiled.memory_analysis() is not None


def test_bf16_prefill_logits_are_the_fp32_models_within_bf16_rounding():
    """The prefill through a bf16 cache gives the last position's logits of the plain fp32
    model within bf16 rounding, and hands back a bf16 cache (CPU numerics, not a GPU number)."""
    from jaxmem.model.precision import cast_params

    cfg = config(False)
    params = init(cfg)
    prompt = jnp.asarray([PROMPTS[2]])  # [1, 8]
    with jax.default_matmul_precision("highest"):
        want = Decoder(cfg).apply({"params": params}, prompt)[:, -1]  # [1, V]
        got, (k, v) = Decoder(cfg).apply(
            {"params": cast_params(params, jnp.bfloat16)}, prompt, positions=jnp.arange(8)[None],
            cache=init_cache(cfg, 1, 12, jnp.bfloat16), cache_index=0,
            kv_valid=jnp.arange(12)[None] < 8)
    assert got.dtype == jnp.float32 and k.dtype == v.dtype == jnp.bfloat16
    assert np.abs(np.asarray(k[:, :, 8:], np.float32)).max() == 0  # slots past the prompt
    np.testing.assert_allclose(got, want, rtol=0, atol=0.05 * float(np.abs(want).max()))
    assert float(np.abs(got - want).max()) > 0  # it did compute in bf16
