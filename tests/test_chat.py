"""Chat templates and loss masks: rendered token for token as transformers' apply_chat_template,
and the trained tokens exactly the template's assistant turns (header out, <|eot_id|> in)."""

import json

import numpy as np
import pytest

from chat_files import CONVERSATIONS, TEMPLATES, write_chat_tokenizer
from jaxmem.data import DataError, find_chat_template, load_tokenizer
from jaxmem.data.chat import ChatPromptTokenizer, ChatTemplate
from jaxmem.data.formats import Row
from jaxmem.data.masks import encode_row

pytest.importorskip("jinja2")
pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tokenizer directory per template (in tokenizer_config.json, as transformers reads it)."""
    root = tmp_path_factory.mktemp("chat")
    return {name: write_chat_tokenizer(root / name, name).parent for name in TEMPLATES}


def _ours(d, conversation, train_on="assistant"):
    tok = load_tokenizer(str(d / "tokenizer.json"))
    return encode_row(Row("messages", conversation, "test"), tok,
                      find_chat_template(str(d / "tokenizer.json")), train_on)


@pytest.mark.parametrize("name", ["llama3", "llama3.2"])
def test_rendered_tokens_equal_apply_chat_template(dirs, name):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(dirs[name]))
    tok = load_tokenizer(str(dirs[name] / "tokenizer.json"))
    template = find_chat_template(str(dirs[name] / "tokenizer.json"))
    for conv in CONVERSATIONS:  # system, no system, multi-turn, non-ASCII
        ids, _ = _ours(dirs[name], conv)
        ref = hf.apply_chat_template(conv, tokenize=True, return_dict=False)
        assert ids.tolist() == list(ref)
        for gen in (False, True):
            prompt = conv[:2] if conv[0]["role"] == "system" else conv[:1]
            assert template.render(prompt, add_generation_prompt=gen) == hf.apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=gen)
    # and the prompt of `jaxmem.generate --chat`: one user turn plus the generation prompt
    chat = ChatPromptTokenizer(tok, template)
    assert chat.encode_prompt("Say hello.") == list(hf.apply_chat_template(
        [{"role": "user", "content": "Say hello."}], add_generation_prompt=True, tokenize=True,
        return_dict=False))


def test_generation_blocks_give_transformers_assistant_mask(dirs):
    """A template with {% generation %} blocks: our mask is transformers'
    return_assistant_tokens_mask; and the Llama 3 template (no markers, same text) gives the
    same mask from rendering prefix by prefix."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(dirs["generation"]))
    for conv in CONVERSATIONS:
        ref = hf.apply_chat_template(conv, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        ids, trained = _ours(dirs["generation"], conv)
        assert ids.tolist() == list(ref["input_ids"])
        assert trained.astype(int).tolist() == list(ref["assistant_masks"])
        ids3, trained3 = _ours(dirs["llama3"], conv)  # the same text without markers
        assert ids3.tolist() == ids.tolist()
        np.testing.assert_array_equal(trained3, trained)
        assert 0 < trained.sum() < trained.size


@pytest.mark.parametrize("name", ["llama3", "llama3.2", "generation"])
def test_mask_per_token_against_the_rendering(dirs, name):
    """Token by token: trained exactly where the rendering holds an assistant turn's content
    and the <|eot_id|> that closes it; the assistant header, the other turns and BOS not."""
    tok = load_tokenizer(str(dirs[name] / "tokenizer.json"))
    vocab = json.loads((dirs[name] / "tokenizer.json").read_text())["added_tokens"]
    special = {t["content"]: t["id"] for t in vocab}
    for conv in CONVERSATIONS:
        ids, trained = _ours(dirs[name], conv)
        # expected, from the rendering: walk the header-delimited turns of the token sequence
        expected = np.zeros(ids.size, bool)
        starts = np.flatnonzero(ids == special["<|start_header_id|>"])
        ends = np.flatnonzero(ids == special["<|end_header_id|>"])
        eots = np.flatnonzero(ids == special["<|eot_id|>"])
        for s, e in zip(starts, ends):
            role = tok.decode(ids[s + 1:e]).strip()
            eot = eots[eots > e][0]
            # the header and the "\n\n" after it (two tokens with this pre-tokenizer) stay
            # untrained; the content (trimmed: it starts with no whitespace) and <|eot_id|> train
            k = e + 1
            while not tok.decode(ids[k:k + 1]).strip():
                k += 1
            assert tok.decode(ids[e + 1:k]) == "\n\n"
            if role == "assistant":
                expected[k:eot + 1] = True
        np.testing.assert_array_equal(trained, expected)
        turns = [m["content"].strip() + "<|eot_id|>" for m in conv if m["role"] == "assistant"]
        assert tok._tok.decode(ids[trained].tolist(), skip_special_tokens=False) == "".join(turns)
        all_ids, all_trained = _ours(dirs[name], conv, "all")
        assert all_trained.all() and all_ids.tolist() == ids.tolist()


def test_prompt_completion_masks(dirs):
    tok = load_tokenizer(str(dirs["llama3"] / "tokenizer.json"))
    template = find_chat_template(str(dirs["llama3"] / "tokenizer.json"))
    ids, trained = encode_row(Row("pair", ("What is 2+2?", " Four."), "t"), tok, None)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids[trained]) == " Four."  # the completion and EOS (decoded without it)
    assert trained[-1] and not trained[:1 + len(tok.encode("What is 2+2?"))].any()
    prompt = [{"role": "user", "content": "What is 2+2?"}]
    ids, trained = encode_row(Row("pair", (prompt, "Four."), "t"), tok, template)
    conv = prompt + [{"role": "assistant", "content": "Four."}]
    ids2, trained2 = encode_row(Row("messages", conv, "t"), tok, template)
    assert ids.tolist() == ids2.tolist()
    np.testing.assert_array_equal(trained, trained2)  # the completion is the assistant turn


