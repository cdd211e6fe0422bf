"""The tokenizer loader follows the checkpoint's files (jaxmem.data.special_tokens): which file
wins, what a bare tokenizer.json gets, what a run directory keeps and an export writes. The
comparisons with transformers for each family's real layout are tests/test_tokenizer_layouts.py;
these are the rules themselves, on small WordLevel vocabularies."""

import json
import subprocess
import sys

import pytest

from jaxmem.data import DataError, load_tokenizer
from jaxmem.data.special_tokens import TokenizerFiles

tokenizers = pytest.importorskip("tokenizers")

# Gemma's trap: <s> and </s> are ordinary tokens of the vocabulary, before <bos> / <eos>
VOCAB = ["<pad>", "<eos>", "<bos>", "<unk>", "<s>", "</s>", "<end_of_turn>", "hello", "world"]


def _tokenizer_json(d, specials, post_bos=None):
    vocab = {t: i for i, t in enumerate(VOCAB)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    if post_bos is not None:
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single=f"{post_bos} $A", special_tokens=[(post_bos, vocab[post_bos])])
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    return d


def _json(path, d):
    path.write_text(json.dumps(d))


def test_gemma_layout_follows_tokenizer_config_not_names(tmp_path):
    d = _tokenizer_json(tmp_path, ["<pad>", "<eos>", "<bos>", "<unk>", "<end_of_turn>"], "<bos>")
    _json(d / "tokenizer_config.json", {"bos_token": "<bos>", "eos_token": "<eos>",
                                        "pad_token": "<pad>", "add_bos_token": True})
    _json(d / "generation_config.json", {"bos_token_id": 2, "eos_token_id": [1, 6],
                                         "pad_token_id": 0})
    tok = load_tokenizer(d)  # a directory works as well as its tokenizer.json
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 1, 0)
    assert tok.prefix_ids == [2] and tok.encode_prompt("hello") == [2, 7]
    assert tok.document_ids() == ([2], [1])
    assert tok.stop_ids == (1, 6) and tok.notes == []


def test_qwen_layout_has_no_bos_even_where_config_json_names_one(tmp_path):
    d = _tokenizer_json(tmp_path, ["<pad>", "<eos>", "<bos>", "<unk>", "<end_of_turn>"])
    _json(d / "tokenizer_config.json", {"bos_token": None, "eos_token": "<end_of_turn>",
                                        "pad_token": "<pad>", "add_bos_token": False})
    # Qwen's config.json names <|endoftext|> as bos_token_id; its tokenizer adds no BOS
    _json(d / "config.json", {"model_type": "qwen2", "bos_token_id": 1, "eos_token_id": 6})
    tok = load_tokenizer(d / "tokenizer.json")
    assert tok.bos_id is None and tok.eos_id == 6 and tok.pad_id == 0
    assert tok.prefix_ids == [] and tok.encode_prompt("hello world") == [7, 8]
    assert tok.document_ids() == ([], [6])
    assert tok.stop_ids == (6,)  # no generation_config.json: config.json's, as transformers


def test_special_tokens_map_merges_over_a_legacy_tokenizer_config(tmp_path):
    d = _tokenizer_json(tmp_path, ["<pad>", "<eos>", "<bos>", "<unk>", "<end_of_turn>"])
    _json(d / "tokenizer_config.json", {"eos_token": "<eos>"})
    _json(d / "special_tokens_map.json", {"eos_token": {"content": "<end_of_turn>"},
                                          "bos_token": "<bos>"})
    tok = load_tokenizer(d)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 6, 6)  # PAD falls back to EOS
    # transformers 5 reads the map only when tokenizer_config.json has no added_tokens_decoder
    _json(d / "tokenizer_config.json", {"eos_token": "<eos>", "added_tokens_decoder": {}})
    assert TokenizerFiles.read(d).tokens == {"eos_token": "<eos>"}
    assert load_tokenizer(d).eos_id == 1


