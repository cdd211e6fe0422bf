"""The run's phases (jaxmem.memory.phases): evaluation through the fused loss with today's
values, each phase's compiled peak against the step's, the verdict on the largest phase, and
adamw8bit's in-place update (no params-sized update buffer)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.families import get_preset
from jaxmem.families.config import ModelConfig
from jaxmem.memory import StepSpec, analytic_breakdown, compile_step
from jaxmem.memory.compiled import abstract_state, compile_phase, tree_bytes
from jaxmem.memory.phases import SampleShape, analytic_phases, run_phases
from jaxmem.families.params import init_params, num_params
from jaxmem.model.remat import RematPolicy
from jaxmem.train.loss import cross_entropy, synthetic_batch
from jaxmem.model.precision import get_precision
from jaxmem.train.run import make_eval_fn

from numerics import assert_reordered_fp32, model_terms

# A vocabulary much wider than the model, so that [B, T, V] logits dominate an unfused eval.
WIDE_VOCAB = ModelConfig(vocab_size=16384, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, max_position_embeddings=256)


@pytest.mark.parametrize("loss_chunk", [None, 32])
@pytest.mark.slow  # 4.4 s cold on 2 cores (default run kept under 5 min)
def test_eval_fused_loss_equals_full_logits(loss_chunk):
    """make_eval_fn (token_loss, fused LM head) gives the old eval's value: full [B, T, V] fp32
    logits through cross_entropy, tiny preset, fp32, with padding; measured max rel diff ~1e-7,
    compared under tests/numerics.py's policy (the fused head adds in another order)."""
    spec = StepSpec.of(get_preset("tiny"), get_precision("fp32"), RematPolicy.parse("full"), 4, 128,
                       loss_chunk=loss_chunk)
    cfg = spec.step_config()[0]
    params = init_params(spec.model, jax.random.PRNGKey(0))
    batch = synthetic_batch(jax.random.PRNGKey(1), 4, 128, spec.model.vocab_size,
                            pad_fraction=0.25)
    with jax.default_matmul_precision("highest"):
        sums, counts = make_eval_fn(cfg)(params, batch)
        total, count = sums["loss"], counts["tokens"]
        logits = cfg.build_model().apply({"params": params}, batch["inputs"])  # [B, T, V] fp32
        ref_total, ref_count = cross_entropy(logits, batch["targets"], batch["mask"])
    assert float(count) == float(ref_count) == 4 * 96
    # the loss's terms for one row, plus the sum of the token losses over all 4 x 128 tokens
    assert_reordered_fp32(np.asarray(total), np.asarray(ref_total),
                          terms=model_terms(spec.model, 128, loss=True) + 4 * 128)
    assert float(total) / float(count) > 5.0  # ~ln(259) at init: a real loss, not a zero


# An MLP much wider than the rest, so that its [B, T, F] activations dominate an untiled eval.
WIDE_MLP = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=8192, num_layers=2,
                       num_heads=4, num_kv_heads=2, max_position_embeddings=512)


