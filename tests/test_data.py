"""Data: tokenizers, sources, the default corpus, packed resumable batches, eval split."""

import json
import sys

import numpy as np
import pytest

from jaxmem.families.config import BOS_TOKEN_ID, BYTE_VOCAB_SIZE, EOS_TOKEN_ID, PAD_TOKEN_ID
from jaxmem.data import (Batcher, ByteTokenizer, DataError, HFTokenizer, batch_at, decode_utf8,
                         eval_batches, load_corpus, load_token_file, load_tokenizer,
                         num_windows)

TOK = ByteTokenizer()
V = BYTE_VOCAB_SIZE


def write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    return path


# ----------------------------------------------------------------------------- tokenizer


def test_byte_tokenizer_round_trip():
    text = "héllo, wörld — 日本語 🙂\n"
    ids = TOK.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert max(ids) < 256
    assert TOK.decode(ids) == text
    assert TOK.decode([BOS_TOKEN_ID, *ids, EOS_TOKEN_ID, PAD_TOKEN_ID]) == text
    np.testing.assert_array_equal(TOK.encode_array(text), np.asarray(ids, np.int32))
    assert (TOK.vocab_size, TOK.pad_id, TOK.bos_id, TOK.eos_id) == (259, 256, 257, 258)
    assert TOK.decode([0xff, ord("a")]) == "\ufffda"  # invalid byte decodes with errors='replace'


def test_load_tokenizer_default_and_missing_file(tmp_path, monkeypatch):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    with pytest.raises(DataError, match="tokenizer file not found: .*nope.json"):
        load_tokenizer(str(tmp_path / "nope.json"))
    f = write(tmp_path / "tok.json", "{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    with pytest.raises(DataError, match=r"cannot load tokenizer .*tok\.json: the optional "
                                        r"'tokenizers' package is not installed"):
        HFTokenizer(f)


def test_hf_tokenizer_invalid_file(tmp_path):
    pytest.importorskip("tokenizers")
    f = write(tmp_path / "bad.json", "not json")
    with pytest.raises(DataError, match=r"invalid tokenizer file .*bad\.json"):
        HFTokenizer(f)


