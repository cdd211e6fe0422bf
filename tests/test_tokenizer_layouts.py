"""jaxmem's tokenizer loading against transformers, for each model family's real layout (issue 50,
point 2): tests/tokenizer_layouts.py writes a directory per family with its real special tokens,
published tokenizer_config.json settings, real chat template, generation_config.json and
config.json, and each test compares what jaxmem makes of it with what transformers makes of the
same files:

  (a) prompt ids: AutoTokenizer(dir)(text) vs hf_tokenizer(dir).encode_prompt(text), and
      apply_chat_template(one user turn, add_generation_prompt=True) vs ChatPromptTokenizer's;
  (b) the trained-token mask of a 3-turn chat, the reference built as TRL builds it without
      {% generation %} markers: for each assistant message i, the tokens of
      apply_chat_template(msgs[:i], add_generation_prompt=True) are a prefix of those of
      apply_chat_template(msgs[:i + 1]); the positions between are trained;
  (c) stop ids: GenerationConfig.from_pretrained(dir).eos_token_id vs jaxmem's
      eos_ids(tokenizer) (the tokenizer carries its directory's stop ids since the loader
      follows the checkpoint; before, eos_ids(tokenizer, dir) read the directory);
  (d) BOS / EOS / PAD ids: the tokenizer's bos/eos/pad_token_id vs jaxmem's bos/eos/pad_id, with
      jaxmem's documented rule that PAD falls back to EOS where the checkpoint names none;
  (e) a text document: jaxmem's [BOS if the tokenizer adds one] + text + [EOS] starts with
      transformers' tokenizer(text) ids (which hold a BOS only where the checkpoint adds one).

A bare tokenizer.json (special tokens with none of the usual names, no other file) is refused
with the flags that name its tokens, and with them named matches transformers given the same
names. The first test checks the fixture itself: that transformers reads each directory as the
published checkpoint behaves (which BOS/EOS/PAD, whether a BOS is added, which stop ids).
"""

import functools

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")

from tokenizer_layouts import BARE, LAYOUTS, PROMPTS, SYSTEM, TURNS, write_layout  # noqa: E402

# Templates that cannot take a system message without breaking the prefix rule of (b): Mistral
# v0.3's puts it into the last user turn, so msgs[:i] and msgs[:i + 1] render turn i apart.
NO_SYSTEM_IN_MASK = {"mistral-v0.3-instruct"}
# What transformers gives for each published layout, as token strings (the fixture check).
PUBLISHED = {  # name: (bos_token, eos_token, pad_token, adds BOS, stop tokens)
    "llama3.1-instruct": ("<|begin_of_text|>", "<|eot_id|>", None, True,
                          {"<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"}),
    "qwen2.5-instruct": (None, "<|im_end|>", "<|endoftext|>", False,
                         {"<|im_end|>", "<|endoftext|>"}),
    "qwen3": (None, "<|im_end|>", "<|endoftext|>", False, {"<|im_end|>", "<|endoftext|>"}),
    "mistral-v0.3-instruct": ("<s>", "</s>", None, True, {"</s>"}),
    "gemma3-it": ("<bos>", "<eos>", "<pad>", True, {"<eos>", "<end_of_turn>"}),
    "smollm2-instruct": ("<|im_start|>", "<|im_end|>", "<|im_end|>", False, {"<|im_end|>"}),
}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    return {name: write_layout(name, root / name) for name in (*LAYOUTS, BARE)}


@functools.lru_cache(maxsize=None)
def _hf(directory):
    return transformers.AutoTokenizer.from_pretrained(directory)


def hf_tok(info):
    return _hf(str(info.directory))


def jaxmem_tok(info):
    from jaxmem.io.hf import hf_tokenizer

    return hf_tokenizer(info.directory)


def apply(hf, messages, add_generation_prompt=False):
    return list(hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                       tokenize=True, return_dict=False))


def generation_stop_ids(info) -> set:
    ids = transformers.GenerationConfig.from_pretrained(info.directory).eos_token_id
    return set(ids if isinstance(ids, list) else [ids])


def conversation(name):
    return list(TURNS) if name in NO_SYSTEM_IN_MASK else [SYSTEM, *TURNS]


def trl_reference(hf, messages):
    """(ids, trained) as TRL builds them from prefix renderings (module docstring, (b))."""
    ids = apply(hf, messages)
    trained = [False] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = apply(hf, messages[:i], add_generation_prompt=True)
        through = apply(hf, messages[:i + 1])
        assert through[:len(before)] == before, f"message {i}: prefix rule fails"
        assert ids[:len(through)] == through, f"message {i}: not where it is in the whole"
        trained[len(before):len(through)] = [True] * (len(through) - len(before))
    return ids, trained