def test_eval_runs_the_mlp_in_tiles_whatever_the_remat(monkeypatch):
    """The eval differentiates nothing, so its model (EVAL_REMAT) runs the MLP in sequence tiles
    even where the step's policy (`none`) keeps it whole: with the tile limit lowered (8 tiles
    of 64 for T = 512) the eval's loss equals the untiled one in fp32 (tests/numerics.py's
    policy, as the tiled step's test_lean.py) and its compiled temp is smaller (measured
    2026-11-27, XLA:CPU: 50.4 -> 14.6 MiB; the old eval, built under `none`, stayed at 50.4);
    the analytic eval phase counts the tiles too (93.8 -> 52.1 MiB)."""
    from jaxmem.model import tiled
    spec = StepSpec.of(WIDE_MLP, get_precision("fp32"), RematPolicy.parse("none"), 1, 512)
    cfg = spec.step_config()[0]
    params = init_params(WIDE_MLP, jax.random.PRNGKey(0))
    batch = synthetic_batch(jax.random.PRNGKey(1), 1, 512, WIDE_MLP.vocab_size, pad_fraction=0.1)

    def run():
        fn = make_eval_fn(cfg)
        temp = fn.lower(params, batch).compile().memory_analysis().temp_size_in_bytes
        with jax.default_matmul_precision("highest"):
            sums, counts = fn(params, batch)
            return (sums["loss"], counts["tokens"]), temp, analytic_phases(spec)["eval"]["total"]

    assert tiled.mlp_tile(1, 512, 8192) == 512  # the default limit: one tile, untiled
    (total0, count0), temp0, analytic0 = run()
    monkeypatch.setattr(tiled, "TILE_BYTES", 64 * 8192 * 4)
    monkeypatch.setattr(tiled, "TILE_MIN_TOKENS_PER_WIDTH", 0)  # tiny: tiled anyway
    assert tiled.mlp_tile(1, 512, 8192) == 64
    (total1, count1), temp1, analytic1 = run()
    assert float(count1) == float(count0) > 0
    assert_reordered_fp32(np.asarray(total1), np.asarray(total0),
                          terms=model_terms(WIDE_MLP, 512, loss=True) + 512)
    untiled = 3 * 512 * 8192 * 4  # gate, up, their product [B, T, F] fp32: 48 MiB
    assert temp0 - temp1 > 0.5 * untiled, (temp0, temp1)
    assert analytic0 - analytic1 > 0.5 * untiled, (analytic0, analytic1)


def _eval_phase(spec) -> int:
    """The eval phase as the run holds it: the eval program + the state outside its arguments."""
    state = abstract_state(spec)
    return compile_phase("eval", spec)["peak_bytes"] + tree_bytes(state) - tree_bytes(state.params)


@pytest.mark.slow  # 6.8 s cold on 2 cores (default run kept under 5 min)
def test_eval_phase_not_above_step_small():
    """The fast stand-in of the 1B check: amp-bf16, full remat, V = 256 D, the loss in chunks of
    32 positions (at 1B x 8 x 2048 the automatic chunk is 65 of 2048): the eval phase stays
    under the step, and holds no [B, T, V] logits (the old eval's, loss_chunk 0, measured
    2026-11-23: fused 39.6 MiB, unfused 91.0, step 226.6 at B = 4, T = 256)."""
    def spec(loss_chunk):
        return StepSpec.of(WIDE_VOCAB, get_precision("amp-bf16"), RematPolicy.parse("full"), 2, 128,
                           loss_chunk=loss_chunk)
    step = compile_step(spec(32))["peak_bytes"]
    fused, unfused = _eval_phase(spec(32)), _eval_phase(spec(0))
    logits = 2 * 128 * WIDE_VOCAB.vocab_size * 4  # [B, T, V] fp32, 16 MiB
    assert fused <= step, (fused, step)
    assert unfused - fused > 0.5 * logits, (fused, unfused)  # measured 0.75


@pytest.mark.slow
def test_1b_eval_and_sample_phases_not_above_step():
    """llama-3.2-1b amp-bf16 full 8 x 2048, compile only (CPU: 34 s alone, ~2.5 min under load here): measured 2026-11-23,
    step 25.50 GiB, eval phase 19.00 (the old full-logits eval: see docs/memory.md), sample 21.44."""
    spec = StepSpec.of(get_preset("llama-3.2-1b"), get_precision("amp-bf16"),
                       RematPolicy.parse("full"), 8, 2048)
    step = compile_step(spec)
    r = run_phases(spec, SampleShape(), compile=True, step_compiled=step)
    by = {p["name"]: p["compiled_bytes"] for p in r["phases"]}
    assert by["eval"] <= by["step"] and by["sample"] <= by["step"], by
    assert r["peak_phase"] == "step" and r["peak_bytes"] == step["peak_bytes"]


