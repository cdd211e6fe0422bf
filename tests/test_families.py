"""Model families beyond Llama (jaxmem.families): tiny random checkpoints written by transformers'
own classes (Qwen3ForCausalLM, MistralForCausalLM, Phi3ForCausalLM, ...) give jaxmem the same fp32 logits and the same
greedy generation, jaxmem's export loads back in transformers, the presets have the published
parameter counts, and a mixture of experts or a multimodal config.json is refused by its key.

Tolerance: tests/numerics.py's fp32 policy for two libraries' kernels (`model_terms`, with the
QK-norm's reductions over the head dim). Negative controls: Qwen3 without its QK-norm, Phi-3 with
RoPE over the whole head (and others) must exceed the largest difference the policy allows
tenfold.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.torch

from jaxmem.families import PRESETS  # noqa: E402
from jaxmem.families.config import ModelConfig  # noqa: E402
from jaxmem.io.hf import HFError, config_from_hf, load_hf  # noqa: E402
from jaxmem.families.decoder import Decoder  # noqa: E402
from jaxmem.families.params import abstract_params, count_params  # noqa: E402

from hf_files import random_params  # noqa: E402
from numerics import assert_reordered_fp32, largest_allowed, model_terms  # noqa: E402

SEQ = 10
COMMON = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
              rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=0, eos_token_id=1,
              pad_token_id=2)
# family: (config class, model class, kwargs): head_dim 16 != 48 / 4 where the family has one
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=16, sliding_window=None)),
    # Gemma 3: a window of 4 < SEQ, a local layer then a global one (linear RoPE on it only),
    # query_pre_attn_scalar != head_dim
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=24, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 10000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})),
    # Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj, RoPE on half of each 12-dim head
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.5})),
    # OLMo 2: post-norms only, the QK-norm over the whole projections ([N*H] = 64, [K*H] = 32;
    # Olmo2Config has no head_dim of its own, its attention and RoPE read one where given)
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(head_dim=16, tie_word_embeddings=False)),
}


GEMMA3_FIELDS = ("qk_norm", "norm_plus_one", "norm_placement", "mlp_activation", "embed_scale",
                 "rope_type", "rope_factor", "rope_local_theta", "tie_embeddings")


def hf_model(family: str, seed: int = 0):
    config_cls, model_cls, kw = FAMILIES[family]
    config = getattr(transformers, config_cls)(**COMMON, **kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # init's std 0.02 makes near-uniform logits: use larger weights
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.uniform_(0.8, 1.2)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    for i, family in enumerate(FAMILIES):
        hf_model(family, seed=i).save_pretrained(root / family)
    return root


def ids():
    return np.random.default_rng(0).integers(3, COMMON["vocab_size"], (2, SEQ))


def torch_logits(path, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def jax_logits(config, params, tokens):
    with jax.default_matmul_precision("highest"):
        return np.asarray(Decoder(config).apply({"params": params}, jnp.asarray(tokens)))


def terms(config) -> int:
    """model_terms plus the QK-norm's reductions (over H, or OLMo 2's whole projections)."""
    return model_terms(config, SEQ) + sum(config.qk_norm_widths) * config.num_layers


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_equal_transformers(checkpoints, family):
    config, params = load_hf(checkpoints / family)
    assert config.family == family
    assert config.qk_norm == (family in ("qwen3", "gemma3", "olmo2"))
    assert config.qkv_bias == (family == "qwen2")
    ref = torch_logits(checkpoints / family, ids())
    assert_reordered_fp32(jax_logits(config, params, ids()), ref, terms=terms(config))
    if family == "qwen2":  # the biases are not zero, and without them the logits differ
        assert np.abs(params["layers"]["self_attn"]["k_bias"]).min() > 0.5
        plain = {**params, "layers": {**params["layers"], "self_attn": {
            k: v for k, v in params["layers"]["self_attn"].items() if not k.endswith("_bias")}}}
        off = jax_logits(config.replace(qkv_bias=False), plain, ids())
        assert np.abs(off - ref).max() > 10 * largest_allowed(ref, terms(config))
    if family == "gemma3":  # negative control: the same weights without the window
        assert config.local_layers == (True, False) and SEQ > config.sliding_window
        off = jax_logits(config.replace(sliding_window=None, layer_types=None), params, ids())
        assert np.abs(off - ref).max() > 10 * largest_allowed(ref, terms(config))
    if family == "phi3":  # negative control: the same weights with RoPE on the whole head
        assert config.rotary_dim == 6 and config.resolved_head_dim == 12
        off = jax_logits(config.replace(partial_rotary_factor=1.0), params, ids())
        assert np.abs(off - ref).max() > 10 * largest_allowed(ref, terms(config))
    if family == "olmo2":  # negative controls: a QK-norm per head, and norms before, not after
        assert (config.norm_placement, config.qk_norm_scope) == ("post", "projection")
        attn = params["layers"]["self_attn"]
        assert attn["q_norm"]["scale"].shape == (2, 64) and attn["k_norm"]["scale"].shape == (2, 32)
        H = config.resolved_head_dim
        per_head = {**params, "layers": {**params["layers"], "self_attn": {**attn, **{
            n: {"scale": attn[n]["scale"][:, :H]} for n in ("q_norm", "k_norm")}}}}
        off = jax_logits(config.replace(qk_norm_scope="head"), per_head, ids())
        assert np.abs(off - ref).max() > 10 * largest_allowed(ref, terms(config))
        layers = params["layers"]  # the same two scales as Llama's pre-norms
        pre = {**params, "layers": {
            **{k: v for k, v in layers.items() if k != "post_feedforward_layernorm"},
            "input_layernorm": layers["post_attention_layernorm"],
            "post_attention_layernorm": layers["post_feedforward_layernorm"]}}
        off = jax_logits(config.replace(norm_placement="pre"), pre, ids())
        assert np.abs(off - ref).max() > 10 * largest_allowed(ref, terms(config))
    if family == "qwen3":  # negative control: the same weights without the QK-norm
        plain = {**params, "layers": {**params["layers"], "self_attn": {
            k: v for k, v in params["layers"]["self_attn"].items() if not k.endswith("_norm")}}}
        off = jax_logits(config.replace(qk_norm=False), plain, ids())
        assert np.abs(off - ref).max() > 10 * largest_allowed(ref, terms(config))


def test_mistral_sliding_window_equals_transformers(tmp_path):
    """Mistral 7B v0.1's kind of config.json: every layer windowed (4 < SEQ)."""
    config_cls, model_cls, kw = FAMILIES["mistral"]
    hf = getattr(transformers, config_cls)(**COMMON, **{**kw, "sliding_window": 4})
    torch.manual_seed(5)
    model = getattr(transformers, model_cls)(hf).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.uniform_(0.8, 1.2)
    model.save_pretrained(tmp_path)
    config, params = load_hf(tmp_path)
    assert config.sliding_window == 4 and all(config.local_layers)
    ref = torch_logits(tmp_path, ids())
    assert_reordered_fp32(jax_logits(config, params, ids()), ref, terms=terms(config))
    off = jax_logits(config.replace(sliding_window=None), params, ids())
    assert np.abs(off - ref).max() > 10 * largest_allowed(ref, terms(config))


