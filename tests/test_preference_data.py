"""Preference pairs (jaxmem.data.preference) against TRL 1.16's own trainers.

The reference is what TRL's trainers make of the same rows with the same tokenizer files
(tests/tokenizer_layouts.py: Llama 3.1 Instruct, Qwen2.5 Instruct and SmolLM2 Instruct layouts,
their real chat templates): DPOTrainer's processed train_dataset put through its own collator
(DataCollatorForPreference, which truncates to max_length), and CPOTrainer's / ORPOTrainer's
processed train_dataset (chosen / rejected input ids and labels, truncated by their tokenize_row).
Each sequence is compared token for token, with the positions whose log-probs TRL counts, against
jaxmem's eval batch row (inputs, targets, mask). A negative control shows the comparison fails
when the prompt's targets are counted too. Then the bad-input messages (file, line, key), the
batch layout (interleaved pairs, masks, padding pairs) and the determinism of batch_at.
"""

import copy
import json

import numpy as np
import pytest

from jaxmem.families.config import BYTE_VOCAB_SIZE
from jaxmem.data import (ByteTokenizer, DataError, PreferencePairs, epoch_permutation, load_corpus,
                         load_preferences, split_eval_batches, train_batcher)

SYSTEM = {"role": "system", "content": "You are a concise assistant."}


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


STANDARD = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green, and so is the grass."},
    {"prompt": "Hello ", "chosen": "world", "rejected": "there"},  # the prompt's space merges
    {"prompt": "What is the capital of France?", "chosen": " Paris.", "rejected": " Lyon."},
]
STANDARD_IMPLICIT = [
    {"chosen": "The sky is blue.", "rejected": "The sky is green."},  # TRL moves the space back
    {"chosen": "Hello world", "rejected": "Hello there"},
]
CONVERSATIONAL = [
    {"prompt": [SYSTEM, user("What is the capital of France?")],
     "chosen": [assistant("Paris.")], "rejected": [assistant("Lyon, I think.")]},
    {"prompt": [user("And how many legs does a spider have?"), assistant("Eight."),
                user("Say hello in Japanese.")],
     "chosen": [assistant("こんにちは!")], "rejected": [assistant("Hola.")]},
    {"prompt": [user("Finish the sentence."), assistant("The quick brown fox")],  # continued
     "chosen": [assistant("jumps over the lazy dog.")], "rejected": [assistant("sleeps.")]},
]
CONVERSATIONAL_IMPLICIT = [
    {"chosen": [user("What is the capital of France?"), assistant("Paris.")],
     "rejected": [user("What is the capital of France?"), assistant("Lyon.")]},
    {"chosen": [SYSTEM, user("Hello"), assistant("Hi!"), user("A spider's legs?"),
                assistant("8 legs.")],
     "rejected": [SYSTEM, user("Hello"), assistant("Hi!"), user("A spider's legs?"),
                  assistant("Six.")]},
]
FORMATS = {"standard": STANDARD, "standard-implicit": STANDARD_IMPLICIT,
           "conversational": CONVERSATIONAL, "conversational-implicit": CONVERSATIONAL_IMPLICIT}
LAYOUT_NAMES = ("llama3.1-instruct", "qwen2.5-instruct", "smollm2-instruct")


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- TRL's side


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    pytest.importorskip("transformers")  # write_layout writes the family's config with its class
    from tokenizer_layouts import write_layout

    root = tmp_path_factory.mktemp("layouts")
    return {name: write_layout(name, root / name) for name in LAYOUT_NAMES}


def _trl_trainer(info, rows, style, max_length, out_dir):
    """TRL's trainer of `style` ("dpo", "cpo" or "orpo") built on `rows` (a tiny random model)."""
    pytest.importorskip("trl")
    pytest.importorskip("torch")
    import torch
    import transformers
    from datasets import Dataset

    tok = transformers.AutoTokenizer.from_pretrained(info.directory)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(info.directory))
    common = dict(output_dir=str(out_dir), report_to="none", bf16=False, use_cpu=True,
                  max_length=max_length, disable_tqdm=True)
    dataset = Dataset.from_list([copy.deepcopy(r) for r in rows])
    if style == "dpo":
        from trl import DPOConfig, DPOTrainer

        return DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=DPOConfig(**common),
                          train_dataset=dataset, processing_class=tok)
    if tok.pad_token is None:  # CPO / ORPO's collator wants a pad id before they set one
        tok.pad_token = tok.eos_token
    common["remove_unused_columns"] = False
    if style == "cpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        return CPOTrainer(model=model, args=CPOConfig(**common), train_dataset=dataset,
                          processing_class=tok)
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    return ORPOTrainer(model=model, args=ORPOConfig(**common), train_dataset=dataset,
                       processing_class=tok)