def test_a_run_directory_config_json_is_not_read_as_a_model_config(tmp_path):
    d = _tokenizer_json(tmp_path, ["<pad>", "<eos>", "<bos>", "<unk>"], "<bos>")
    _json(d / "tokenizer_config.json", {"bos_token": "<bos>", "eos_token": "<eos>"})
    _json(d / "config.json", {"schema_version": 2, "config": {}, "eos_token_id": 5})
    assert load_tokenizer(d).stop_ids == (1,)


def test_bare_tokenizer_json_guesses_special_names_and_says_so(tmp_path):
    # <s> / </s> are ordinary here: a bare file's guess takes only special tokens
    d = _tokenizer_json(tmp_path, ["<pad>", "<eos>", "<bos>", "<unk>"])
    tok = load_tokenizer(d / "tokenizer.json")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 1, 0)
    assert tok.prefix_ids == [2]  # no post-processor: BOS + text, jaxmem's rule for bare files
    assert len(tok.notes) == 1 and "guessed by name: BOS <bos>, EOS <eos>" in tok.notes[0]
    flagged = load_tokenizer(d / "tokenizer.json", bos_token="<s>", eos_token="</s>")
    assert (flagged.bos_id, flagged.eos_id) == (4, 5)


def test_bare_tokenizer_json_without_known_names_is_refused(tmp_path):
    d = _tokenizer_json(tmp_path, ["<unk>"])
    with pytest.raises(DataError, match=r"tokenizer .*tokenizer\.json: no tokenizer_config\.json "
                                        r"beside it .*--bos-token / --eos-token / --pad-token"):
        load_tokenizer(d / "tokenizer.json")


def test_train_cli_names_the_file_and_the_flags_for_a_bare_tokenizer(tmp_path):
    d = _tokenizer_json(tmp_path / "tok", ["<unk>"])
    (tmp_path / "doc.txt").write_text("hello world " * 50)
    r = subprocess.run([sys.executable, "-m", "jaxmem.train", "--tokenizer", str(d / "tokenizer.json"),
                        "--data", str(tmp_path / "doc.txt"), "--out", str(tmp_path / "run"),
                        "--steps", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "tokenizer.json: no tokenizer_config.json beside it" in lines[0]
    assert "--bos-token / --eos-token" in lines[0] and not (tmp_path / "run").exists()


def test_a_run_directory_keeps_the_checkpoints_files_and_an_older_run_reads_its_stops(tmp_path):
    """copy_tokenizer keeps what the checkpoint's tokenizer needs, and a config.json-only
    checkpoint's ids become the run's generation_config.json; a run directory made before it
    kept one stops at its --init-from checkpoint's ids (load_run)."""
    from jaxmem.config.run import RunConfig
    from jaxmem.train.rundir import _older_run_stops, copy_tokenizer

    ckpt = _tokenizer_json(tmp_path / "ckpt", ["<pad>", "<eos>", "<bos>", "<unk>",
                                               "<end_of_turn>"], "<bos>")
    _json(ckpt / "tokenizer_config.json", {"bos_token": "<bos>", "eos_token": "<eos>"})
    _json(ckpt / "config.json", {"model_type": "gemma3_text", "bos_token_id": 2,
                                 "eos_token_id": [1, 6]})
    cfg = RunConfig().replace({"data.tokenizer": str(ckpt / "tokenizer.json"),
                               "init.init_from": str(ckpt)})
    run = tmp_path / "run"
    run.mkdir()
    copy_tokenizer(run, cfg)
    assert sorted(p.name for p in run.iterdir()) == [
        "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((run / "generation_config.json").read_text()) == {
        "bos_token_id": 2, "eos_token_id": [1, 6]}
    assert load_tokenizer(run).stop_ids == (1, 6)
    (run / "generation_config.json").unlink()  # as an older run directory
    older = load_tokenizer(run)
    assert older.stop_ids == (1,)
    assert _older_run_stops(older, cfg, run).stop_ids == (1, 6)