@pytest.mark.slow  # 8.7 s cold on 2 cores (default run kept under 5 min)
def test_phases_compiled_and_the_largest_decides():
    """tiny amp-bf16, 2 x 64: each phase compiled; the run's peak is the largest of them; the
    state program outputs exactly the state; the sampler's arguments are the stored params."""
    spec = StepSpec.of(get_preset("tiny", num_layers=2), get_precision("amp-bf16"),
                       RematPolicy.parse("full"), 2, 64)
    step = compile_step(spec)
    r = run_phases(spec, SampleShape(max_new_tokens=16), compile=True, step_compiled=step)
    rows = {p["name"]: p for p in r["phases"]}
    assert list(rows) == ["state", "step", "eval", "sample"]
    peaks = {n: p["compiled_bytes"] for n, p in rows.items()}
    assert r["peak_bytes"] == max(peaks.values()) and peaks[r["peak_phase"]] == r["peak_bytes"]
    assert r["peak_source"] == "compiled"
    state = abstract_state(spec)
    out = compile_phase("state", spec)["output_bytes"]  # the state, plus XLA's few bytes of alignment
    assert tree_bytes(state) <= out <= tree_bytes(state) + 1024, (out, tree_bytes(state))
    sample = rows["sample"]["program"]
    # the KV-cache sampler takes the fp32 master params as stored (cast to bf16 inside), the
    # prompt's ids (int32) and validity (bool), and the key
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    assert sample["argument_bytes"] == tree_bytes(state.params) + 64 * (4 + 1) + key.size * 4
    # the state (fp32 master + Adam) is held by the loop around the eval and sample programs
    # (the params are the sampler's arguments: the same buffers, not counted twice)
    assert rows["sample"]["outside_bytes"] == tree_bytes(state) - tree_bytes(state.params)
    assert rows["eval"]["outside_bytes"] == tree_bytes(state) - tree_bytes(state.params)


def test_analytic_phases_follow_the_config():
    """No sample when max_new_tokens is 0; the sample's buffer is capped at the model's positions;
    the state phase is the state plus three fp32 layers of the largest params leaf (what
    jaxmem.model.typed_init holds of it at a time: random bits, fp32 values, their cast)."""
    c = get_preset("tiny")
    spec = StepSpec.of(c, get_precision("fp32"), RematPolicy.parse("full"), 2, 64)
    assert "sample" not in analytic_phases(spec, SampleShape(max_new_tokens=0))
    assert SampleShape(max_new_tokens=10_000).total(c.max_position_embeddings) == 512
    assert SampleShape(max_new_tokens=10).total(512) == 74
    a = analytic_phases(spec, SampleShape())
    state = tree_bytes(abstract_state(spec)) - 0  # params, mu, nu, counters, loss scale
    largest = max(x.size for x in jax.tree_util.tree_leaves(abstract_state(spec).params))
    layer = largest // c.num_layers * 4
    assert abs(a["state"]["total"] - (state + 3 * layer)) <= 64  # counters/keys: a few bytes
    # and the compiled state program holds no more than that beside the state (CPU's compiler)
    assert compile_phase("state", spec)["peak_bytes"] <= a["state"]["total"]


def test_sampler_lowering_is_the_sampler():
    """lower_sample compiles the program sample_tokens runs: greedy tokens from the lowered and
    compiled program equal sample_tokens' (tiny, fp32)."""
    from jaxmem.decode.sampling import lower_sample, sample_tokens
    c = get_preset("tiny", num_layers=1)
    params = init_params(c, jax.random.PRNGKey(3))
    prompt = [1, 5, 9]
    out = sample_tokens(c, params, prompt, 6, temperature=0.0)
    compiled = lower_sample(c, params, 3, 9, compute_dtype=jnp.float32).compile()
    ids, valid = jnp.asarray([prompt], jnp.int32), jnp.ones((1, 3), bool)
    new = compiled(params, ids, valid, jax.random.PRNGKey(0))[0]  # (new ids [1, 6], steps)
    assert prompt + [int(t) for t in np.asarray(new)[0]] == out
    assert len(out) == 9 and out[:3] == prompt


