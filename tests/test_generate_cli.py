"""`python -m jaxmem.generate` with the KV cache: --prompts-file batches and JSONL, --stop, EOS ids
from generation_config.json, one-line errors (exit 2) naming the file and line.

    python -m pytest -q tests/test_generate_cli.py
"""

from __future__ import annotations

import json

import pytest

from jaxmem.families.config import ModelConfig

from hf_files import random_params, write_tokenizer  # noqa: E402

PROMPTS = ["hello", "the quick brown fox", "hello world, the"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from jaxmem.io.hf_export import save_hf

    d = tmp_path_factory.mktemp("gen")
    vocab = write_tokenizer(d / "tok", "hello world, the quick brown fox " * 50)
    cfg = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=64)
    save_hf(d / "hf", cfg, random_params(cfg), tokenizer=str(d / "tok" / "tokenizer.json"),
            bos_token_id=0, eos_token_id=1)
    return d / "hf"


def _main(argv):
    import jax

    from jaxmem.generate.cli import main
    with jax.default_matmul_precision("highest"):  # fp32 comparisons: no TF32 on a GPU
        return main(argv)


def _error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        _main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m jaxmem.generate: error: "), err
    return err[0]


@pytest.mark.slow  # 3.0 s cold on 2 cores (default run kept under 5 min)
def test_prompts_file_batches_equal_single_prompts_in_input_order(hf_dir, tmp_path, capsys):
    src, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in
                           enumerate(PROMPTS)) + "\n")  # a blank line is skipped
    common = ["--hf", str(hf_dir), "--temperature", "0", "--max-new-tokens", "6",
              "--dtype", "float32"]  # a GPU's default is bf16
    assert _main([*common, "--prompts-file", str(src), "--output", str(out),
                  "--batch-size", "2"]) == 0
    err = capsys.readouterr().err
    assert "tokens/s (float32, KV cache" in err
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == PROMPTS
    for r in rows:
        assert _main([*common, "--prompt", r["prompt"]]) == 0
        alone = capsys.readouterr().out.rstrip("\n")
        assert alone == r["prompt"] + r["completion"]
        assert r["stop"] in ("eos", "length") and 0 < r["new_tokens"] <= 6


def test_stop_string_ends_the_text(hf_dir, tmp_path, capsys):
    common = ["--hf", str(hf_dir), "--temperature", "0", "--max-new-tokens", "8",
              "--dtype", "float32", "--prompt", "hello"]
    assert _main(common) == 0
    full = capsys.readouterr().out.rstrip("\n")
    tail = full[len("hello"):]
    assert len(tail) >= 3
    stop = tail[1:3]
    assert _main([*common, "--stop", stop]) == 0
    assert capsys.readouterr().out.rstrip("\n") == "hello" + tail[:tail.index(stop)]
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "hello"}) + "\n")
    assert _main([*common[:-2], "--stop", stop, "--prompts-file", str(src)]) == 0
    (row,) = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert row["stop"] == "stop" and row["completion"] == tail[:tail.index(stop)]


def test_stop_ids_follow_generation_config_json(hf_dir, tmp_path):
    import shutil

    from jaxmem.decode.stopping import eos_ids
    from jaxmem.io.hf import HFError, hf_tokenizer

    d = tmp_path / "hf"
    shutil.copytree(hf_dir, d)
    assert eos_ids(hf_tokenizer(d)) == (1,)  # config.json's eos_token_id
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7, 9]}))
    assert eos_ids(hf_tokenizer(d)) == (1, 7, 9)  # transformers' generate stops at these
    (d / "generation_config.json").write_text("{not json")
    with pytest.raises(HFError, match="generation_config.json: unreadable"):
        hf_tokenizer(d)


@pytest.mark.parametrize("content,needle", [
    ('{"prompt": "a"}\n{"prompt": \n', "p.jsonl:2: not JSON"),
    ('{"prompt": "a"}\n{"text": "b", "x": 1}\n', 'p.jsonl:2: expected an object with a "prompt" '
                                                 'string, found text, x'),
    ("\n\n", "p.jsonl: no prompts"),
])
def test_bad_prompts_files_exit_2_naming_file_and_line(tmp_path, capsys, content, needle):
    src = tmp_path / "p.jsonl"
    src.write_text(content)
    err = _error(["--hf", str(tmp_path / "nowhere"), "--prompts-file", str(src)], capsys)
    assert needle in err, err


def test_output_needs_prompts_file(tmp_path, capsys):
    err = _error(["--hf", str(tmp_path), "--output", str(tmp_path / "o.jsonl")], capsys)
    assert "--output needs --prompts-file" in err


def test_a_lora_run_builds_its_quantized_base_once_for_all_prompts(tmp_path, monkeypatch,
                                                                   capsys):
    """generate --run on a LoRA run: `lora_params` (which quantizes the base onto the device)
    runs once per call, whatever the number of prompts and batches."""
    from types import SimpleNamespace

    import jax
    import jax.numpy as jnp

    import jaxmem.generate.cli as cli
    import jaxmem.peft.export as peft_export
    from jaxmem.peft.lora import LoraSpec
    from jaxmem.config.run import RunConfig
    from jaxmem.data import ByteTokenizer
    from jaxmem.families.params import init_params

    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, max_position_embeddings=32)
    params = init_params(cfg, jax.random.PRNGKey(0))
    run = SimpleNamespace(state=SimpleNamespace(params=None), model_config=cfg,
                          tokenizer=ByteTokenizer(), config=RunConfig(),
                          step_config=SimpleNamespace(trainable=LoraSpec(4), precision=SimpleNamespace(
                              compute_dtype=jnp.float32)))
    built = []
    monkeypatch.setattr(cli, "load_run", lambda path, step=None: run)
    monkeypatch.setattr(peft_export, "lora_params", lambda r: built.append(r) or params)
    src = tmp_path / "p.jsonl"
    # four prompts of one length: four batches, one compile
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in "abcd"))
    assert cli.main(["--run", "x", "--prompts-file", str(src), "--batch-size", "1",
                     "--max-new-tokens", "2", "--temperature", "0"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 4
    assert built == [run]
