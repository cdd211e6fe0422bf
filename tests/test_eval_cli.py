"""`python -m jaxmem.eval`: a run's logged eval_loss is what the command computes on the same data
and weights (a full run on text; a QLoRA run on chat rows, masks and adapters included);
a Hugging Face checkpoint's loss is transformers' on the same token windows; the batches are
the trainer's; bad input exits 2 with one line.
"""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from jaxmem.data import load_corpus, load_tokenizer, split_eval_batches
from jaxmem.eval.cli import main as eval_main
from jaxmem.train.cli import main as train_main
from jaxmem.train.evaluate import EvalBatches

from runs import SMALL  # noqa: E402
from numerics import assert_reordered_fp32, largest_allowed, model_terms  # noqa: E402

ERROR = "python -m jaxmem.eval: error: "


def evaluated(tmp_path, *argv) -> dict:
    """The command's --json record."""
    out = tmp_path / "eval.json"
    assert eval_main([*argv, "--json", str(out), "--no-progress"]) == 0
    return json.loads(out.read_text())


def logged_eval_loss(run) -> float:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "eval_loss" in r][-1]["eval_loss"]


@pytest.fixture(scope="module")
def text_run(tmp_path_factory, corpus):
    """A 3-step byte-level run whose held-out data is held.txt, all of it evaluated: its
    --eval-batches 8 covers every batch of held.txt (3 of 4 x 32)."""
    d = tmp_path_factory.mktemp("evalrun")
    held = d / "held.txt"
    held.write_text("def held_out(x):\n    return [y * 2 for y in x if y]\n" * 6)
    assert train_main([*SMALL, "--data", corpus, "--eval-data", str(held), "--out", str(d / "run"),
                       "--steps", "3", "--eval-every", "3", "--eval-batches", "8"]) == 0
    return d / "run", held


def test_eval_of_a_run_equals_its_logged_eval_loss(text_run, tmp_path, capsys):
    run, held = text_run
    capsys.readouterr()
    got = evaluated(tmp_path, "--run", str(run), "--data", str(held))
    # the same batches through the same eval function and sum: the same number
    assert got["loss"] == logged_eval_loss(run)
    n_bytes = len(held.read_bytes())
    assert got["tokens"] == n_bytes + 1  # BOS + bytes + EOS: every target of the stream
    assert (got["batches"], got["batch_size"], got["seq_len"]) == (3, 4, 32)  # the run's shape
    np.testing.assert_allclose(got["perplexity"], math.exp(got["loss"]), rtol=1e-12)
    np.testing.assert_allclose(got["bits_per_byte"], got["loss"] / math.log(2), rtol=1e-12)
    assert (got["source"], got["step"], got["precision"], got["mesh"]) == ("run", 3, "fp32", None)
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"eval: {run} (step 3) on {held}: loss {got['loss']:.4f}, perplexity")
    assert f"; {n_bytes + 1} target tokens in 3 batches of 4 x 32 (fp32)" in line
    # another batch shape: the same windows regrouped (one per batch), the same mean to rounding
    one = evaluated(tmp_path, "--run", str(run), "--data", str(held), "--batch-size", "1")
    assert (one["batches"], one["tokens"]) == (10, got["tokens"])
    np.testing.assert_allclose(one["loss"], got["loss"], rtol=1e-6)