def test_hf_tokenizer_round_trip(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[PAD]": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, "hello": 4, "world": 5}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["[PAD]", "<s>", "</s>"])
    tok.save(str(tmp_path / "tok.json"))
    hf = load_tokenizer(str(tmp_path / "tok.json"))
    assert (hf.vocab_size, hf.pad_id, hf.bos_id, hf.eos_id) == (6, 0, 1, 2)
    assert hf.encode("hello world hello") == [4, 5, 4]
    assert hf.decode([1, 4, 5, 2, 0]) == "hello world"
    write(tmp_path / "doc.txt", "world hello")
    train, _, stats = load_corpus(str(tmp_path / "doc.txt"), hf, 6, eval_fraction=0.0)
    assert train.tolist() == [1, 5, 4, 2] and stats["tokenizer"] == str(tmp_path / "tok.json")
    with pytest.raises(DataError, match=r"tokenizer .*tok\.json: --bos-token '<x>' is not in its "
                                        r"vocabulary"):
        HFTokenizer(tmp_path / "tok.json", bos_token="<x>")


def test_batched_encoding_and_the_memo_give_each_files_own_ids(tmp_path, monkeypatch):
    """A corpus of several text files, encoded in batches (`BATCH_BYTES` lowered so it takes
    three), is the stream of each file encoded alone; loaded again it comes from the memo
    (equal, and a copy), and a file changed on disk is read again."""
    pytest.importorskip("tokenizers")
    from jaxmem.data import sources, stream_memo
    from hf_files import write_tokenizer
    write_tokenizer(tmp_path / "tok", "def return import class self None for in if else " * 50)
    tok = load_tokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    texts = ["def f(x):\n    return x if x else None\n" * (3 + i) for i in range(5)]
    for i, t in enumerate(texts):
        write(tmp_path / "d" / f"{i}.py", t)
    before, after = tok.document_ids()
    want = [i for t in texts for i in [*before, *tok.encode(t), *after]]
    monkeypatch.setattr(sources, "BATCH_BYTES", len(texts[4].encode()))  # 7 units: 2+2+1 files
    calls = []
    monkeypatch.setattr(type(tok), "encode_arrays",
                        lambda self, ts, f=type(tok).encode_arrays: calls.append(len(ts)) or f(self, ts))
    stream_memo.forget()
    V = tok.vocab_size
    train, _, stats = load_corpus(str(tmp_path / "d"), tok, V, eval_fraction=0.0)
    assert train.tolist() == want and calls == [2, 2, 1]
    again, _, stats2 = load_corpus(str(tmp_path / "d"), tok, V, eval_fraction=0.0)
    assert again.tolist() == want and stats2 == stats and len(calls) == 3  # from the memo
    again[0] = -1  # the memo hands out copies
    assert load_corpus(str(tmp_path / "d"), tok, V, eval_fraction=0.0)[0].tolist() == want
    write(tmp_path / "d" / "4.py", "class C: pass\n")  # changed: tokenized again
    changed, _, _ = load_corpus(str(tmp_path / "d"), tok, V, eval_fraction=0.0)
    assert len(calls) > 3 and changed.tolist()[-(len(after) + len(tok.encode("class C: pass\n"))):] \
        == [*tok.encode("class C: pass\n"), *after]


# ----------------------------------------------------------------------------- text sources


def test_invalid_utf8_is_counted_not_fatal(tmp_path):
    # \xff and \xfe are invalid anywhere; \xe2\x82 is a truncated 3-byte sequence (one run);
    # a genuine U+FFFD in the file is not counted.
    raw = b"ok \xff x \xfe y \xe2\x82 z " + "\ufffd".encode()
    text, bad = decode_utf8(raw)
    assert bad == 3 and text.count("\ufffd") == 4
    write(tmp_path / "a.txt", raw)
    write(tmp_path / "b.txt", "clean")
    train, ev, stats = load_corpus(str(tmp_path), TOK, V, eval_fraction=0.0)
    assert stats["invalid_utf8_replacements"] == 3
    assert stats["files_with_invalid_utf8"] == [str(tmp_path / "a.txt")]
    assert ev.size == 0
    expected = ([BOS_TOKEN_ID] + list(text.encode()) + [EOS_TOKEN_ID]
                + [BOS_TOKEN_ID] + list(b"clean") + [EOS_TOKEN_ID])
    np.testing.assert_array_equal(train, np.asarray(expected, np.int32))
    assert train.dtype == np.int32


def test_directory_is_recursive_sorted_and_skips_hidden(tmp_path):
    write(tmp_path / "d" / "b.txt", "B")
    write(tmp_path / "d" / "a" / "z.txt", "Z")
    write(tmp_path / "d" / "c.txt", "C")
    write(tmp_path / "d" / ".git" / "x.txt", "hidden")
    train, _, stats = load_corpus(str(tmp_path / "d"), TOK, V, eval_fraction=0.0)
    assert TOK.decode(train) == "ZBC"  # a/z.txt < b.txt < c.txt
    assert stats["files"] == 3 and stats["documents"] == 3
    assert list(train[:3]) == [BOS_TOKEN_ID, ord("Z"), EOS_TOKEN_ID]


def test_glob_and_comma_list(tmp_path):
    for name in ["x1.txt", "x2.txt", "y.md"]:
        write(tmp_path / name, name)
    train, _, stats = load_corpus(str(tmp_path / "x*.txt"), TOK, V, eval_fraction=0.0)
    assert TOK.decode(train) == "x1.txtx2.txt" and stats["files"] == 2
    train, _, _ = load_corpus(f"{tmp_path / 'y.md'},{tmp_path / 'x1.txt'}", TOK, V,
                              eval_fraction=0.0)
    assert TOK.decode(train) == "y.mdx1.txt"
    with pytest.raises(DataError, match=r"data glob matched no files: .*\*\.rst"):
        load_corpus(str(tmp_path / "*.rst"), TOK, V)


def test_missing_and_empty_files_name_the_path(tmp_path):
    with pytest.raises(DataError, match=r"data file not found: .*missing\.txt"):
        load_corpus(str(tmp_path / "missing.txt"), TOK, V)
    empty = write(tmp_path / "empty.txt", "")
    with pytest.raises(DataError, match=r"data file is empty: .*empty\.txt"):
        load_corpus(str(empty), TOK, V)
    write(tmp_path / "emptydir" / ".hidden", "x")
    with pytest.raises(DataError, match=r"data directory has no files: .*emptydir"):
        load_corpus(str(tmp_path / "emptydir"), TOK, V)


def test_unreadable_file_names_the_path(tmp_path, monkeypatch):
    f = write(tmp_path / "secret.txt", "x")

    def denied(self):  # chmod 0 does not stop root, so fake the OSError
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(f), "read_bytes", denied)
    with pytest.raises(DataError, match=r"cannot read data file .*secret\.txt: Permission denied"):
        load_corpus(str(f), TOK, V)