@pytest.mark.parametrize("quantize", ["nf4", pytest.param("none", marks=pytest.mark.slow)])
def test_lora_sample_phase_compiles_what_the_run_samples_with(quantize):
    """A LoRA / QLoRA run samples with peft.full_params(its frozen base, its adapters)
    (jaxmem.train.loop): the sample phase's program takes exactly those params (the same leaves,
    shapes and dtypes, so the same argument bytes), and on the tiny preset compiles to less than
    the plain fp32 model's sampler it used to stand in for."""
    from jaxmem.memory.compiled import sample_params
    from jaxmem.train.placement import Placement
    from jaxmem.peft.base import base_on_device
    from jaxmem.peft.lora import LoraSpec
    c = get_preset("tiny")
    lora = LoraSpec(8, quantize=quantize, double_quant=quantize == "nf4")
    spec = StepSpec.of(c, get_precision("amp-bf16"), RematPolicy.parse("full"), 1, 64, trainable=lora)
    host = jax.tree_util.tree_map(np.asarray, init_params(c, jax.random.PRNGKey(0)))
    frozen = base_on_device(host, lora, spec.precision.compute_dtype)  # the run's import
    adapters = Placement.single().state_creation(*spec.step_config(), seed=0)().params  # the run's
    run_params = lora.full_params(frozen, adapters)
    shapes = lambda t: [(x.shape, jnp.dtype(x.dtype)) for x in jax.tree_util.tree_leaves(t)]  # noqa: E731
    assert (jax.tree_util.tree_structure(sample_params(spec))
            == jax.tree_util.tree_structure(run_params))
    assert shapes(sample_params(spec)) == shapes(run_params)
    n_prompt, total = 16, 80
    shape = SampleShape(total - n_prompt, 0.8, 40, prompt_tokens=n_prompt)
    lora_prog = compile_phase("sample", spec, sample=shape)
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    tokens = n_prompt * 4 + n_prompt * 1 + key.size * key.dtype.itemsize  # ids, valid, key
    assert lora_prog["argument_bytes"] == tree_bytes(run_params) + tokens
    plain = StepSpec.of(c, get_precision("fp32"), RematPolicy.parse("full"), 1, 64)
    plain_prog = compile_phase("sample", plain, sample=shape)
    assert lora_prog["argument_bytes"] < plain_prog["argument_bytes"]
    if quantize != "none":  # (a bf16 base: XLA:CPU emulates bf16 with fp32 copies in its temp)
        assert lora_prog["peak_bytes"] < plain_prog["peak_bytes"], (lora_prog, plain_prog)
    # the phase: the program plus what the run holds outside it (the adapters' optimizer state)
    r = run_phases(spec, SampleShape(max_new_tokens=total - n_prompt, prompt_tokens=n_prompt),
                   compile=True, step_compiled={"peak_bytes": 0})
    row = {x["name"]: x for x in r["phases"]}["sample"]
    state = abstract_state(spec)
    assert row["outside_bytes"] == tree_bytes(state) - tree_bytes(state.params)
    assert row["compiled_bytes"] == lora_prog["peak_bytes"] + row["outside_bytes"]


@pytest.mark.slow  # 4.9 s cold on 2 cores (default run kept under 5 min)
def test_adamw8bit_update_has_no_params_sized_buffer(monkeypatch):
    """The in-place 8-bit update (jaxmem.optim.AdamW8bitInPlace) in row pieces: the compiled
    step holds no params-sized update buffer. Pieces of 2^12 elements stand in for the 2^24 of
    full-size leaves. fp32, 1 x 16 tokens, so the optimizer phase sets the peak."""
    import jaxmem.optim._stochastic as sr
    monkeypatch.setattr(sr, "CHUNK", 2**12)
    c = ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_layers=2,
                    num_heads=4, num_kv_heads=4, max_position_embeddings=64)
    spec = StepSpec.of(c, get_precision("fp32"), RematPolicy.parse("full"), 1, 16,
                       optimizer="adamw8bit")
    compiled = compile_step(spec)
    a = analytic_breakdown(spec)
    P4 = 4 * num_params(c)
    # temp = the fp32 gradients and small change: a params-sized update buffer would add P4
    assert compiled["temp_bytes"] < P4 + 0.5 * P4, (compiled["temp_bytes"], P4)
    names = {x["name"]: x for x in a["components"]}
    assert "optimizer update buffer" not in names
    assert names["optimizer update in place: small leaves + one piece"]["bytes"] < 0.05 * P4
    assert 0.85 <= a["total_bytes"] / compiled["peak_bytes"] <= 1.15
