"""Gemma 3's sliding window in the whole train step: the compiled step's temporaries grow
linearly in the sequence length (XLA:CPU's memory_analysis), at T = 8 x the window and 2T.

The local layers take the windowed path (jaxmem.model.window: query chunks over their window's
keys); the global layer the query-chunked full attention, whose chunk budget is shrunk here so
that a tiny model chunks as a large one does (at these sizes its [T, T] probabilities would
otherwise be one chunk: quadratic, 4x at 2T)."""

import jax
import pytest

from jaxmem.families import get_preset
from jaxmem.model import attention
from jaxmem.model.precision import get_precision
from jaxmem.model.remat import RematPolicy
from jaxmem.train.loss import synthetic_batch
from jaxmem.train.optim import OptimConfig
from jaxmem.train.step import StepConfig, create_train_state, make_train_step

W = 128
GEMMA3 = get_preset(
    "tiny", family="gemma3", qk_norm=True, norm_plus_one=True, norm_placement="sandwich",
    mlp_activation="gelu_tanh", embed_scale=True, query_pre_attn_scalar=24, sliding_window=W,
    rope_local_theta=500.0, rope_type="linear", rope_factor=2.0, tie_embeddings=True,
    max_position_embeddings=4096,
    layer_types=("sliding_attention",) * 3 + ("full_attention",))


def step_temp(T: int, remat: str, model=GEMMA3) -> int:
    cfg = StepConfig(model, get_precision("fp32"), RematPolicy(remat), OptimConfig(clip=0.0))
    state = jax.eval_shape(lambda: create_train_state(cfg, seed=0))
    batch = jax.eval_shape(lambda: jax.tree.map(
        lambda x: x[None], synthetic_batch(jax.random.PRNGKey(0), 1, T, model.vocab_size)))
    compiled = jax.jit(make_train_step(cfg)).lower(state, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("remat", ["full", "none"])
def test_the_step_temp_is_linear_in_the_sequence(monkeypatch, remat):
    T = 8 * W
    # the global layer's chunk: 16 query rows of [B, N, Tq, T] fp32 at T
    monkeypatch.setattr(attention, "ATTENTION_CHUNK_BYTES", GEMMA3.num_heads * 16 * T * 4)
    small, big = step_temp(T, remat), step_temp(2 * T, remat)
    assert big <= 2.2 * small, f"step temp {small} B at T={T}, {big} B at T={2 * T}"
    print(f"gemma3 tiny step temp (remat {remat}): {small} B at T={T}, {big} B at T={2 * T}")


def test_the_window_is_what_makes_it_linear():
    """At the default chunk budget (one chunk at these sizes): every layer local is linear,
    every layer full attention is not (its [T, T] probabilities: the negative control)."""
    T = 8 * W
    local = GEMMA3.replace(layer_types=None)  # a window on every layer, as Mistral's
    full = GEMMA3.replace(layer_types=None, sliding_window=None)
    small, big = step_temp(T, "full", local), step_temp(2 * T, "full", local)
    assert big <= 2.2 * small, f"all local: step temp {small} B at T={T}, {big} B at T={2 * T}"
    small_f, big_f = step_temp(T, "full", full), step_temp(2 * T, "full", full)
    assert big_f > 2.5 * small_f, f"all full: {small_f} B at T={T}, {big_f} B at T={2 * T}"
    print(f"all local: {small} -> {big} B; all full: {small_f} -> {big_f} B (T={T} -> {2 * T})")