# ----------------------------------------------------------------------------- token files


@pytest.mark.parametrize("name, dtype", [("t.bin", np.uint16), ("t.u32.bin", np.uint32),
                                         ("t.npy", np.int64)])
def test_token_files_load_verbatim(tmp_path, name, dtype):
    ids = np.array([1, 2, 3, 258, 70000 if dtype != np.uint16 else 65535, 0], dtype)
    f = tmp_path / name
    if name.endswith(".npy"):
        np.save(f, ids)
    else:
        ids.tofile(f)
    arr = load_token_file(f, 70001)
    np.testing.assert_array_equal(arr, ids)
    train, ev, stats = load_corpus(str(f), TOK, 70001, eval_fraction=0.0)
    np.testing.assert_array_equal(train, ids.astype(np.int32))  # no BOS/EOS added
    assert stats["documents"] == 0 and stats["files"] == 1


@pytest.mark.parametrize("name", ["t.bin", "t.u32.bin", "t.npy"])
def test_token_id_out_of_vocab_raises(tmp_path, name):
    ids = np.array([5, 300, 7], np.uint32 if "u32" in name else np.uint16)
    f = tmp_path / name
    np.save(f, ids) if name.endswith(".npy") else ids.tofile(f)
    with pytest.raises(DataError, match=rf"token file .*{name.replace('.', '[.]')} has token "
                                        rf"id 300 >= vocab size 259"):
        load_corpus(str(f), TOK, V)


def test_bad_token_files(tmp_path):
    write(tmp_path / "odd.bin", b"\x01\x00\x02")
    with pytest.raises(DataError, match=r"odd\.bin has 3 bytes, not a multiple of 2"):
        load_token_file(tmp_path / "odd.bin", V)
    write(tmp_path / "e.bin", b"")
    with pytest.raises(DataError, match=r"token file is empty: .*e\.bin"):
        load_token_file(tmp_path / "e.bin", V)
    np.save(tmp_path / "f.npy", np.ones(3, np.float32))
    with pytest.raises(DataError, match=r"f\.npy must hold a 1-D integer array"):
        load_token_file(tmp_path / "f.npy", V)
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object))  # would need pickle
    with pytest.raises(DataError, match=r"cannot read token file .*o\.npy"):
        load_token_file(tmp_path / "o.npy", V)
    with pytest.raises(DataError, match=r"token file not found: .*nope\.npy"):
        load_token_file(tmp_path / "nope.npy", V)


# ----------------------------------------------------------------------------- default corpus


def test_default_corpus():
    train, ev, stats = load_corpus(None, TOK, V, seq_len=256)
    assert stats["source"] == "default:stdlib"
    assert stats["bytes"] > 1_000_000 and stats["files"] > 50
    assert train.dtype == np.int32 and train.ndim == 1 and train.max() < V
    assert stats["tokens"] == train.size + ev.size
    if stats["invalid_utf8_replacements"] == 0:  # else U+FFFD changes the byte count
        assert stats["tokens"] == stats["bytes"] + 2 * stats["documents"]
    assert len(stats["tokens_sha256"]) == 64 and stats["python_version"]
    assert "def " in TOK.decode(train[:20000])
    # deterministic, and the cap is honoured
    train2, _, stats2 = load_corpus(None, TOK, V, seq_len=256)
    assert stats2["tokens_sha256"] == stats["tokens_sha256"]
    np.testing.assert_array_equal(train, train2)
    _, _, small = load_corpus(None, TOK, V, default_corpus_bytes=200_000)
    assert 0 < small["bytes"] <= 200_000


# ----------------------------------------------------------------------------- eval split


