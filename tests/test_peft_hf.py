"""QLoRA on a tiny Hugging Face checkpoint: the fine-tune lowers the eval loss, a changed base
is refused on resume, adapters export in PEFT's layout (peft loads them onto the base with the
same logits) and the merge goes into the original weights (transformers loads it, same logits).
"""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.families import PRESETS
from jaxmem.io.hf_export import save_hf
from jaxmem.train.rundir import load_run
from jaxmem.families.decoder import Decoder
from jaxmem.peft.base import base_on_device
from jaxmem.peft.export import merged_params, run_base
from jaxmem.train.cli import main
from runs import error_line

from hf_files import random_params, run_eval_losses, write_tokenizer  # noqa: E402
from numerics import assert_reordered_fp32, model_terms  # noqa: E402

pytest.importorskip("tokenizers")

# in = 64 for q/k/v/gate/up and o (N*H = 4*16), 128 for down: whole NF4 blocks
CFG = PRESETS["tiny"].replace(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=16,
                              max_position_embeddings=256)
ARGS = ["--batch-size", "8", "--seq-len", "64", "--steps", "40", "--warmup-steps", "5",
        "--lr", "1e-2", "--eval-every", "40", "--eval-batches", "4", "--save-every", "20",
        "--sample-tokens", "0", "--no-progress", "--lora-rank", "8", "--quantize-base", "nf4",
        "--double-quant"]


@pytest.fixture(scope="module")
def qlora(tmp_path_factory):
    """A tiny random HF checkpoint with a BPE tokenizer, and a 40-step QLoRA run on it (built-in
    corpus)."""
    d = tmp_path_factory.mktemp("peft")
    write_tokenizer(d / "tok", "def return import class self None for in if else " * 200)
    hf = d / "hf"
    save_hf(hf, CFG, random_params(CFG), tokenizer=str(d / "tok" / "tokenizer.json"),
            bos_token_id=0, eos_token_id=1)
    out = d / "run"
    assert main([*ARGS, "--init-from", str(hf), "--out", str(out)]) == 0
    return hf, out


@pytest.mark.slow  # 19.9 s cold on 2 cores (default run kept under 5 min)
def test_qlora_fine_tune_lowers_the_eval_loss(qlora):
    hf, out = qlora
    run = load_run(out)
    rec = json.loads((out / "config.json").read_text())["peft_base"]
    assert rec["source"] == str(hf.resolve()) and rec["quantize"] == "nf4"
    base, tuned = run_eval_losses(run)
    # measured (CPU, jax 0.10.2): 6.90 (the random base) -> 4.13 nats/token after 40 steps
    assert tuned < base - 0.3, (base, tuned)


@pytest.mark.slow  # a second 20-step run: ~25 s on 2 cores
def test_resume_with_changed_base_weights_exits_2(qlora, tmp_path, capsys):
    hf, out = qlora
    import shutil
    moved = tmp_path / "hf"
    shutil.copytree(hf, moved)
    run = tmp_path / "run"
    assert main([*ARGS, "--init-from", str(moved), "--out", str(run), "--stop-at", "20"]) == 0
    params = random_params(CFG)
    params["layers"]["mlp"]["up_proj"] = params["layers"]["mlp"]["up_proj"] + 1e-3
    for f in moved.glob("*.safetensors"):
        f.unlink()
    (moved / "config.json").unlink()
    save_hf(moved, CFG, params, bos_token_id=0, eos_token_id=1)
    capsys.readouterr()
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    with pytest.raises(SystemExit) as e:
        main(["--out", str(run), "--resume"])
    assert e.value.code == 2
    line = error_line(capsys.readouterr().err)
    assert "base weights changed since the run began" in line and str(moved.resolve()) in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def _adapter_logits(run, tokens):
    """jaxmem's forward of the run with its adapters on the fp32 base (no quantization)."""
    from dataclasses import replace
    spec = replace(run.step_config.trainable, quantize="none")
    _, host = run_base(run)
    full = spec.full_params(base_on_device(host, spec, jnp.float32), run.state.params)
    return np.asarray(Decoder(CFG).apply({"params": full}, jnp.asarray(tokens)))


TOKENS = np.random.default_rng(0).integers(0, 300, (2, 24))
# merged vs adapted, jaxmem vs peft, jaxmem vs transformers: one fp32 function in another order
# (tests/numerics.py), with the reduction length of the model's logits
LOGIT_TERMS = model_terms(CFG, TOKENS.shape[1])


@pytest.mark.slow  # 3.0 s cold on 2 cores (default run kept under 5 min)
def test_merge_equals_the_adapter_forward_and_uses_the_original_base(qlora, capsys):
    _, out = qlora
    run = load_run(out)
    merged = merged_params(run)
    assert "into the original base weights of" in capsys.readouterr().out
    got = np.asarray(Decoder(CFG).apply({"params": merged}, jnp.asarray(TOKENS)))
    assert_reordered_fp32(got, _adapter_logits(run, TOKENS), terms=LOGIT_TERMS)


@pytest.mark.torch
def test_peft_loads_the_adapters_onto_the_base_with_the_same_logits(qlora, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from hf_files import peft_model_of_run
    from jaxmem.export.cli import main as export_main

    hf, out = qlora
    adapters = tmp_path / "adapters"
    model = peft_model_of_run(hf, out, adapters)
    names = set(__import__("safetensors.numpy").numpy.load_file(
        str(adapters / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight" in names
    with torch.no_grad():
        got = model(torch.as_tensor(TOKENS)).logits.numpy()
    want = _adapter_logits(load_run(out), TOKENS)
    assert_reordered_fp32(got, want, terms=LOGIT_TERMS)
    with torch.no_grad():
        plain = transformers.LlamaForCausalLM.from_pretrained(str(hf), dtype=torch.float32)(
            torch.as_tensor(TOKENS)).logits.numpy()
    assert np.abs(plain - want).max() > 1e-2  # the adapters changed the logits

    merged_dir = tmp_path / "merged"
    assert export_main(["--run", str(out), "--out", str(merged_dir)]) == 0
    merged = transformers.LlamaForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32)
    with torch.no_grad():
        assert_reordered_fp32(merged(torch.as_tensor(TOKENS)).logits.numpy(), want,
                              terms=LOGIT_TERMS)


@pytest.mark.slow  # 3.0 s cold on 2 cores (default run kept under 5 min)
def test_generate_from_a_lora_run_uses_adapters_on_its_base(qlora, capsys):
    from jaxmem.generate.cli import main as generate_main
    from jaxmem.decode.sampling import generate_text
    from jaxmem.peft.export import lora_params

    _, out = qlora
    capsys.readouterr()
    assert generate_main(["--run", str(out), "--prompt", "def ", "--max-new-tokens", "8",
                          "--temperature", "0"]) == 0
    text = capsys.readouterr().out.strip()
    run = load_run(out)
    want = generate_text(CFG, lora_params(run), run.tokenizer, "def ", 8, temperature=0.0)
    assert text == want.strip() and text.startswith("def")
