"""Packing at long context: rows of 65,536 tokens hold hundreds of documents, each its own
segment with RoPE positions restarting at 0, for plain text and chat data (the assistant turns
trained), through the loader the trainer uses (jaxmem.data.examples.load_examples)."""

import json

import numpy as np
import pytest

from jaxmem.data import load_tokenizer
from jaxmem.data.examples import load_examples

from chat_files import CHAT_FILE, write_chat_tokenizer  # noqa: E402

T = 65536


def _documents(ex) -> dict:
    """{document tokens as bytes: its trained flags}, for every example of `ex`."""
    return {ex.tokens[a:b].tobytes(): ex.trained[a:b] for a, b in zip(ex.starts[:-1], ex.starts[1:])}


def check_rows(data, tokenizer, min_docs: int) -> int:
    """Asserts every row of the first batch is many whole documents, one segment each, with
    positions restarting per document and trailing padding; returns the documents seen."""
    batch = data.batcher(2, T, seed=0, pad_id=tokenizer.pad_id).batch_at(0)
    docs, seen = _documents(data.examples), 0
    for r in range(batch["inputs"].shape[0]):
        seg, pos = batch["segment_ids"][r], batch["positions"][r]
        used = int(np.count_nonzero(seg))
        assert (seg[:used] > 0).all() and (seg[used:] == 0).all()  # padding only at the end
        starts = np.flatnonzero(np.diff(seg[:used], prepend=0))
        assert seg[starts].tolist() == list(range(1, len(starts) + 1))  # 1, 2, ... contiguous
        assert len(starts) >= min_docs, len(starts)
        ends = np.append(starts[1:], used)
        for lo, hi in zip(starts, ends):
            np.testing.assert_array_equal(pos[lo:hi], np.arange(hi - lo))  # RoPE restarts
            toks = np.append(batch["inputs"][r, lo:hi], batch["targets"][r, hi - 1])
            trained = docs[toks.astype(data.examples.tokens.dtype).tobytes()]  # a whole document
            np.testing.assert_array_equal(batch["mask"][r, lo:hi], trained[1:])
        assert (pos[used:] == 0).all() and (batch["mask"][r, used:] == 0).all()
        seen += len(starts)
    return seen


def test_text_rows_pack_hundreds_of_documents_per_65536_token_row(tmp_path):
    rng = np.random.default_rng(0)
    words = np.array("the of packing long context rows segment position restart data".split())
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, rng.integers(3, 15)))})
                         + "\n" for _ in range(1500)))
    tok = load_tokenizer()
    train, _, stats = load_examples([f], tok, tok.vocab_size, seq_len=T, eval_fraction=0.0)
    assert stats["train_rows"] == 2  # 80k tokens: one full row and the rest
    assert check_rows(train, tok, min_docs=300) == 1500  # every document, once


def test_chat_rows_pack_many_conversations_with_assistant_masks(tmp_path):
    tok = load_tokenizer(str(write_chat_tokenizer(tmp_path / "tok", "llama3.2", where="config")))
    f = tmp_path / "chat.jsonl"
    f.write_text(CHAT_FILE.read_text() * 25)  # 1,200 conversations
    train, _, stats = load_examples([f], tok, tok.vocab_size, seq_len=T, eval_fraction=0.0)
    assert stats["row_kinds"] == {"messages": 1200}
    assert 0 < stats["trained_tokens"] < stats["train_tokens"] // 2  # assistant turns only
    assert check_rows(train, tok, min_docs=100) == 1200