@pytest.mark.slow  # a subprocess on 2 simulated devices: ~6 s on 2 cores
def test_eval_on_a_mesh_equals_one_device(text_run, tmp_path):
    """--mesh fsdp=2 (the params split, the trainer's sharded eval function): one device's
    loss, to fp32 reordering."""
    from testenv import subprocess_env

    run, held = text_run
    out = tmp_path / "mesh.json"
    p = subprocess.run([sys.executable, "-m", "jaxmem.eval", "--run", str(run), "--data",
                        str(held), "--mesh", "fsdp=2", "--json", str(out), "--no-progress"],
                       env=subprocess_env(cpu_devices=2), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    got = json.loads(out.read_text())
    assert got["tokens"] == len(held.read_bytes()) + 1 and got["mesh"] == {"fsdp": 2}
    assert_reordered_fp32(np.float32(got["loss"]), np.float32(logged_eval_loss(run)))


def test_eval_batches_are_the_trainers(tmp_path):
    """EvalBatches' batch i is split_eval_batches' i-th, for a token stream and packed rows."""
    pytest.importorskip("jinja2")
    from chat_files import CHAT_FILE, write_chat_tokenizer

    stream = np.arange(2, 2 + 301, dtype=np.int32) % 250
    tok = load_tokenizer(write_chat_tokenizer(tmp_path / "tok"))
    packed, _, _ = load_corpus(str(CHAT_FILE), tok, 400, eval_fraction=0.0, seq_len=64)
    for split, T in ((stream, 32), (stream[:33], 32), (stream[:34], 32), (packed, 64)):
        want = split_eval_batches(split, 3, T, None, pad_id=1)
        got = EvalBatches(split, 3, T, 1)
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):
            assert g.keys() == w.keys()
            for k in w:
                np.testing.assert_array_equal(g[k], w[k])
    assert len(EvalBatches(stream, 3, 32, 1, max_batches=2)) == 2


