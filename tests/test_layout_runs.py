"""`--init-from` end to end for each family's real tokenizer layout (tests/tokenizer_layouts.py,
with random weights saved by transformers' own classes): the run trains with no flag about
tokens, keeps the checkpoint's tokenizer files, and `generate --run --chat` says, greedily, what
transformers' `generate` says on the same weights, stopping where transformers stops. The run
learns at lr 0 (its weights stay the checkpoint's), so the two compare the same weights. For
Gemma 3, whose vocabulary also holds <s> and </s> as ordinary tokens, the export's config.json and
generation_config.json carry <bos> / <eos> / <end_of_turn> (issue 50)."""

import json

import pytest

from jaxmem.export.cli import main as export_main
from jaxmem.generate.cli import main as generate_main
from jaxmem.train.cli import main as train_main
from jaxmem.train.rundir import load_run
from tokenizer_layouts import LAYOUTS, SYSTEM, TURNS, write_layout

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.torch]
QUESTION, NEW_TOKENS = "What is the capital of France?", 8
ARGS = ["--batch-size", "2", "--seq-len", "96", "--steps", "1", "--lr", "0", "--min-lr", "0",
        "--warmup-steps", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress",
        "--no-tensorboard"]


def _chats(path, system: bool):
    rows = [{"messages": ([SYSTEM] if system else []) + TURNS[i:i + 2]} for i in (0, 2, 4)] * 4
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def _hf_greedy(d, prompt_ids):
    """transformers' greedy new ids after `prompt_ids`, up to and with its generation config's
    first stop id."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    eos = transformers.GenerationConfig.from_pretrained(str(d)).eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    with torch.no_grad():
        ids = model.generate(torch.as_tensor([prompt_ids]), max_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos[0])[0].tolist()
    return ids[len(prompt_ids):]


@pytest.mark.parametrize("name", LAYOUTS)
def test_init_from_run_generates_as_transformers(tmp_path, capsys, name):
    from jaxmem.data.chat import ChatPromptTokenizer, find_chat_template
    from jaxmem.decode.sampling import generate_ids
    from jaxmem.decode.stopping import eos_ids

    info = write_layout(name, tmp_path / "hf", with_weights=True)
    data = _chats(tmp_path / "chats.jsonl", system=name != "mistral-v0.3-instruct")
    run = tmp_path / "run"
    assert train_main(["--init-from", str(info.directory), "--data", str(data), "--out", str(run),
                       *ARGS]) == 0
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (run / f).is_file(), f  # the run needs nothing more of the checkpoint
    loaded = load_run(run)
    tok = loaded.tokenizer
    assert (tok.bos_id, tok.eos_id) == (info.ids.get(info.bos_token), info.ids[info.eos_token])
    assert set(eos_ids(tok)) == set(info.stop_ids)

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(info.directory))
    prompt = list(hf_tok.apply_chat_template([{"role": "user", "content": QUESTION}],
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=False))
    chat = ChatPromptTokenizer(tok, find_chat_template(str(run / "tokenizer.json")))
    assert chat.encode_prompt(QUESTION) == prompt
    want = _hf_greedy(info.directory, prompt)
    params = loaded.step_config.trainable.run_params(loaded)
    got = generate_ids(loaded.model_config, params, [prompt], NEW_TOKENS, temperature=0.0,
                       eos_ids=eos_ids(tok))[0]
    assert got == want  # the same ids, the stop id included where transformers stopped

    capsys.readouterr()  # and the CLI prints that reply
    assert generate_main(["--run", str(run), "--chat", "--prompt", QUESTION, "--max-new-tokens",
                          str(NEW_TOKENS), "--temperature", "0", "--dtype", "float32"]) == 0
    reply = capsys.readouterr().out.strip()
    stopped = bool(want) and want[-1] in info.stop_ids
    assert reply == hf_tok.decode(want[:-1] if stopped else want, skip_special_tokens=True).strip()


def test_gemma3_export_carries_the_checkpoints_special_ids(tmp_path):
    info = write_layout("gemma3-it", tmp_path / "hf", with_weights=True)
    assert "<s>" in json.loads(info.tokenizer_path.read_text())["model"]["vocab"]  # the trap
    data = _chats(tmp_path / "chats.jsonl", system=True)
    run, out = tmp_path / "run", tmp_path / "export"
    assert train_main(["--init-from", str(info.directory), "--data", str(data), "--out", str(run),
                       *ARGS]) == 0
    from jaxmem.data.masks import encode_row
    from jaxmem.data.formats import Row

    tok = load_run(run).tokenizer
    ids, _ = encode_row(Row("text", "hello world", "x"), tok, None)
    assert ids[0] == info.ids["<bos>"] and ids[-1] == info.ids["<eos>"]  # a text document
    assert export_main(["--run", str(run), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    gen = transformers.GenerationConfig.from_pretrained(str(out))
    assert config["bos_token_id"] == gen.bos_token_id == info.ids["<bos>"]
    assert set(config["eos_token_id"]) == set(gen.eos_token_id) == {
        info.ids["<eos>"], info.ids["<end_of_turn>"]}
    assert config["pad_token_id"] == gen.pad_token_id == info.ids["<pad>"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert (hf_tok.bos_token, hf_tok.eos_token) == ("<bos>", "<eos>")
