"""Example rows: .jsonl / .json / .parquet, the kind of each row, and the one-line errors of
bad input (through `python -m jaxmem.train`'s main: exit 2, the file and line named, nothing
written)."""

import json
import sys

import numpy as np
import pytest

from jaxmem.data import ByteTokenizer, DataError, load_corpus
from jaxmem.data.formats import read_rows
from jaxmem.train.cli import main
from runs import error_line

TOK = ByteTokenizer()
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_row_kinds_in_each_format(tmp_path):
    rows = [{"text": "plain"}, {"text": "more", "id": 3}]
    assert [(r.kind, r.value) for r in read_rows(jsonl(tmp_path / "a.jsonl", rows))] == \
        [("text", "plain"), ("text", "more")]
    (tmp_path / "b.json").write_text(json.dumps([CHAT, CHAT]))
    got = read_rows(tmp_path / "b.json")
    assert [r.kind for r in got] == ["messages"] * 2 and got[1].where.endswith("b.json row 2")
    pair = read_rows(jsonl(tmp_path / "c.jsonl", [{"prompt": "2+2=", "completion": "4"},
                                                  {"prompt": CHAT["messages"][:1],
                                                   "completion": "yo", "meta": None}]))
    assert [r.kind for r in pair] == ["pair", "pair"] and pair[1].value[1] == "yo"
    field = read_rows(jsonl(tmp_path / "d.jsonl", [{"body": "x", "n": 1}]), data_field="body")
    assert [(r.kind, r.value) for r in field] == [("text", "x")]


def test_parquet_rows_and_missing_pyarrow(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([CHAT, CHAT]), tmp_path / "chat.parquet")
    rows = read_rows(tmp_path / "chat.parquet")
    assert [r.kind for r in rows] == ["messages"] * 2 and rows[0].value == CHAT["messages"]
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if not installed
    with pytest.raises(DataError, match=r"chat.parquet: reading .parquet files needs pyarrow "
                                        r"\(pip install 'jaxmem\[parquet\]'\)"):
        read_rows(tmp_path / "chat.parquet")


@pytest.mark.parametrize("rows,message", [
    (['{"text": "ok"}', '{"text": "broken"'], r"bad.jsonl line 2: invalid JSON \(Expecting"),
    ([{"prompt": "q"}], r"bad.jsonl line 1: a prompt/completion row has no 'completion' field "
                        r"\(fields found: prompt\)"),
    ([CHAT, {"messages": [{"role": "bot", "content": "x"}]}],
     r"bad.jsonl line 2: messages message 1 has role 'bot' \(expected system, user, assistant\)"),
    ([{"messages": [{"role": "user"}]}],
     r"bad.jsonl line 1: messages message 1 has no 'content' field \(fields found: role\)"),
    ([{"text": "a"}, CHAT], r"bad.jsonl line 2: a messages row in a file of text rows \(since "
                            r"line 1\); one kind of row per file \(fields found: messages\)"),
    ([{"question": "q", "answer": "a"}], r"bad.jsonl line 1: unknown row shape \(fields found: "
                                         r"question, answer\)"),
    ([{"text": 3}], r"bad.jsonl line 1: field 'text' is a int, not a string"),
])
def test_bad_rows_name_file_and_line(tmp_path, rows, message):
    f = jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=message):
        read_rows(f)


def _train(tmp_path, capsys, data, *extra):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["--data", str(data), "--out", str(out), "--seq-len", "16", "--batch-size", "2",
              "--steps", "1", "--no-progress", "--sample-tokens", "0", *extra])
    assert e.value.code == 2
    assert not out.exists()  # stopped before anything was written
    return error_line(capsys.readouterr().err)


def test_cli_bad_input_exits_2_naming_file_and_line(tmp_path, capsys):
    f = jsonl(tmp_path / "m.jsonl", ['{"text": "fine"}', "{not json}"])
    assert f"{f} line 2: invalid JSON" in _train(tmp_path, capsys, f)
    f = jsonl(tmp_path / "p.jsonl", [{"completion": "a"}])
    assert f"{f} line 1: a prompt/completion row has no 'prompt' field" in _train(tmp_path, capsys, f)
    f = jsonl(tmp_path / "r.jsonl", [CHAT, CHAT, {"messages": [{"role": "tool", "content": "x"}]}])
    assert f"{f} line 3: messages message 1 has role 'tool'" in _train(tmp_path, capsys, f)
    # chat rows, and no template: the byte tokenizer has none; the line says how to give one
    f = jsonl(tmp_path / "c.jsonl", [CHAT])
    line = _train(tmp_path, capsys, f)
    assert f"{f} line 1: chat rows need a chat template and none was found; give one with " \
           f"--chat-template FILE" in line
    # every example longer than --seq-len + 1 tokens and --truncate drop: nothing left
    f = jsonl(tmp_path / "long.jsonl", [{"text": "x" * 40}, {"text": "y" * 50}])
    line = _train(tmp_path, capsys, f, "--truncate", "drop")
    assert line.endswith(f"{f} line 1: no training examples left after filtering 2 row(s) (42 "
                         f"tokens > --seq-len 16 + 1 (--truncate drop); 2 dropped_too_long)")
    f = jsonl(tmp_path / "f.jsonl", [{"body": "x"}, {"text": "y"}])
    assert f"{f} line 2: no field 'body' (--data-field; fields found: text)" in _train(
        tmp_path, capsys, f, "--data-field", "body")
    txt = tmp_path / "plain.txt"
    txt.write_text("hello")
    assert "--data mixes example rows" in _train(tmp_path, capsys, f"{f},{txt}")
    assert "--data-field body needs example rows" in _train(tmp_path, capsys, txt,
                                                             "--data-field", "body")