def trl_sequences(info, rows, style, max_length, out_dir):
    """[(chosen (ids, counted), rejected (ids, counted)), ...] for the pairs TRL trains on:
    counted[j] says whether the log-prob of token j + 1 counts (TRL's completion mask / labels).
    CPO / ORPO keep a pair whose prompt fills max_length with an empty completion; it is left
    out here (nothing counts in it), as jaxmem leaves it out."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _trl_trainer(info, rows, style, max_length, out_dir)
    data = trainer.train_dataset
    out = []
    if style == "dpo":
        examples = [data[i] for i in range(len(data))]
        batch = trainer.data_collator(examples)  # DataCollatorForPreference: truncates
        n = len(examples)
        for i in range(n):
            pair = []
            for r in (i, n + i):
                length = int(batch["attention_mask"][r].sum())
                pair.append(([int(x) for x in batch["input_ids"][r, :length]],
                             [int(x) for x in batch["completion_mask"][r, 1:length]]))
            out.append(tuple(pair))
        return out, examples
    for i in range(len(data)):
        pair = tuple(([int(x) for x in data[i][f"{side}_input_ids"]],
                      [int(x != -100) for x in data[i][f"{side}_labels"][1:]])
                     for side in ("chosen", "rejected"))
        if all(sum(counted) for _, counted in pair):
            out.append(pair)
    return out, [data[i] for i in range(len(data))]


# ----------------------------------------------------------------------------- jaxmem's side


def jaxmem_tok(info):
    from jaxmem.io.hf import hf_tokenizer

    return hf_tokenizer(info.directory)


def jaxmem_sequences(train: PreferencePairs, seq_len, pad_id, count="mask"):
    """The same list from jaxmem's eval batch of all pairs: ids = inputs[0] + the real targets,
    counted = `count` ("mask"; "real" for the negative control) over those targets."""
    (batch,) = train.eval_batches(len(train), seq_len, None, pad_id)
    out = []
    for i in range(len(train)):
        pair = []
        for r in (2 * i, 2 * i + 1):
            n = int(batch["real"][r].sum())
            assert batch["real"][r].tolist() == [1] * n + [0] * (seq_len - n)
            ids = [int(batch["inputs"][r, 0])] + [int(x) for x in batch["targets"][r, :n]]
            assert batch["inputs"][r, :n].tolist() == ids[:-1]
            pair.append((ids, [int(x) for x in batch[count][r, :n]]))
        out.append(tuple(pair))
    return out


def load(tmp_path, info, rows, style, seq_len, **kw):
    tok = jaxmem_tok(info)
    path = write_rows(tmp_path / "pairs.jsonl", rows)
    train, evals, stats = load_preferences([path], tok, info.model_vocab_size, seq_len=seq_len,
                                           eval_fraction=0.0, style=style, **kw)
    assert len(evals) == 0 and stats["eval_pairs"] == 0
    return train, stats, tok


# ----------------------------------------------------------------------------- against TRL


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dpo_tokenization_is_trls(tmp_path, layouts, layout, fmt):
    info, rows = layouts[layout], FORMATS[fmt]
    ref, examples = trl_sequences(info, rows, "dpo", None, tmp_path / "out")
    train, stats, tok = load(tmp_path, info, rows, "dpo", seq_len=1023)  # TRL's default 1024
    assert len(train) == len(rows) == len(ref) and stats["left_out"]["prompt_too_long"] == 0
    for i, ex in enumerate(examples):  # the split itself: DPO's prompt_ids / chosen_ids / ...
        assert train.prompt[i].tolist() == ex["prompt_ids"]
        assert train.chosen[i].tolist() == ex["chosen_ids"]
        assert train.rejected[i].tolist() == ex["rejected_ids"]
    assert not train.untrained.any()
    assert jaxmem_sequences(train, 1023, tok.pad_id) == ref
    # negative control: counting the prompt's targets too is not what TRL sums
    assert jaxmem_sequences(train, 1023, tok.pad_id, count="real") != ref


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_cpo_tokenization_is_trls_and_orpos(tmp_path, layouts, layout, fmt):
    info, rows = layouts[layout], FORMATS[fmt]
    ref, examples = trl_sequences(info, rows, "cpo", 1024, tmp_path / "cpo")
    orpo, orpo_examples = trl_sequences(info, rows, "orpo", 1024, tmp_path / "orpo")
    assert orpo == ref and orpo_examples == examples  # ORPO tokenizes as CPO does
    train, stats, tok = load(tmp_path, info, rows, "cpo", seq_len=1023)
    assert len(train) == len(rows) == len(ref)
    got = jaxmem_sequences(train, 1023, tok.pad_id)
    assert got == ref
    assert jaxmem_sequences(train, 1023, tok.pad_id, count="real") != ref
    completion = sum(sum(c) for pair in ref for _, c in pair)
    prompt = sum(len(c) - sum(c) for pair in ref for _, c in pair)
    assert train.target_counts() == (completion, prompt) == (
        stats["completion_tokens"], stats["prompt_tokens"])


def test_cpo_merge_makes_the_sides_prompts_differ(tmp_path, layouts):
    """"Hello " + "world" / "there": Llama 3's pre-tokenizer keeps " " apart before "world" but
    merges it into " there", so TRL's chosen prompt part is one id longer (build_tokenized_answer);
    jaxmem keeps that id out of the chosen mask (untrained) and DPO trains it."""
    info = layouts["llama3.1-instruct"]
    rows = [STANDARD[1]]
    ref, _ = trl_sequences(info, rows, "cpo", 64, tmp_path / "cpo")
    train, _, tok = load(tmp_path, info, rows, "cpo", seq_len=63)
    (chosen, rejected), = ref
    assert chosen[1].index(1) != rejected[1].index(1)  # the premise: the prompt parts differ
    assert train.untrained[0].tolist() in ([1, 0], [0, 1])
    assert jaxmem_sequences(train, 63, tok.pad_id) == ref


@pytest.mark.parametrize("style", ["dpo", "cpo"])
@pytest.mark.parametrize("layout,fmt", [("llama3.1-instruct", "standard"),
                                        ("qwen2.5-instruct", "conversational")])
def test_truncation_is_trls(tmp_path, layouts, style, layout, fmt):
    """max_length = --seq-len + 1, chosen between the prompt lengths so that the longest prompt
    fills it (TRL's DPO drops that pair, CPO leaves it no completion: left out) and the next
    pair keeps 2 completion tokens (cut)."""
    info, rows = layouts[layout], FORMATS[fmt]
    full, _, tok = load(tmp_path, info, rows, style, seq_len=1023)
    prompts = sorted(len(p) + int(u.max()) for p, u in zip(full.prompt, full.untrained))
    max_length = prompts[-2] + 2
    assert max_length <= prompts[-1]  # the premise
    ref, _ = trl_sequences(info, rows, style if style == "dpo" else "cpo", max_length,
                           tmp_path / "out")
    train, stats, _ = load(tmp_path, info, rows, style, seq_len=max_length - 1)
    assert len(ref) == len(train) == len(rows) - 1
    assert stats["left_out"] == {"prompt_too_long": 1, "no_completion_tokens": 0}
    got = jaxmem_sequences(train, max_length - 1, tok.pad_id)
    assert got == ref
    assert any(len(ids) == max_length for pair in got for ids, _ in pair)  # some were cut
    lengths = [len(full.prompt[i]) + len(full.chosen[i]) for i in range(len(full))]
    assert max(lengths) > max_length


def test_max_prompt_length_keeps_the_prompts_end(tmp_path, layouts):
    """jaxmem's max_prompt_length (TRL 1.16 has none): the last P prompt ids, before max_length;
    a pair whose prompt alone filled max_length is kept once its prompt is cut."""
    info = layouts["llama3.1-instruct"]
    full, _, _ = load(tmp_path, info, STANDARD, "dpo", seq_len=1023)
    p = 4
    cut, stats, _ = load(tmp_path, info, STANDARD, "dpo", seq_len=1023, max_prompt_length=p)
    assert stats["max_prompt_length"] == p
    for i in range(len(full)):
        assert cut.prompt[i].tolist() == full.prompt[i][-p:].tolist()
        assert cut.chosen[i].tolist() == full.chosen[i].tolist()
    longest = max(len(x) for x in full.prompt)
    dropped, stats, _ = load(tmp_path, info, STANDARD, "dpo", seq_len=longest - 1)
    assert stats["left_out"]["prompt_too_long"] == 1
    kept, stats, _ = load(tmp_path, info, STANDARD, "dpo", seq_len=longest - 1,
                          max_prompt_length=longest - 2)
    assert stats["left_out"]["prompt_too_long"] == 0 and len(kept) == len(STANDARD)


def test_json_and_parquet_rows_read_as_jsonl_rows(tmp_path, layouts):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    info = layouts["qwen2.5-instruct"]
    tok = jaxmem_tok(info)
    (tmp_path / "p.json").write_text(json.dumps(CONVERSATIONAL), encoding="utf-8")
    pq.write_table(pa.Table.from_pylist(CONVERSATIONAL), tmp_path / "p.parquet")
    splits = [load_preferences([tmp_path / name], tok, info.model_vocab_size, seq_len=255,
                               eval_fraction=0.0, style="cpo")[0]
              for name in ("p.json", "p.parquet")]
    reference, _, _ = load(tmp_path, info, CONVERSATIONAL, "cpo", seq_len=255)
    for split in splits:
        for a, b in zip((split.prompt, split.chosen, split.rejected),
                        (reference.prompt, reference.chosen, reference.rejected)):
            assert [x.tolist() for x in a] == [x.tolist() for x in b]


# ----------------------------------------------------------------------------- bad input


def _load_bytes(path, style="dpo", **kw):
    return load_preferences([path], ByteTokenizer(), BYTE_VOCAB_SIZE, seq_len=64,
                            eval_fraction=0.0, style=style, **kw)


GOOD = {"prompt": "Q", "chosen": "yes", "rejected": "no"}


@pytest.mark.parametrize("bad,message", [
    ({"prompt": "Q", "chosen": "yes"}, "line 2: a preference row has no 'rejected' field "
                                       "(fields found: prompt, chosen)"),
    ({"prompt": "Q", "rejected": "no"}, "line 2: a preference row has no 'chosen' field"),
    ({"prompt": "Q", "chosen": 3, "rejected": "no"},
     "line 2: field 'chosen' is a int, not a string or a list of {role, content} messages"),
    ({"prompt": "Q", "chosen": "yes", "rejected": ""},
     "line 2: field 'rejected' is an empty string (an empty answer)"),
    ({"prompt": [user("Q")], "chosen": [assistant("yes")], "rejected": [assistant("")]},
     "line 2: rejected message 1 (assistant) has empty content (an empty answer)"),
    ({"prompt": "Q", "chosen": [assistant("yes")], "rejected": [assistant("no")]},
     "line 2: field 'prompt' is a str but 'chosen' is a list"),
    ({"prompt": [user("Q")], "chosen": [{"role": "robot", "content": "x"}], "rejected": []},
     "line 2: chosen message 1 has role 'robot'"),
    ({"text": "plain"}, "line 2: a text row in a file of chosen + rejected rows (since line 1)"),
    ({"chosen": "yes", "rejected": "no"}, "line 2: standard rows without a prompt (implicit) "
                                          "among standard rows with a prompt"),
])
def test_bad_rows_name_file_line_and_key(tmp_path, bad, message):
    path = write_rows(tmp_path / "bad.jsonl", [GOOD, bad])
    with pytest.raises(DataError) as e:
        _load_bytes(path)
    assert str(e.value).startswith(f"{path} ") and message in str(e.value), str(e.value)


def test_sft_rows_for_preference_and_preference_rows_for_sft(tmp_path):
    sft = write_rows(tmp_path / "sft.jsonl", [{"prompt": "Q", "completion": "A"}])
    with pytest.raises(DataError, match=r"sft.jsonl line 1: the data has no chosen / rejected "
                                        r"answers: a prompt \+ completion row"):
        _load_bytes(sft)
    pref = write_rows(tmp_path / "pref.jsonl", [GOOD])
    with pytest.raises(DataError, match=r"pref.jsonl line 1: a preference row .* train on it "
                                        r"with --objective dpo\|orpo\|simpo"):
        load_corpus(str(pref), ByteTokenizer(), BYTE_VOCAB_SIZE, seq_len=64)
    with pytest.raises(DataError, match="applies to preference rows"):
        load_corpus(str(sft), ByteTokenizer(), BYTE_VOCAB_SIZE, seq_len=64, max_prompt_length=4)
    text = tmp_path / "corpus.txt"
    text.write_text("plain text")
    with pytest.raises(DataError, match="needs prompt \\+ chosen \\+ rejected rows .*corpus.txt"):
        load_corpus(str(text), ByteTokenizer(), BYTE_VOCAB_SIZE, seq_len=64, preference="dpo")


def test_message_rows_need_a_chat_template(tmp_path):
    path = write_rows(tmp_path / "chat.jsonl", [CONVERSATIONAL[0]])
    for style in ("dpo", "cpo"):
        with pytest.raises(DataError, match=r"chat.jsonl line 1: chat rows need a chat template "
                                            r"and none was found; give one with --chat-template"):
            _load_bytes(path, style)


def test_implicit_message_rows_need_a_shared_start(tmp_path):
    path = write_rows(tmp_path / "chat.jsonl", [
        {"chosen": [user("A"), assistant("x")], "rejected": [user("B"), assistant("y")]}])
    with pytest.raises(DataError, match="line 1: 'chosen' and 'rejected' share no first message"):
        _load_bytes(path)


def test_every_prompt_too_long_is_an_error(tmp_path):
    path = write_rows(tmp_path / "long.jsonl", [{"prompt": "x" * 80, "chosen": "a",
                                                 "rejected": "b"}])
    with pytest.raises(DataError, match=r"long.jsonl line 1: no preference pairs left .*prompt "
                                        r"alone has --seq-len 64 \+ 1 tokens or more"):
        _load_bytes(path)


# ----------------------------------------------------------------------------- batches

BOS, EOS, PAD = ByteTokenizer.bos_id, ByteTokenizer.eos_id, ByteTokenizer.pad_id
PAIRS = [{"prompt": "ab", "chosen": "cd", "rejected": "efg"},
         {"prompt": "h", "chosen": "ij", "rejected": "k"},
         {"prompt": "lm", "chosen": "n", "rejected": "op"}]


def _b(s):
    return list(s.encode())


@pytest.mark.parametrize("style", ["dpo", "cpo"])
def test_pairs_of_a_byte_tokenizer(tmp_path, style):
    """BOS + prompt, answer + EOS in both styles (bytes never merge)."""
    train, _, stats = _load_bytes(write_rows(tmp_path / "p.jsonl", PAIRS), style)
    assert [p.tolist() for p in train.prompt] == [[BOS, *_b("ab")], [BOS, *_b("h")],
                                                  [BOS, *_b("lm")]]
    assert [c.tolist() for c in train.chosen] == [[*_b("cd"), EOS], [*_b("ij"), EOS],
                                                  [*_b("n"), EOS]]
    assert [r.tolist() for r in train.rejected] == [[*_b("efg"), EOS], [*_b("k"), EOS],
                                                    [*_b("op"), EOS]]
    assert train.target_counts() == (3 + 4 + 3 + 2 + 2 + 3, 2 * 2 + 2 * 1 + 2 * 2)
    assert stats["format"] == "preference" and stats["style"] == style and stats["pairs"] == 3


def test_batch_layout_interleaves_pairs_with_masks_and_padding_pairs(tmp_path):
    train, _, _ = _load_bytes(write_rows(tmp_path / "p.jsonl", PAIRS))
    t = 6
    first, second = train.eval_batches(2, t, None, PAD)
    assert set(first) == {"inputs", "targets", "mask", "real"}
    assert all(v.shape == (4, t) and v.dtype == np.int32 for v in first.values())
    a, b, c, d, e, f, g = _b("abcdefg")
    # pair 0, chosen: BOS a b | c d EOS
    assert first["inputs"][0].tolist() == [BOS, a, b, c, d, PAD]
    assert first["targets"][0].tolist() == [a, b, c, d, EOS, PAD]
    assert first["mask"][0].tolist() == [0, 0, 1, 1, 1, 0]
    assert first["real"][0].tolist() == [1, 1, 1, 1, 1, 0]
    # pair 0, rejected: BOS a b | e f g EOS (fills the row: T + 1 tokens)
    assert first["inputs"][1].tolist() == [BOS, a, b, e, f, g]
    assert first["targets"][1].tolist() == [a, b, e, f, g, EOS]
    assert first["mask"][1].tolist() == [0, 0, 1, 1, 1, 1]
    assert first["real"][1].tolist() == [1] * 6
    # pair 1 in rows 2, 3; eval's last batch: pair 2, then a padding pair
    assert first["inputs"][2, :3].tolist() == [BOS, *_b("hi")]
    assert second["inputs"][0, :3].tolist() == [BOS, *_b("lm")]
    for r in (2, 3):
        assert (second["inputs"][r] == PAD).all() and (second["targets"][r] == PAD).all()
        assert not second["mask"][r].any() and not second["real"][r].any()
    assert len(train.eval_batches(2, t, 1, PAD)) == 1
    with pytest.raises(DataError, match="does not fit --seq-len 5"):
        train.eval_batches(2, 5, None, PAD)


def test_batch_at_is_a_function_of_seed_and_position(tmp_path):
    rows = [{"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"r{i}!"} for i in range(7)]
    train, _, _ = _load_bytes(write_rows(tmp_path / "p.jsonl", rows))
    one, other = train.batcher(3, 8, 5, PAD), train.batcher(3, 8, 5, PAD)
    for pos in (4, 0, 9, 4):
        x, y = one.batch_at(pos), other.batch_at(pos)
        assert all(np.array_equal(x[k], y[k]) for k in x)
    assert one.epoch(7) == 3 * 7 / 7
    # batch 3 holds samples 9, 10, 11: epoch 1's pairs 2, 3, 4 in its permutation's order
    order = epoch_permutation(5, 1, 7)[2:5]
    batch = one.batch_at(3)
    for j, i in enumerate(order):
        chosen, rejected = train.rows(int(i), 8, PAD)
        assert np.array_equal(batch["inputs"][2 * j], chosen["inputs"])
        assert np.array_equal(batch["mask"][2 * j + 1], rejected["mask"])
    assert not np.array_equal(train.batcher(3, 8, 6, PAD).batch_at(3)["inputs"], batch["inputs"])


def test_load_corpus_routes_preference_rows(tmp_path):
    rows = [{"prompt": f"question {i}", "chosen": " yes", "rejected": " no"} for i in range(10)]
    path = write_rows(tmp_path / "p.jsonl", rows)
    opts = dict(seq_len=32, preference="cpo", chat_template=None, data_field=None,
                train_on="assistant", truncate="split", pack=True)
    train, evals, stats = load_corpus(str(path), ByteTokenizer(), BYTE_VOCAB_SIZE,
                                      eval_fraction=0.2, **opts)
    assert isinstance(train, PreferencePairs) and (len(train), len(evals)) == (8, 2)
    assert (stats["train_pairs"], stats["eval_pairs"], stats["source"]) == (8, 2, str(path))
    assert [e.tolist() for e in evals.prompt] == [[BOS, *_b(f"question {i}")] for i in (8, 9)]
    batch = train_batcher(train, 2, 32, 0, pad_id=PAD).batch_at(0)
    assert batch["inputs"].shape == (4, 32)
    (ev,) = split_eval_batches(evals, 2, 32, pad_id=PAD)
    assert ev["targets"][1, :len("question 8 no") + 1].tolist() == [*_b("question 8 no"), EOS]
    held = write_rows(tmp_path / "held.jsonl", rows[:3])
    train, evals, stats = load_corpus(str(path), ByteTokenizer(), BYTE_VOCAB_SIZE,
                                      eval_fraction=0.2, eval_data=str(held), **opts)
    assert (len(train), len(evals), stats["eval_pairs"]) == (10, 3, 3)
    assert stats["eval_completion_tokens"] == evals.target_counts()[0]