def test_template_sources_and_priority(tmp_path):
    d = tmp_path / "tok"
    write_chat_tokenizer(d, "llama3", where="config")
    t = find_chat_template(str(d / "tokenizer.json"))
    assert t.source.endswith("tokenizer_config.json (chat_template)")
    assert t.text == TEMPLATES["llama3"].read_text()
    assert t.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    (d / "chat_template.jinja").write_text(TEMPLATES["llama3.2"].read_text())  # priority
    assert find_chat_template(str(d / "tokenizer.json")).text == TEMPLATES["llama3.2"].read_text()
    given = find_chat_template(str(d / "tokenizer.json"), str(TEMPLATES["generation"]))
    assert given.text == TEMPLATES["generation"].read_text() and given.has_generation_markers
    assert given.special_tokens["bos_token"] == "<|begin_of_text|>"  # the tokenizer's specials
    bare = tmp_path / "bare"
    write_chat_tokenizer(bare, None)
    assert find_chat_template(str(bare / "tokenizer.json")) is None
    cfg = json.loads((bare / "tokenizer_config.json").read_text())  # the list form
    cfg["chat_template"] = [{"name": "tool_use", "template": "x"},
                            {"name": "default", "template": "{{ messages[0]['content'] }}"}]
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = find_chat_template(str(bare / "tokenizer.json"))
    assert t.render([{"role": "user", "content": "hi"}]) == "hi"
    with pytest.raises(DataError, match="--chat-template .*nope.jinja: cannot read"):
        find_chat_template(None, str(tmp_path / "nope.jinja"))


def test_environment_matches_transformers():
    """tojson keeps non-ASCII and HTML characters, raise_exception raises, strftime_now and
    loopcontrols work, trim_blocks / lstrip_blocks are on: as transformers renders it."""
    text = ('{{ messages[0] | tojson }}\n{% for m in messages %}\n  {% if loop.index > 1 %}'
            '{% break %}{% endif %}\n[{{ m.role }}]\n{% endfor %}\n'
            '{{ strftime_now("%Y") | length }}{% set ns = namespace(n=dict(a=1)) %}{{ ns.n.a }}')
    msgs = [{"role": "user", "content": "<é>"}, {"role": "assistant", "content": "x"}]
    out = ChatTemplate(text, "test").render(msgs)
    assert out == '{"role": "user", "content": "<é>"}\n[user]\n41'
    transformers = pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template
    assert out == render_jinja_template([msgs], chat_template=text)[0][0]
    with pytest.raises(DataError, match="chat template test failed: no system turns"):
        ChatTemplate("{{ raise_exception('no system turns') }}", "test").render([])


def test_specials_from_the_tokenizer_when_no_config_names_them(tmp_path):
    from jaxmem.data.chat import with_tokenizer_specials

    d = tmp_path / "bare"
    write_chat_tokenizer(d, None)
    (d / "tokenizer_config.json").unlink()  # only tokenizer.json: no bos_token for the template
    tok = load_tokenizer(str(d / "tokenizer.json"))
    t = find_chat_template(str(d / "tokenizer.json"), str(TEMPLATES["llama3"]))
    assert t.special_tokens == {}
    with pytest.raises(DataError, match="'bos_token' is undefined"):
        t.render(CONVERSATIONS[1])
    filled = with_tokenizer_specials(t, tok)
    assert filled.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    assert filled.render(CONVERSATIONS[1]).startswith("<|begin_of_text|><|start_header_id|>user")
    given = ChatTemplate(t.text, "x", {"bos_token": "<s>"})  # a config's own name is kept
    assert with_tokenizer_specials(given, tok).special_tokens["bos_token"] == "<s>"


def test_generate_chat_without_a_template_exits_2(tmp_path, capsys):
    from hf_files import random_params
    from jaxmem.families import PRESETS
    from jaxmem.generate.cli import main as generate_main
    from jaxmem.io.hf_export import save_hf

    tok = write_chat_tokenizer(tmp_path / "tok", None)  # tokenizer_config.json, no template
    cfg = PRESETS["tiny"].replace(vocab_size=400, hidden_size=32, intermediate_size=64,
                                  num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    save_hf(tmp_path / "hf", cfg, random_params(cfg), tokenizer=str(tok))
    with pytest.raises(SystemExit) as e:
        generate_main(["--hf", str(tmp_path / "hf"), "--chat", "--prompt", "hi"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"python -m jaxmem.generate: error: --chat: no chat template for "
                   f"{tmp_path / 'hf' / 'tokenizer.json'}; give one with --chat-template FILE, or "
                   f"put chat_template.jinja (or a chat_template in tokenizer_config.json) beside "
                   f"the tokenizer.json"]