def test_eval_split_is_the_disjoint_tail(tmp_path):
    write(tmp_path / "a.txt", "a" * 5000)
    write(tmp_path / "b.txt", "b" * 5000)
    train, ev, stats = load_corpus(str(tmp_path), TOK, V, eval_fraction=0.1, seq_len=64)
    n = stats["tokens"]
    assert ev.size == int(np.ceil(0.1 * n)) and train.size + ev.size == n
    assert ord("a") not in set(ev.tolist()) and ev[-1] == EOS_TOKEN_ID
    assert train[0] == BOS_TOKEN_ID
    # the split keeps at least one window for eval, but never more than half the stream
    _, ev, _ = load_corpus(str(tmp_path), TOK, V, eval_fraction=0.001, seq_len=64)
    assert ev.size == 65
    train, ev, _ = load_corpus(str(tmp_path / "a.txt"), TOK, V, eval_fraction=0.05,
                               seq_len=100_000)
    assert ev.size == train.size == 2501
    with pytest.raises(DataError, match="eval_fraction"):
        load_corpus(str(tmp_path), TOK, V, eval_fraction=1.0)


# ----------------------------------------------------------------------------- batches


STREAM = np.arange(1000, 2000, dtype=np.int32)  # 1000 distinct tokens (batches need no vocab)


def test_batches_are_packed_shifted_windows():
    b = Batcher(STREAM, batch_size=3, seq_len=16, seed=0, pad_id=PAD_TOKEN_ID)
    assert b.num_windows == num_windows(1000, 16) == 63  # ceil(999 / 16)
    x = b.batch_at(0)
    assert set(x) == {"inputs", "targets", "mask"}
    for k in x:
        assert x[k].shape == (3, 16) and x[k].dtype == np.int32
    np.testing.assert_array_equal(x["inputs"][:, 1:], x["targets"][:, :-1])
    # each row is a stride-16 window of the stream
    for row in range(3):
        start = int(x["inputs"][row, 0]) - 1000
        assert start % 16 == 0
        np.testing.assert_array_equal(x["inputs"][row], STREAM[start:start + 16])
        np.testing.assert_array_equal(x["targets"][row], STREAM[start + 1:start + 17])


def test_batches_deterministic_and_resumable():
    b = Batcher(STREAM, batch_size=4, seq_len=16, seed=7, pad_id=PAD_TOKEN_ID)
    in_sequence = [b.batch_at(p) for p in range(40)]  # 160 samples: over 2.5 epochs of 63
    it = Batcher(STREAM, 4, 16, seed=7, pad_id=PAD_TOKEN_ID).iterate(0)
    for p in [0, 1, 15, 16, 31, 39]:
        fresh = batch_at(STREAM, 7, 4, 16, p, pad_id=PAD_TOKEN_ID)
        resumed = next(Batcher(STREAM, 4, 16, seed=7, pad_id=PAD_TOKEN_ID).iterate(p))
        for k in fresh:
            np.testing.assert_array_equal(fresh[k], in_sequence[p][k])
            np.testing.assert_array_equal(resumed[k], in_sequence[p][k])
    for p in range(40):
        np.testing.assert_array_equal(next(it)["inputs"], in_sequence[p]["inputs"])
    # each epoch visits every window exactly once; epochs and seeds differ in order
    starts = np.concatenate([x["inputs"][:, 0] for x in in_sequence])
    assert sorted(starts[:63].tolist()) == sorted(STREAM[0:1000:16].tolist())
    assert not np.array_equal(starts[:63], starts[63:126])
    other = Batcher(STREAM, 4, 16, seed=8, pad_id=PAD_TOKEN_ID).batch_at(0)
    assert not np.array_equal(other["inputs"], in_sequence[0]["inputs"])


def test_partial_last_window_is_padded_with_mask_zero():
    b = Batcher(STREAM, batch_size=63, seq_len=16, seed=0, pad_id=PAD_TOKEN_ID)
    x = b.batch_at(0)  # one full epoch: every window once
    last = int(np.flatnonzero(x["inputs"][:, 0] == STREAM[62 * 16])[0])
    n_real_targets = 1000 - 62 * 16 - 1  # 7
    assert x["mask"][last].tolist() == [1] * n_real_targets + [0] * (16 - n_real_targets)
    assert (x["targets"][last][n_real_targets:] == PAD_TOKEN_ID).all()
    assert x["mask"].sum() == 63 * 16 - (16 - n_real_targets)