def jaxmem_row(info, messages):
    from jaxmem.data.chat import find_chat_template
    from jaxmem.data.formats import Row
    from jaxmem.data.masks import encode_row

    tok = jaxmem_tok(info)
    ids, trained = encode_row(Row("messages", messages, "test"), tok,
                              find_chat_template(tok.path), "assistant")
    return [int(i) for i in ids], [bool(t) for t in trained]


# ----------------------------------------------------------------------------- the fixture


@pytest.mark.parametrize("name", LAYOUTS)
def test_transformers_reads_the_published_behaviour(layouts, name):
    """The directory behaves in transformers as the published checkpoint does."""
    info, hf = layouts[name], hf_tok(layouts[name])
    bos, eos, pad, adds_bos, stop = PUBLISHED[name]
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == (bos, eos, pad)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (
        info.id(bos), info.id(eos), info.id(pad))
    first = hf("Hello world")["input_ids"][0]
    assert (first == info.id(info.bos_token)) is adds_bos
    assert generation_stop_ids(info) == {info.ids[t] for t in stop} == set(info.stop_ids)
    assert hf.chat_template  # found where this layout puts it


def test_gemma_vocabulary_holds_s_and_slash_s_as_ordinary_pieces(layouts):
    """The trap of the Gemma layout: <s> and </s> are in the vocabulary, not special."""
    info = layouts["gemma3-it"]
    hf = hf_tok(info)
    vocab = hf.get_vocab()
    assert "<s>" in vocab and "</s>" in vocab
    assert {"<s>", "</s>"}.isdisjoint(hf.all_special_tokens)
    assert hf.bos_token == "<bos>" and hf.eos_token == "<eos>"


def test_qwen_config_names_endoftext_as_bos_but_no_bos_is_added(layouts):
    import json

    info = layouts["qwen2.5-instruct"]
    config = json.loads((info.directory / "config.json").read_text())
    assert config["bos_token_id"] == info.ids["<|endoftext|>"]
    hf = hf_tok(info)
    assert hf.bos_token_id is None
    assert info.ids["<|endoftext|>"] not in hf("Hello world")["input_ids"]


# ----------------------------------------------------------------------------- (a) prompts


@pytest.mark.parametrize("name", LAYOUTS)
def test_prompt_ids(layouts, name):
    info = layouts[name]
    hf, tok = hf_tok(info), jaxmem_tok(info)
    for text in PROMPTS:
        assert list(tok.encode_prompt(text)) == hf(text)["input_ids"], text


@pytest.mark.parametrize("name", LAYOUTS)
def test_chat_prompt_ids(layouts, name):
    from jaxmem.data.chat import ChatPromptTokenizer, find_chat_template

    info = layouts[name]
    hf, tok = hf_tok(info), jaxmem_tok(info)
    chat = ChatPromptTokenizer(tok, find_chat_template(tok.path))
    for text in PROMPTS:
        ref = apply(hf, [{"role": "user", "content": text}], add_generation_prompt=True)
        assert chat.encode_prompt(text) == ref, text


# ----------------------------------------------------------------------------- (b) masks


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "qwen3"])
def test_assistant_mask_of_a_three_turn_chat(layouts, name):
    info = layouts[name]
    messages = conversation(name)
    ids, trained = trl_reference(hf_tok(info), messages)
    got_ids, got_trained = jaxmem_row(info, messages)
    assert got_ids == ids
    assert got_trained == trained
    assert 0 < sum(trained) < len(trained)


def test_qwen3_assistant_mask_of_one_turn(layouts):
    """Qwen3's template writes an empty <think></think> block into the LAST assistant turn
    only, so for a multi-turn chat msgs[:i + 1] does not render turn i as the whole does (see
    the next test); one turn (with a system message) keeps the prefix rule."""
    info = layouts["qwen3"]
    messages = [SYSTEM, *TURNS[:2]]
    ids, trained = trl_reference(hf_tok(info), messages)
    got_ids, got_trained = jaxmem_row(info, messages)
    assert got_ids == ids
    assert got_trained == trained
    think = info.ids["<think>"]
    assert think in ids and trained[ids.index(think)]  # the empty think block is trained


def test_qwen3_three_turns_break_the_prefix_rule_and_jaxmem_refuses(layouts):
    """Qwen3, 3 turns without reasoning: transformers renders an earlier assistant turn with
    <think>\\n\\n</think> when it is last (msgs[:i + 1]) and without it inside the whole chat, so
    the TRL reference does not exist; jaxmem's documented behaviour (jaxmem.data.masks) is to
    refuse with a DataError naming the template, not to guess."""
    from jaxmem.data import DataError

    info = layouts["qwen3"]
    hf = hf_tok(info)
    messages = [SYSTEM, *TURNS]
    through = apply(hf, messages[:3])
    assert apply(hf, messages)[:len(through)] != through
    with pytest.raises(DataError, match="prefix"):
        jaxmem_row(info, messages)