def test_gemma3_multimodal_checkpoint_imports_its_language_model(tmp_path, capsys):
    """Gemma3ForConditionalGeneration (the 4B to 27B checkpoints): its text_config and the
    language model's tensors are read, the vision tower is left out with a note, and the
    logits of a text-only prompt equal the multimodal model's."""
    _, _, kw = FAMILIES["gemma3"]
    text = transformers.Gemma3TextConfig(**COMMON, **kw)
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    hf = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                   mm_tokens_per_image=4, image_token_index=96,
                                   boi_token_index=94, eoi_token_index=95)
    torch.manual_seed(6)
    model = transformers.Gemma3ForConditionalGeneration(hf).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.uniform_(0.8, 1.2)
    model.save_pretrained(tmp_path)
    notes = []
    config, params = load_hf(tmp_path, note=notes.append)
    assert config.family == "gemma3" and config.local_layers == (True, False)
    assert len(notes) == 1 and "vision tower" in notes[0]
    with torch.no_grad():
        ref = model(torch.tensor(ids())).logits.numpy()
    assert_reordered_fp32(jax_logits(config, params, ids()), ref, terms=terms(config))
    # the generate CLI says so in one line on stderr, and samples from the language model
    from jaxmem.generate.cli import main as generate_main
    from hf_files import write_tokenizer

    write_tokenizer(tmp_path, "def return import class self None for in if else " * 50)
    assert generate_main(["--hf", str(tmp_path), "--prompt", "def", "--max-new-tokens", "4",
                          "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert err.count("the vision tower and projector are left out") == 1, err


def test_gemma3_local_layers_cache_the_window_not_the_sequence():
    """gemma-3-12b at 8 x its window: 40 local layers keep 1024 slots, 8 global ones all."""
    from jaxmem.decode.sampling import init_cache

    c = PRESETS["gemma-3-12b"]
    S = 8 * c.sliding_window
    cache = jax.eval_shape(lambda: init_cache(c, 2, S, jnp.bfloat16))
    K, H = c.num_kv_heads, c.resolved_head_dim
    assert [a.shape for a in cache["local"]] == [(40, 2, c.sliding_window, K, H)] * 2
    assert [a.shape for a in cache["full"]] == [(8, 2, S, K, H)] * 2
    plain = jax.eval_shape(lambda: init_cache(PRESETS["qwen3-8b"], 2, S, jnp.bfloat16))
    assert [a.shape[:3] for a in plain] == [(36, 2, S)] * 2


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_equals_transformers(checkpoints, family):
    """Five prompts of 2 to 7 tokens in one left-padded batch, greedy, stopping at an EOS that
    the model does emit (the third new token of the first prompt's unstopped run)."""
    from jaxmem.decode.sampling import generate_ids

    config, params = load_hf(checkpoints / family)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints / family,
                                                              dtype=torch.float32).eval()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (5, 2, 7, 3, 6)]
    width = max(map(len, prompts))
    pad = COMMON["pad_token_id"]
    batch = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def hf_generate(eos):
        with torch.no_grad():
            out = model.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                 eos_token_id=eos, pad_token_id=pad)[:, width:].tolist()
        return [row[:row.index(eos) + 1] if eos in row else row for row in out]

    eos = hf_generate(None)[0][2]
    want = hf_generate(eos)
    with jax.default_matmul_precision("highest"):
        got = generate_ids(config, params, prompts, 8, temperature=0.0, eos_ids=(eos,))
    assert got == want
    assert any(len(row) < 8 for row in want)  # at least one row stopped at the EOS


