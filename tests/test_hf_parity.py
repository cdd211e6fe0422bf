"""Parity with transformers: tiny random LlamaForCausalLM checkpoints written by save_pretrained
give jaxmem the same fp32 logits, and a jaxmem fine-tune exported with `jaxmem.export` loads in
transformers with the same logits.

Tolerance: tests/numerics.py's fp32 policy for two libraries' kernels, with the model's reduction
length (`model_terms`; fp32 on CPU, jax matmul precision `highest`; measured max differences 4e-6
to 5e-6 on logits of magnitude ~5; the negative controls differ by 4 to 8). Negative controls:
the same comparison with plain RoPE on the llama3 checkpoint, or with q/k's head dim permuted to
the interleaved (Meta) layout, must exceed the largest difference it allows tenfold.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytestmark = pytest.mark.torch

from jaxmem.io.hf import load_hf  # noqa: E402
from jaxmem.families.decoder import Decoder  # noqa: E402
from jaxmem.model.layers import rope_inv_freq  # noqa: E402

from hf_files import write_tokenizer  # noqa: E402
from numerics import assert_reordered_fp32, largest_allowed, model_terms  # noqa: E402

SEQ = 10  # ids_and_positions: 2 rows of 10 tokens


def assert_logits_equal(config, got, ref):
    assert_reordered_fp32(got, ref, terms=model_terms(config, SEQ))

ORIGINAL = 256  # llama3's original context: low-frequency wavelengths > 256, high < 64

CASES = {  # name: (LlamaConfig kwargs, save_pretrained kwargs, saved dtype)
    "untied": (dict(head_dim=12), {}, torch.float32),
    "untied_bf16": (dict(head_dim=12), {}, torch.bfloat16),
    "tied_llama3_head16": (dict(tie_word_embeddings=True, head_dim=16, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=ORIGINAL)), {}, torch.float32),
    "sharded": (dict(head_dim=12), dict(max_shard_size="30KB"), torch.float32),
}


def hf_config(vocab, **kw):
    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=0, eos_token_id=1, **kw)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    vocab = write_tokenizer(root / "tok", "def main():\n    return 0\n" * 200)
    out = {}
    for i, (name, (kw, save_kw, dtype)) in enumerate(CASES.items()):
        torch.manual_seed(i)
        model = transformers.LlamaForCausalLM(hf_config(vocab, **kw)).eval()
        with torch.no_grad():  # init's std 0.02 makes near-uniform logits: use larger weights
            for p in model.parameters():
                p.normal_(0.0, 0.2) if p.ndim > 1 else p.uniform_(0.8, 1.2)
        model.to(dtype).save_pretrained(root / name, **save_kw)
        (root / name / "tokenizer.json").write_bytes((root / "tok" / "tokenizer.json").read_bytes())
        out[name] = root / name
    return out


def ids_and_positions(vocab, far):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (2, SEQ))
    step = 1500 if far else 1  # far apart: angles at every frequency band differ by many turns
    pos = np.stack([np.arange(SEQ) * step, np.arange(SEQ) * 37 + 3])
    return ids, pos


def torch_logits(path, ids, pos):
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(ids), position_ids=torch.tensor(pos)).logits.numpy()


def jax_logits(config, params, ids, pos):
    return np.asarray(Decoder(config).apply({"params": params}, jnp.asarray(ids),
                                          positions=jnp.asarray(pos)))


def test_llama3_case_spans_all_three_bands():
    wavelen = 2 * np.pi / np.asarray(rope_inv_freq(16, 10000.0))
    assert (wavelen < ORIGINAL / 4).any() and (wavelen > ORIGINAL).any()
    assert ((wavelen >= ORIGINAL / 4) & (wavelen <= ORIGINAL)).any()


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_transformers(checkpoints, name):
    config, params = load_hf(checkpoints[name])
    far = config.rope_type == "llama3"
    ids, pos = ids_and_positions(config.vocab_size, far)
    ref = torch_logits(checkpoints[name], ids, pos)
    got = jax_logits(config, params, ids, pos)
    assert_logits_equal(config, got, ref)
    control = 10 * largest_allowed(ref, model_terms(config, SEQ))
    if name == "sharded":
        index = json.loads((checkpoints[name] / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    if name == "tied_llama3_head16":
        assert config.tie_embeddings and config.resolved_head_dim * config.num_heads != config.hidden_size
        # negative control 1: plain RoPE on the llama3 checkpoint fails the tolerance
        plain = jax_logits(config.replace(rope_type="default"), params, ids, pos)
        assert np.abs(plain - ref).max() > control
    if name == "untied":
        # negative control 2: q/k permuted to the interleaved layout (what a needless Meta->HF
        # style permutation would do) fails the tolerance
        H = config.resolved_head_dim
        perm = np.concatenate([np.arange(0, H, 2), np.arange(1, H, 2)])
        bad = jax.tree_util.tree_map(lambda x: x, params)
        for k in ("q_proj", "k_proj"):
            bad["layers"]["self_attn"][k] = params["layers"]["self_attn"][k][..., perm]
        permuted = jax_logits(config, bad, ids, pos)
        assert np.abs(permuted - ref).max() > control


@pytest.mark.slow  # 6.4 s cold on 2 cores (default run kept under 5 min)
def test_finetuned_export_loads_in_transformers(checkpoints, tmp_path, corpus, capsys):
    """train --init-from (a few fp32 steps) -> export -> transformers: same logits as jaxmem's;
    generate --run and --hf on the export agree greedily."""
    from jaxmem.export.cli import main as export
    from jaxmem.generate.cli import main as generate
    from jaxmem.train.rundir import load_run
    from jaxmem.train.cli import main as train

    run, out = tmp_path / "run", tmp_path / "export"
    src = checkpoints["tied_llama3_head16"]
    assert train(["--init-from", str(src), "--data", corpus, "--out", str(run), "--steps", "3",
                  "--batch-size", "2", "--seq-len", "32", "--lr", "1e-2", "--warmup-steps", "1",
                  "--sample-tokens", "0", "--no-progress", "--eval-batches", "1"]) == 0
    loaded = load_run(run)
    config, params = loaded.model_config, loaded.state.params
    _, start = load_hf(src)
    moved = max(float(np.abs(np.asarray(a) - b).max()) for a, b in zip(
        jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(start)))
    assert moved > 1e-3  # it did fine-tune
    assert export(["--run", str(run), "--out", str(out), "--max-shard-mb", "0.03"]) == 0
    assert (out / "model.safetensors.index.json").exists() and (out / "tokenizer.json").exists()
    ids, pos = ids_and_positions(config.vocab_size, far=True)
    ref = torch_logits(out, ids, pos)
    assert_logits_equal(config, jax_logits(config, params, ids, pos), ref)
    capsys.readouterr()
    texts = []
    for source in (["--run", str(run)], ["--hf", str(out)]):
        assert generate([*source, "--prompt", "def ", "--temperature", "0",
                         "--max-new-tokens", "6"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_jaxmem_written_checkpoint_loads_in_transformers(tmp_path, tied):
    """save_hf of random params (sharded; untied head, head_dim 12 != 48/4) -> transformers'
    from_pretrained: the same logits as jaxmem's (tests/numerics.py), no tensor left at its init."""
    from jaxmem.families.config import ModelConfig
    from jaxmem.io.hf_export import save_hf

    from hf_files import random_params

    config = ModelConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=12, rms_norm_eps=1e-6,
                         max_position_embeddings=256, tie_embeddings=tied)
    params = random_params(config, seed=3)
    save_hf(tmp_path / "hf", config, params, max_shard_bytes=20_000)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert set(model.state_dict()) - {"lm_head.weight"} <= set(
        json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"])
    ids, pos = ids_and_positions(config.vocab_size, far=False)
    ref = torch_logits(tmp_path / "hf", ids, pos)
    assert_logits_equal(config, jax_logits(config, params, ids, pos), ref)