def test_tiny_data_is_padded_and_masked(tmp_path):
    write(tmp_path / "tiny.txt", "hi")
    train, ev, _ = load_corpus(str(tmp_path / "tiny.txt"), TOK, V, eval_fraction=0.0)
    assert train.tolist() == [BOS_TOKEN_ID, ord("h"), ord("i"), EOS_TOKEN_ID]
    x = Batcher(train, batch_size=2, seq_len=8, seed=0, pad_id=PAD_TOKEN_ID).batch_at(3)
    want_in = [BOS_TOKEN_ID, ord("h"), ord("i"), EOS_TOKEN_ID] + [PAD_TOKEN_ID] * 4
    want_tg = [ord("h"), ord("i"), EOS_TOKEN_ID] + [PAD_TOKEN_ID] * 5
    for row in range(2):
        assert x["inputs"][row].tolist() == want_in
        assert x["targets"][row].tolist() == want_tg
        assert x["mask"][row].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    # the mask is 0 on every PAD target
    assert (x["mask"][x["targets"] == PAD_TOKEN_ID] == 0).all()


def test_eval_batches_deterministic_cover_stream_and_pad():
    ev = STREAM[:100]
    bs = eval_batches(ev, batch_size=4, seq_len=16, pad_id=PAD_TOKEN_ID)
    assert len(bs) == 2  # ceil(99 / 16) = 7 windows -> 2 batches of 4
    assert bs[0]["inputs"][0].tolist() == ev[:16].tolist()
    assert bs[1]["inputs"][2].tolist()[:3] == ev[96:99].tolist()  # window 6: tokens 96..99
    assert bs[1]["mask"][2].tolist() == [1, 1, 1] + [0] * 13
    assert (bs[1]["mask"][3] == 0).all() and (bs[1]["targets"][3] == PAD_TOKEN_ID).all()
    assert sum(int(b["mask"].sum()) for b in bs) == 99  # every next-token target counted once
    again = eval_batches(ev, 4, 16, pad_id=PAD_TOKEN_ID)
    for a, b in zip(bs, again):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    assert len(eval_batches(ev, 4, 16, max_batches=1, pad_id=PAD_TOKEN_ID)) == 1
    assert eval_batches(ev[:0], 4, 16, pad_id=PAD_TOKEN_ID) == []


def test_bad_batcher_arguments():
    with pytest.raises(DataError, match="batch_size"):
        Batcher(STREAM, 0, 16, pad_id=PAD_TOKEN_ID)
    with pytest.raises(DataError, match="at least 2 tokens"):
        Batcher(STREAM[:1], 2, 16, pad_id=PAD_TOKEN_ID)
    with pytest.raises(DataError, match="seed must be >= 0, got -1"):
        Batcher(STREAM, 2, 16, seed=-1, pad_id=PAD_TOKEN_ID)
    with pytest.raises(DataError, match="position must be >= 0"):
        Batcher(STREAM, 2, 16, pad_id=PAD_TOKEN_ID).batch_at(-1)


# ----------------------------------------------------------------------------- packed examples


from jaxmem.data.packing import (Examples, PackedBatcher, build_row, cut_pieces,  # noqa: E402
                                 packed_eval_batches, plan_rows)