@pytest.mark.parametrize("family", list(FAMILIES))
def test_jaxmem_written_checkpoint_loads_in_transformers(tmp_path, family):
    from jaxmem.io.hf_export import save_hf

    config = ModelConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2,
                         num_heads=4, num_kv_heads=2, rms_norm_eps=1e-6,
                         head_dim=None if family == "qwen2" else 16,
                         max_position_embeddings=256, family=family, qk_norm=family == "qwen3",
                         qkv_bias=family == "qwen2", tie_embeddings=family == "qwen3")
    if family == "olmo2":  # the preset's variation points
        o = PRESETS["olmo-2-1124-7b"]
        config = config.replace(**{f: getattr(o, f) for f in (
            "norm_placement", "qk_norm", "qk_norm_scope")})
    if family == "gemma3":  # the preset's variation points at this size
        g = PRESETS["gemma-3-4b"]
        config = config.replace(**{f: getattr(g, f) for f in GEMMA3_FIELDS},
                                sliding_window=4, query_pre_attn_scalar=24,
                                layer_types=("sliding_attention", "full_attention"))
    if family == "phi3":  # RoPE on the first half of each 16-dim head
        config = config.replace(partial_rotary_factor=0.5, tie_embeddings=True)
    params = random_params(config, seed=3)
    save_hf(tmp_path / "hf", config, params)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["model_type"] == {"gemma3": "gemma3_text"}.get(family, family)
    assert config_from_hf(written) == config
    ref = torch_logits(tmp_path / "hf", ids())
    assert_reordered_fp32(jax_logits(config, params, ids()), ref, terms=terms(config))


REFUSED = [  # (transformers config class, kwargs, the key the refusal names)
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (the checkpoints' own
    # config.json says num_experts: the CLI test below)
    ("Qwen3MoeConfig", dict(num_experts=4), "num_(local_)?experts=4"),
    ("MixtralConfig", dict(num_local_experts=4), "num_local_experts"),
    ("Gemma3TextConfig", dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
    ("Qwen3Config", dict(use_sliding_window=True, sliding_window=64), "use_sliding_window"),
    ("Qwen2Config", dict(use_sliding_window=True, sliding_window=64), "use_sliding_window"),
    ("Phi3Config", dict(sliding_window=64), "sliding_window=64"),
    ("Phi3Config", dict(resid_pdrop=0.1), "resid_pdrop=0.1"),
    ("Phi3Config", dict(rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 6,
        "long_factor": [2.0] * 6, "original_max_position_embeddings": 1024}),
     r"rope_parameters\.rope_type='longrope'"),
    ("Olmo2Config", dict(clip_qkv=8.0), "clip_qkv"),
    ("Olmo2Config", dict(attention_bias=True), "attention_bias"),
    ("Olmo2Config", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                          "rope_theta": 10000.0}), "rope_parameters.rope_type"),
]