def test_text_rows_pack_and_count(tmp_path):
    """Text rows: BOS + text + EOS, all trained; split pieces counted; the rows hold every
    target once."""
    f = jsonl(tmp_path / "t.jsonl", [{"text": "a" * 5}, {"text": "b" * 30}, {"text": "c" * 3},
                                     {"text": "d" * 4}])
    train, evals, stats = load_corpus(str(f), TOK, TOK.vocab_size, seq_len=16, eval_fraction=0.25)
    assert (stats["examples"], stats["train_examples"], stats["eval_examples"]) == (4, 3, 1)
    # "b" * 30 is 32 tokens: pieces of 17 and 16 tokens (16 + 15 targets)
    assert stats["examples_split"] == 1 and stats["trained_tokens"] == 6 + 16 + 15 + 4
    assert stats["masked_tokens"] == 0 and stats["train_tokens"] == len(train) == 41
    assert stats["row_kinds"] == {"text": 4} and stats["eval_tokens"] == 5
    b = train.batcher(4, 16, 0, TOK.pad_id).batch_at(0)
    assert set(b) == {"inputs", "targets", "mask", "segment_ids", "positions"}
    assert all(v.shape == (4, 16) and v.dtype == np.int32 for v in b.values())


def test_data_flags_round_trip_through_config_json():
    from jaxmem.config.flags import given_overrides
    from jaxmem.config.run import RunConfig, is_mutable
    from jaxmem.train.cli import build_parser

    args = build_parser().parse_args(["--data", "c.jsonl", "--data-field", "body", "--chat-template",
                                      "t.jinja", "--train-on", "all", "--no-pack", "--truncate",
                                      "drop"])
    cfg = RunConfig().replace(given_overrides(args))
    d = cfg.data
    assert (d.data_field, d.chat_template, d.train_on, d.no_pack, d.truncate) == \
        ("body", "t.jinja", "all", True, "drop")
    assert RunConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert not any(is_mutable(f"data.{f}") for f in ("data_field", "chat_template", "train_on",
                                                     "no_pack", "truncate"))
    old = cfg.to_dict()  # a config.json written before these fields: today's defaults
    for f in ("data_field", "chat_template", "train_on", "no_pack", "truncate"):
        del old["data"][f]
    assert RunConfig.from_dict(old).data.train_on == "assistant"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--train-on", "user"])


@pytest.mark.slow  # 12.3 s cold on 2 cores (default run kept under 5 min)
def test_packed_run_resumes_bitwise_and_records_counts(tmp_path, capsys):
    """A run of 4 steps on packed text rows, and one stopped at 2 and resumed: the same losses;
    config.json's data_stats and the header carry the trained / masked counts."""
    from runs import SMALL, losses

    f = jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"q{i}: " + "ab" * (i % 5), "completion":
                                          f" a{i}" * (1 + i % 3)} for i in range(40)])
    args = [*SMALL, "--steps", "4", "--eval-every", "2", "--data", str(f)]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    header = capsys.readouterr().out
    stats = json.loads((tmp_path / "a" / "config.json").read_text())["data_stats"]
    assert stats["row_kinds"] == {"pair": 40} and stats["trained_tokens"] > 0
    assert (f"{stats['trained_tokens']:,} trained / {stats['masked_tokens']:,} masked target "
            f"tokens (--train-on assistant)") in header
    assert main([*args, "--out", str(tmp_path / "b"), "--stop-at", "2"]) == 0
    assert main(["--out", str(tmp_path / "b"), "--resume"]) == 0
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


def test_eval_data_is_the_held_out_split(tmp_path):
    train_f = jsonl(tmp_path / "train.jsonl", [{"text": "t" * n} for n in (5, 6, 7, 8)])
    eval_f = jsonl(tmp_path / "eval.jsonl", [{"text": "e" * 9}, {"text": "f" * 3}])
    train, evals, stats = load_corpus(str(train_f), TOK, TOK.vocab_size, seq_len=16,
                                      eval_data=str(eval_f))
    assert (stats["train_examples"], stats["eval_examples"]) == (4, 2)
    assert stats["eval_source"] == str(eval_f) and stats["eval_trained_tokens"] == 10 + 4
    batch = evals.eval_batches(2, 16, None, TOK.pad_id)[0]
    assert set(TOK.decode(batch["inputs"][batch["segment_ids"] > 0])) == {"e", "f"}
    # text files too: all of --data trains, all of --eval-data evaluates
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("x" * 50)
    b.write_text("y" * 20)
    train, evals, stats = load_corpus(str(a), TOK, TOK.vocab_size, seq_len=16, eval_data=str(b))
    assert train.size == 52 and evals.size == 22 and stats["eval_tokens"] == 22