def _examples(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return Examples.of([(rng.integers(0, 250, n).astype(np.int32), rng.random(n) < 0.7)
                        for n in lengths])


def test_plan_rows_best_fit_decreasing_and_no_pack():
    assert plan_rows(np.array([10, 6, 5, 4, 3, 2]), 10) == [[0], [1, 3], [2, 4, 5]]
    assert plan_rows(np.array([3, 3, 3]), 10) == [[0, 1, 2]]
    assert plan_rows(np.array([10, 6, 5]), 10, pack=False) == [[0], [1], [2]]
    with pytest.raises(DataError, match="pieces must hold 1 to 10 targets"):
        plan_rows(np.array([11]), 10)


def test_build_row_segments_positions_and_masks():
    ex = Examples.of([(np.array([1, 2, 3, 4], np.int32), np.array([0, 0, 1, 1], bool)),
                      (np.array([7, 8, 9], np.int32), np.array([0, 1, 1], bool))])
    pieces, _ = cut_pieces(ex, 8)
    r = build_row(ex, pieces, [1, 0], 8, pad_id=256)
    np.testing.assert_array_equal(r["inputs"], [7, 8, 1, 2, 3, 256, 256, 256])
    np.testing.assert_array_equal(r["targets"], [8, 9, 2, 3, 4, 256, 256, 256])
    np.testing.assert_array_equal(r["mask"], [1, 1, 0, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(r["segment_ids"], [1, 1, 2, 2, 2, 0, 0, 0])
    np.testing.assert_array_equal(r["positions"], [0, 1, 0, 1, 2, 0, 0, 0])


def test_split_and_drop_and_every_target_once():
    ex = _examples([5, 40, 17, 18, 2, 1, 9])
    pieces, counts = cut_pieces(ex, 16, "split")
    # 40 -> 17 + 17 + 8 tokens (stride 16); 18 -> 17 + 2; the 1-token example has no target
    assert counts["examples_split"] == 2 and counts["examples_too_short"] == 1
    dropped, dcounts = cut_pieces(ex, 16, "drop")
    assert dcounts["examples_dropped"] == 2 and dropped.shape[0] == 4
    rows = plan_rows(pieces[:, 1] - 1, 16)
    assert sorted(i for r in rows for i in r) == list(range(pieces.shape[0]))
    # the (input, target) pairs of all rows are exactly those of the examples, each once
    got = sorted((int(i), int(t), int(m)) for r in rows
                 for b in [build_row(ex, pieces, r, 16, pad_id=256)]
                 for i, t, m, s in zip(b["inputs"], b["targets"], b["mask"], b["segment_ids"]) if s)
    want = sorted((int(ex.tokens[a + j]), int(ex.tokens[a + j + 1]), int(ex.trained[a + j + 1]))
                  for a, n in zip(ex.starts[:-1], np.diff(ex.starts)) for j in range(n - 1)
                  if n > 1)
    assert got == want


def test_packed_batches_are_pure_and_resumable():
    ex = _examples([5, 9, 3, 12, 7, 4, 6, 8, 2, 10])
    pieces, _ = cut_pieces(ex, 16)
    rows = plan_rows(pieces[:, 1] - 1, 16)
    a = PackedBatcher(ex, pieces, rows, 2, 16, seed=3, pad_id=256)
    seq = [a.batch_at(p) for p in range(8)]  # several epochs
    b = PackedBatcher(ex, pieces, rows, 2, 16, seed=3, pad_id=256)
    for p in (7, 2, 5):  # a resumed batcher at any position: the same batch
        for k in seq[p]:
            np.testing.assert_array_equal(b.batch_at(p)[k], seq[p][k])
    c = PackedBatcher(ex, pieces, rows, 2, 16, seed=4, pad_id=256)
    assert any(not np.array_equal(c.batch_at(p)["inputs"], seq[p]["inputs"]) for p in range(4))
    # 56 targets fill 4 rows of 16 (best fit); in batches of 3 the last has 2 padding rows
    evals = packed_eval_batches(ex, pieces, rows, 3, 16, pad_id=256)
    assert len(rows) == 4 and len(evals) == 2
    assert not evals[1]["mask"][1:].any() and not evals[1]["segment_ids"][1:].any()
    assert evals[1]["mask"][0].any()
    assert packed_eval_batches(ex, pieces, rows, 4, 16, 1, pad_id=256)[0]["inputs"].shape == (4, 16)


def test_no_pack_gives_one_segment_per_row(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in (3, 5, 7, 2, 4)))
    for pack in (True, False):
        train, _, stats = load_corpus(str(f), TOK, V, seq_len=16, eval_fraction=0.0, pack=pack)
        assert stats["packed"] is pack and stats["train_rows"] == (2 if pack else 5)
        b = train.batcher(stats["train_rows"], 16, 0, TOK.pad_id).batch_at(0)  # one epoch
        assert b["segment_ids"].max() == (3 if pack else 1)
        assert b["mask"].sum() == stats["trained_tokens"] == 4 + 6 + 8 + 3 + 5