@pytest.mark.parametrize("cls, kw, key", REFUSED, ids=[r[0] for r in REFUSED])
def test_what_jaxmem_cannot_build_is_refused_by_its_key(cls, kw, key):
    d = getattr(transformers, cls)(**{**COMMON, **kw}).to_dict()
    with pytest.raises(HFError, match=rf"^config.json: {key}"):
        config_from_hf(d)


def test_a_multimodal_checkpoint_is_refused_by_its_key():
    d = transformers.LlavaConfig().to_dict()
    with pytest.raises(HFError, match="config.json: vision_config is set: a multimodal"):
        config_from_hf(d)


def test_train_init_from_a_moe_checkpoint_exits_2_with_one_line(tmp_path, capsys, corpus):
    from jaxmem.train.cli import main

    from runs import error_line

    d = tmp_path / "moe"
    d.mkdir()
    # the keys of Qwen/Qwen3-30B-A3B's config.json that make it a mixture of experts
    moe = {**transformers.Qwen3Config(**COMMON).to_dict(), "model_type": "qwen3_moe",
           "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32}
    (d / "config.json").write_text(json.dumps(moe))
    with pytest.raises(SystemExit) as e:
        main(["--init-from", str(d), "--data", corpus, "--out", str(tmp_path / "run")])
    assert e.value.code == 2
    assert "num_experts=4: a mixture of experts" in error_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


# Published parameter counts, in billions as printed: Qwen3's model cards (total, and without
# the embedding and the LM head); the Hub's model size of the safetensors for Qwen2.5 and
# Mistral (Qwen2.5's cards truncate, and print 32.5B for a 32.76B checkpoint).
PUBLISHED = {
    "qwen2.5-0.5b": ("0.494", None), "qwen2.5-1.5b": ("1.54", None), "qwen2.5-3b": ("3.09", None),
    "qwen2.5-7b": ("7.62", None), "qwen2.5-14b": ("14.8", None), "qwen2.5-32b": ("32.8", None),
    "qwen2.5-72b": ("72.7", None),
    "qwen3-0.6b": ("0.6", "0.44"), "qwen3-1.7b": ("1.7", "1.4"), "qwen3-4b": ("4.0", "3.6"),
    "qwen3-8b": ("8.2", "6.95"), "qwen3-14b": ("14.8", "13.2"), "qwen3-32b": ("32.8", "31.2"),
    "mistral-7b-v0.3": ("7.25", None), "mistral-nemo-12b": ("12.2", None),
    # Gemma 3 technical report, table 1: non-embedding parameters of the text decoder (the
    # 4B-27B totals there include the vision encoder); 1B's total is 999,885,952
    "gemma-3-1b": ("1.0", "0.698"), "gemma-3-4b": (None, "3.209"),
    "gemma-3-12b": (None, "10.759"), "gemma-3-27b": (None, "25.600"),
    # microsoft/Phi-4-mini-instruct's safetensors: 3,836,021,760 (the tied head counted once)
    "phi-4-mini": ("3.836021760", None),
    # OLMo 2: the Hub's model size of the safetensors (allenai/OLMo-2-*)
    "olmo-2-0425-1b": ("1.48", None), "olmo-2-1124-7b": ("7.30", None),
    "olmo-2-1124-13b": ("13.7", None), "olmo-2-0325-32b": ("32.2", None),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_have_the_published_parameter_counts(name):
    c = PRESETS[name]
    n = count_params(abstract_params(c))
    # the count transformers' own class gives for the same config.json (on the meta device)
    from jaxmem.io.hf import config_to_hf

    hf = transformers.AutoConfig.for_model(**{
        k: v for k, v in config_to_hf(c).items() if k != "architectures"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert n == sum(p.numel() for p in model.parameters())
    total, body = PUBLISHED[name]

    def billions(x, printed):
        digits = len(printed.partition(".")[2])
        return f"{x / 1e9:.{digits}f}"

    if total is not None:
        assert billions(n, total) == total
    if body is not None:
        embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_embeddings else 2)
        assert billions(n - embeddings, body) == body
