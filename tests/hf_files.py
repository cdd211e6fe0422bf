"""Tiny Hugging Face checkpoint directories for the HF tests (imported by name, like runs.py)."""

from pathlib import Path

import numpy as np
import pytest

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"]


def write_tokenizer(d, text: str, vocab_size: int = 300) -> int:
    """A byte-level BPE tokenizer.json trained on `text`, whose post-processor adds BOS as Llama
    3's does; returns its vocabulary size (with the special tokens)."""
    # the `hf` extra: a test that builds a checkpoint skips without it
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = tok.token_to_id(SPECIALS[0])
    tok.post_processor = processors.TemplateProcessing(single=f"{SPECIALS[0]} $A",
                                                       special_tokens=[(SPECIALS[0], bos)])
    Path(d).mkdir(parents=True, exist_ok=True)
    tok.save(str(Path(d) / "tokenizer.json"))
    return tok.get_vocab_size()


def random_params(config, seed=0):
    """Random params with the model's tree (norm scales near 1, weights ~ fan_in^-1/2)."""
    import jax

    from jaxmem.families.params import abstract_params

    rng = np.random.default_rng(seed)

    def leaf(path, s):
        x = rng.standard_normal(s.shape).astype(np.float32)
        return 1 + 0.1 * x if "scale" in jax.tree_util.keystr(path) else x * 0.2

    return jax.tree_util.tree_map_with_path(leaf, abstract_params(config))


def peft_model_of_run(hf_dir, run_dir, out_dir):
    """A LoRA run's adapters exported in PEFT's layout to `out_dir` (jaxmem.export
    --adapters-only) and loaded by peft onto the HF base in `hf_dir`, fp32, eval mode."""
    import peft
    import torch
    import transformers

    from jaxmem.export.cli import main as export_main

    assert export_main(["--run", str(run_dir), "--out", str(out_dir), "--adapters-only"]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, str(out_dir)).eval()


def run_eval_losses(run) -> tuple[float, float]:
    """lora_eval_losses of a LoRA run on its own eval batches (its corpus, tokenizer, shape)."""
    from jaxmem.data import eval_batches, load_corpus  # noqa: PLC0415

    cfg = run.config
    _, ev, _ = load_corpus(cfg.data.data, run.tokenizer, run.step_config.model.vocab_size,
                           seq_len=cfg.data.seq_len)
    batches = eval_batches(ev, cfg.data.batch_size, cfg.data.seq_len, cfg.run.eval_batches,
                           pad_id=run.tokenizer.pad_id)
    return lora_eval_losses(run, batches)


def lora_eval_losses(run, batches) -> tuple[float, float]:
    """(mean eval loss with every lora_b zeroed, i.e. the frozen base alone; with the trained
    adapters) of a loaded LoRA run on `batches`, through the run's own eval function."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from jaxmem.peft.base import base_on_device  # noqa: PLC0415
    from jaxmem.peft.export import run_base  # noqa: PLC0415
    from jaxmem.train.run import make_eval_fn  # noqa: PLC0415

    _, host = run_base(run)
    frozen = base_on_device(host, run.step_config.trainable, jnp.float32)
    eval_fn = make_eval_fn(run.step_config)
    zero_b = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.zeros_like(x) if "lora_b" in jax.tree_util.keystr(p) else x,
        run.state.params)

    def loss(adapters):
        totals = [eval_fn(adapters, b, frozen) for b in batches]
        return float(sum(t["loss"] for t, _ in totals) / sum(c["tokens"] for _, c in totals))
    return loss(zero_b), loss(run.state.params)