def test_qwen3_earlier_reasoning_is_stripped_as_transformers_does(layouts):
    """reasoning in an earlier assistant turn (<think>...</think> in its content) is dropped
    from the rendering; <think> and </think> are added, non-special tokens in both."""
    from jaxmem.data.chat import find_chat_template

    info = layouts["qwen3"]
    hf, tok = hf_tok(info), jaxmem_tok(info)
    messages = [TURNS[0], {"role": "assistant",
                           "content": "<think>\nThe user asks a capital.\n</think>\n\nParis."},
                TURNS[2]]
    template = find_chat_template(tok.path)
    text = template.render(messages, add_generation_prompt=True)
    assert text == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "The user asks" not in text
    assert list(tok.encode(text)) == apply(hf, messages, add_generation_prompt=True)
    ids = hf("<think>\nwhy\n</think>\n\nok")["input_ids"]
    assert list(tok.encode_prompt("<think>\nwhy\n</think>\n\nok")) == ids
    assert ids[0] == info.ids["<think>"]
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)


# ----------------------------------------------------------------------------- (c) stop ids


@pytest.mark.parametrize("name", LAYOUTS)
def test_stop_ids(layouts, name):
    from jaxmem.decode.stopping import eos_ids

    info = layouts[name]
    assert set(eos_ids(jaxmem_tok(info))) == generation_stop_ids(info)


# ----------------------------------------------------------------------------- (d) special ids


@pytest.mark.parametrize("which", ["bos", "eos", "pad"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_special_ids(layouts, name, which):
    """bos_id / eos_id as transformers' (None where it has none); pad_id as transformers', or
    its EOS where it names no PAD (jaxmem's documented fallback)."""
    info = layouts[name]
    hf, tok = hf_tok(info), jaxmem_tok(info)
    ref = getattr(hf, f"{which}_token_id")
    if which == "pad" and ref is None:
        ref = hf.eos_token_id
    assert getattr(tok, f"{which}_id") == ref


# ----------------------------------------------------------------------------- bare


def test_bare_tokenizer_json_is_refused_with_the_flags_to_name_its_tokens(layouts):
    """tokenizer.json alone, its special tokens named none of the usual names: transformers
    loads it with no BOS/EOS/PAD at all; jaxmem needs an EOS (documents end with it) and
    refuses, naming the flags that give one, rather than guess."""
    from jaxmem.io.hf import HFError

    hf = hf_tok(layouts[BARE])
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (None, None, None)
    with pytest.raises(HFError, match="--eos-token"):
        jaxmem_tok(layouts[BARE])


def test_gemma_tokenizer_json_alone_guesses_bos_not_s(layouts, tmp_path):
    """Gemma's tokenizer.json without its other files: a guess by name must not take the
    ordinary pieces <s> / </s> for BOS / EOS (jaxmem guesses among special tokens only, and
    says it guessed)."""
    import shutil

    from jaxmem.io.hf import hf_tokenizer

    info = layouts["gemma3-it"]
    shutil.copy(info.tokenizer_path, tmp_path / "tokenizer.json")
    tok = hf_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id) == (info.ids["<bos>"], info.ids["<eos>"])
    assert any("guessed" in note for note in tok.notes)


def test_bare_tokenizer_json_with_its_tokens_named(layouts):
    """The same file with BOS/EOS named (--bos-token / --eos-token; transformers'
    from_pretrained(bos_token=, eos_token=)): the same prompt ids (the post-processor adds
    <|doc|>) and the same BOS/EOS, PAD falling back to EOS."""
    from jaxmem.io.hf import hf_tokenizer

    info = layouts[BARE]
    names = dict(bos_token="<|doc|>", eos_token="<|stop|>")
    hf = transformers.AutoTokenizer.from_pretrained(str(info.directory), **names)
    tok = hf_tokenizer(info.directory, **names)
    for text in PROMPTS:
        assert list(tok.encode_prompt(text)) == hf(text)["input_ids"], text
    assert (tok.bos_id, tok.eos_id) == (hf.bos_token_id, hf.eos_token_id)
    assert hf.pad_token_id is None and tok.pad_id == hf.eos_token_id


# ----------------------------------------------------------------------------- (e) documents


@pytest.mark.parametrize("name", LAYOUTS)
def test_text_document_ids(layouts, name):
    from jaxmem.data.formats import Row
    from jaxmem.data.masks import encode_row

    info = layouts[name]
    hf, tok = hf_tok(info), jaxmem_tok(info)
    for text in PROMPTS:
        ids, trained = encode_row(Row("text", text, "test"), tok, None, "assistant")
        ids = [int(i) for i in ids]
        assert ids[:-1] == hf(text)["input_ids"], text
        assert ids[-1] == tok.eos_id
        assert np.all(trained)