@pytest.mark.slow  # a QLoRA run on chat rows and three evals: 12.6 s cold on 2 cores
def test_qlora_chat_run_eval_equals_its_logged_eval_loss(tmp_path, capsys):
    """Chat rows (loss on the assistant turns), packed; the run's adapters on its NF4 base."""
    pytest.importorskip("jinja2")
    from chat_files import CHAT_FILE, write_chat_tokenizer
    from hf_files import random_params

    from jaxmem.families import PRESETS
    from jaxmem.io.hf_export import save_hf

    cfg = PRESETS["tiny"].replace(vocab_size=400, hidden_size=64, intermediate_size=128,
                                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                  max_position_embeddings=256)
    tok = write_chat_tokenizer(tmp_path / "tok")
    ids = {t["content"]: t["id"] for t in json.loads(tok.read_text())["added_tokens"]}
    hf = tmp_path / "hf"
    save_hf(hf, cfg, random_params(cfg), tokenizer=str(tok),
            bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|eot_id|>"])
    run = tmp_path / "run"
    quant = ["--quantize-base", "nf4", "--double-quant"]
    assert train_main(["--init-from", str(hf), "--lora-rank", "8", *quant, "--lr", "1e-2",
                       "--data", str(CHAT_FILE), "--eval-data", str(CHAT_FILE),
                       "--batch-size", "4", "--seq-len", "128", "--steps", "4",
                       "--warmup-steps", "1", "--eval-every", "4", "--eval-batches", "50",
                       "--sample-tokens", "0", "--no-progress", "--out", str(run)]) == 0
    stats = json.loads((run / "config.json").read_text())["data_stats"]
    got = evaluated(tmp_path, "--run", str(run), "--data", str(CHAT_FILE))
    assert got["loss"] == logged_eval_loss(run)
    assert got["tokens"] == stats["eval_trained_tokens"]  # the assistant turns' targets only
    assert "bits_per_byte" not in got  # a BPE tokenizer: bits per byte is not known
    # the same rows with every target: another mask, more tokens, another loss
    every = evaluated(tmp_path, "--run", str(run), "--data", str(CHAT_FILE), "--train-on", "all")
    assert every["tokens"] > got["tokens"] and abs(every["loss"] - got["loss"]) > 0.05
    # the base alone (--hf, quantized as the run's base): the adapters' 4 steps moved the loss
    base = evaluated(tmp_path, "--hf", str(hf), "--data", str(CHAT_FILE), *quant,
                     "--batch-size", "4", "--seq-len", "128")
    assert base["tokens"] == got["tokens"] and base["quantize_base"] == "nf4"
    assert got["loss"] < base["loss"] - 0.1, (base["loss"], got["loss"])


@pytest.mark.torch
def test_hf_eval_equals_transformers_loss(tmp_path):
    """--hf on a tiny random LlamaForCausalLM: the mean loss over the stride-T windows of the
    document (BOS + text + EOS as transformers' tokenizer gives them) that torch computes; and
    the eval_loss jaxmem.train logs for the same weights and data."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from hf_files import SPECIALS, write_tokenizer

    text = "def main():\n    return sum(i * i for i in range(10))\n" * 5
    hf = tmp_path / "hf"
    vocab = write_tokenizer(hf, text * 20)
    (hf / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0],
         "eos_token": SPECIALS[1]}))
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # init's std 0.02 makes near-uniform logits: use larger weights
        for p in model.parameters():
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.uniform_(0.8, 1.2)
    model.save_pretrained(hf)
    data = tmp_path / "text.txt"
    data.write_text(text)
    T = 16
    got = evaluated(tmp_path, "--hf", str(hf), "--data", str(data), "--batch-size", "2",
                    "--seq-len", str(T))

    hf_tok = transformers.AutoTokenizer.from_pretrained(hf)
    stream = hf_tok(text)["input_ids"] + [hf_tok.eos_token_id]
    assert stream[0] == hf_tok.bos_token_id
    losses = []  # every target's loss, window by window (stride T, T + 1 tokens each)
    with torch.no_grad():
        for start in range(0, len(stream) - 1, T):
            w = torch.tensor([stream[start:start + T + 1]])
            logits = model(w[:, :-1]).logits[0]
            losses.append(torch.nn.functional.cross_entropy(logits, w[0, 1:], reduction="none"))
    per_token = torch.cat(losses).double().numpy()
    assert got["tokens"] == per_token.size == len(stream) - 1
    assert got["batches"] == math.ceil(len(losses) / 2)
    want = per_token.mean()
    terms = model_terms(config, T, loss=True)
    assert_reordered_fp32(np.float32(got["loss"]), np.float32(want), terms=terms)
    # negative control: the same windows without the last one's targets fall outside it
    assert abs(per_token[:-(per_token.size % T or T)].mean() - want) > largest_allowed(want, terms)
    # and jaxmem.train --init-from logs the same eval_loss for these weights (lr 0) and data
    run = tmp_path / "run"
    assert train_main(["--init-from", str(hf), "--data", str(data), "--eval-data", str(data),
                       "--out", str(run), "--steps", "1", "--lr", "0", "--min-lr", "0",
                       "--warmup-steps", "0", "--batch-size", "2", "--seq-len", str(T),
                       "--eval-batches", "1000", "--sample-tokens", "0", "--no-progress",
                       "--no-tensorboard"]) == 0
    assert logged_eval_loss(run) == got["loss"]


@pytest.mark.parametrize("argv, needle", [
    ([], "give one of --run DIR or --hf HF_DIR"),
    (["--run", "{d}", "--hf", "{d}", "--data", "{d}/a.txt"], "not both"),
    (["--run", "{d}/missing", "--data", "{d}/a.txt"], "--run {d}/missing: no such directory"),
    (["--hf", "{d}/missing", "--data", "{d}/a.txt"], "--hf {d}/missing: no such directory"),
    (["--run", "{d}"], "--data is required"),
    (["--run", "{d}", "--data", "{d}/none.txt"], "data file not found: {d}/none.txt"),
    (["--run", "{d}", "--data", "{d}/a.txt"], "{d}/config.json: no run config here"),
    (["--hf", "{d}", "--data", "{d}/a.txt"], "{d}: no config.json"),
    (["--hf", "{d}", "--data", "{d}/a.txt", "--step", "3"], "--step needs --run"),
    (["--run", "{d}", "--data", "{d}/a.txt", "--quantize-base", "nf4"],
     "--quantize-base is for --hf"),
    (["--hf", "{d}", "--data", "{d}/a.txt", "--double-quant"],
     "--double-quant needs --quantize-base"),
    (["--run", "{d}", "--data", "{d}/a.txt", "--json", "{d}/no/x.json"], "--json {d}/no/x.json"),
    (["--run", "{d}", "--data", "{d}/a.txt", "--batch-size", "0"], "--batch-size"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, needle):
    (tmp_path / "a.txt").write_text("some text\n")
    argv = [a.replace("{d}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as e:
        eval_main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(ERROR), err
    assert needle.replace("{d}", str(tmp_path)) in err, err
