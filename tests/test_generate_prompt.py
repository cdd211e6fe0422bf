"""jaxmem.generate never cuts the prompt, says when the context shortens the output, --step."""

import jax
import pytest

from jaxmem.families import get_preset
from jaxmem.data import ByteTokenizer
from jaxmem.decode.sampling import generate_text, new_token_budget, sample_tokens
from jaxmem.families.decoder import Decoder


@pytest.fixture(scope="module")
def model():
    cfg = get_preset("tiny", num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2,
                     num_kv_heads=1, max_position_embeddings=48)
    import jax.numpy as jnp
    params = Decoder(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    return cfg, params


@pytest.mark.slow  # token-by-token generation: 15 s of CPU cold
def test_prompt_is_kept_whole_and_the_output_is_shortened_with_a_note(model):
    cfg, params = model
    prompt = list(range(1, 41))  # 40 of the model's 48 positions
    out = sample_tokens(cfg, params, prompt, max_new_tokens=100, temperature=0.0)
    assert out[:40] == prompt and len(out) == 48  # 8 new tokens fill the context
    notes = []
    text = generate_text(cfg, params, ByteTokenizer(), "x" * 39, max_new_tokens=100,
                         temperature=0.0, note=notes.append)
    assert text.startswith("x" * 39)
    assert len(notes) == 1 and "shortened to 8 new tokens (asked 100)" in notes[0]
    notes.clear()
    generate_text(cfg, params, ByteTokenizer(), "x", max_new_tokens=5, note=notes.append)
    assert notes == []


def test_a_prompt_that_fills_the_context_is_an_error_not_a_cut(model):
    cfg, params = model
    assert new_token_budget(47, 10, 48) == 1
    with pytest.raises(ValueError, match="the prompt is 48 tokens .* 48 positions"):
        sample_tokens(cfg, params, list(range(48)), max_new_tokens=4)


def test_generate_help_shows_defaults_and_step():
    from jaxmem.generate.cli import build_parser
    text = " ".join(build_parser().format_help().split())
    for part in ("--step N", "(default: the newest)", "(default: 200)", "(default: 0.8)",
                 "(default: 40)", "sampling seed (default: 0)"):
        assert part in text, part
