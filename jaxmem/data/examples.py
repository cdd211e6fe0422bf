"""Example datasets (`.jsonl` / `.json` / `.parquet` rows): load, mask, filter, split, pack.

    train, evals, stats = load_examples(files, tokenizer, vocab_size, seq_len=T, ...)
    train.batcher(B, T, seed, pad_id).batch_at(position)      # jaxmem.data.packing
    evals.eval_batches(B, T, max_batches, pad_id)

Rows are read in file order (jaxmem.data.formats), each tokenized with its loss mask
(jaxmem.data.masks: the chat template for messages), then filtered: an example with no trained
target (a conversation without an assistant turn, under --train-on assistant), with fewer than
2 tokens, or (--truncate drop) longer than T + 1 tokens is left out and counted. The held-out
eval split is the last `eval_fraction` of the examples (at least one, at most half; none from a
single example), packed the same way. Nothing left to train on is an error naming the files and
the first row left out.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from jaxmem.data.chat import find_chat_template, with_tokenizer_specials
from jaxmem.data.errors import DataError
from jaxmem.data.formats import read_rows
from jaxmem.data.masks import encode_row
from jaxmem.data.packing import (Examples, PackedBatcher, cut_pieces, packed_eval_batches,
                                 plan_rows)


@dataclass(frozen=True)
class PackedData:
    """One split: its examples, their pieces and the rows the pieces are packed into."""

    examples: Examples
    pieces: np.ndarray
    rows: list

    @classmethod
    def build(cls, ex: Examples, seq_len: int, truncate: str, pack: bool):
        pieces, counts = cut_pieces(ex, seq_len, truncate)
        return cls(ex, pieces, plan_rows(pieces[:, 1] - 1, seq_len, pack)), counts

    def __len__(self) -> int:  # tokens in the rows (inputs), as len() of a token stream
        return int((self.pieces[:, 1] - 1).sum()) if self.pieces.size else 0

    def target_counts(self) -> tuple[int, int]:
        """(trained, masked) targets in the rows (padding not counted)."""
        trained = sum(int(self.examples.trained[a + 1:a + n].sum()) for a, n in self.pieces)
        return trained, len(self) - trained

    def batcher(self, batch_size: int, seq_len: int, seed: int, pad_id: int) -> PackedBatcher:
        return PackedBatcher(self.examples, self.pieces, self.rows, batch_size, seq_len, seed,
                             pad_id=pad_id)

    def eval_batches(self, batch_size: int, seq_len: int, max_batches, pad_id: int) -> list:
        return packed_eval_batches(self.examples, self.pieces, self.rows, batch_size, seq_len,
                                   max_batches, pad_id=pad_id)


def _eval_count(n: int, eval_fraction: float) -> int:
    if eval_fraction <= 0 or n < 2:
        return 0
    return min(max(math.ceil(eval_fraction * n), 1), n // 2)


def load_examples(files, tokenizer, vocab_size: int, *, seq_len: int, eval_fraction: float,
                  data_field: str | None = None, chat_template: str | None = None,
                  train_on: str = "assistant", truncate: str = "split", pack: bool = True):
    """(train PackedData, eval PackedData, stats) of example files (see the module docstring)."""
    rows = [row for f in files for row in read_rows(f, data_field)]
    kinds = {k: sum(r.kind == k for r in rows) for k in ("text", "messages", "pair")}
    template = _template_for(rows, tokenizer, chat_template)
    kept, left_out = _encode_rows(rows, tokenizer, template, vocab_size, files=files,
                                  seq_len=seq_len, train_on=train_on, truncate=truncate)
    ex = Examples.of(kept)
    n_eval = _eval_count(len(ex), eval_fraction)
    train, tcounts = PackedData.build(ex.subset(0, len(ex) - n_eval), seq_len, truncate, pack)
    evals, ecounts = PackedData.build(ex.subset(len(ex) - n_eval, len(ex)), seq_len, truncate, pack)
    if not train.rows:
        raise DataError(f"{', '.join(map(str, files))}: no training examples left after filtering: "
                        f"every piece of the {len(ex) - n_eval} training example(s) cut at "
                        f"--seq-len {seq_len} holds no trained token (raise --seq-len)")
    digest = hashlib.sha256()
    for a in (ex.tokens, ex.trained.astype(np.uint8), ex.starts):
        digest.update(np.ascontiguousarray(a).tobytes())
    trained, masked = train.target_counts()
    eval_trained, eval_masked = evals.target_counts()
    slots = len(train.rows) * seq_len
    stats = {
        "format": "examples",
        "rows": len(rows),
        "row_kinds": {k: v for k, v in kinds.items() if v},
        "examples": len(ex),
        "train_examples": len(ex) - n_eval,
        "eval_examples": n_eval,
        "left_out": left_out,
        "truncate": truncate,
        "examples_split": tcounts["examples_split"] + ecounts["examples_split"],
        "pieces": tcounts["pieces"] + ecounts["pieces"],
        "pieces_without_trained_tokens": (tcounts["pieces_without_trained_tokens"]
                                          + ecounts["pieces_without_trained_tokens"]),
        "packed": pack,
        "train_rows": len(train.rows),
        "eval_rows": len(evals.rows),
        "row_fill": round(len(train) / slots, 4) if slots else 0.0,
        "train_on": train_on,
        "trained_tokens": trained,
        "masked_tokens": masked,
        "eval_trained_tokens": eval_trained,
        "eval_masked_tokens": eval_masked,
        "tokens": int(ex.tokens.size),
        "train_tokens": len(train),
        "eval_tokens": len(evals),
        "tokens_sha256": digest.hexdigest(),
    }
    if template is not None:
        stats["chat_template"] = {"source": template.source, "sha256": template.sha256}
    return train, evals, stats


def _template_for(rows, tokenizer, chat_template: str | None):
    """The chat template the rows need (messages, or a pair that is not two strings) or that
    --chat-template gives, with the tokenizer's special tokens; else None."""
    needs_template = any(r.kind == "messages" or (r.kind == "pair" and not all(
        isinstance(v, str) for v in r.value)) for r in rows)
    if not (needs_template or chat_template is not None):
        return None
    return with_tokenizer_specials(
        find_chat_template(getattr(tokenizer, "path", None), chat_template), tokenizer)


def _encode_rows(rows, tokenizer, template, vocab_size: int, *, files, seq_len: int,
                 train_on: str, truncate: str) -> tuple[list, dict[str, int]]:
    """(kept, left_out): each kept row's (ids, trained mask), and the rows left out counted by
    why. Raises DataError on a token id outside the vocabulary, or when no row is kept (naming
    the first row left out and why)."""
    kept, left_out = [], {"no_trained_tokens": 0, "dropped_too_long": 0, "too_short": 0}
    first_left_out = None
    for row in rows:
        ids, trained = encode_row(row, tokenizer, template, train_on)
        if ids.size and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
            raise DataError(f"{row.where}: token id {int(ids.max())} is outside the model's "
                            f"vocabulary of {vocab_size}")
        why = ("too_short" if ids.size < 2 else
               "no_trained_tokens" if not trained[1:].any() else
               "dropped_too_long" if truncate == "drop" and ids.size > seq_len + 1 else None)
        if why is not None:
            left_out[why] += 1
            first_left_out = first_left_out or (row.where, why, ids.size)
            continue
        kept.append((ids, trained))
    if kept:
        return kept, left_out
    where, why, n = first_left_out or (", ".join(map(str, files)), "no rows", 0)
    reason = {"too_short": "fewer than 2 tokens",
              "no_trained_tokens": f"no trained token (--train-on {train_on}: no assistant "
                                   f"turn or completion)",
              "dropped_too_long": f"{n} tokens > --seq-len {seq_len} + 1 (--truncate drop)",
              }.get(why, why)
    raise DataError(f"{where}: no training examples left after filtering {len(rows)} row(s) "
                    f"({reason}; {', '.join(f'{v} {k}' for k, v in left_out.items() if v)})")


def example_options(section) -> dict:
    """load_corpus's example options from a run's DataSection (jaxmem.config.data)."""
    return dict(eval_data=section.eval_data, data_field=section.data_field,
                chat_template=section.chat_template,
                train_on=section.train_on, truncate=section.truncate, pack=not section.no_pack)


def describe(stats: dict, seq_len: int) -> str:
    """The data part of the training log's header."""
    if stats.get("format") != "examples":
        return f"{stats['train_tokens']:,} train tokens"
    kinds = "/".join(stats["row_kinds"])
    how = "packed into" if stats["packed"] else "padded to"
    return (f"{stats['train_examples']:,} {kinds} examples {how} {stats['train_rows']:,} rows of "
            f"{seq_len} (fill {100 * stats['row_fill']:.0f}%), {stats['trained_tokens']:,} trained "
            f"/ {stats['masked_tokens']:,} masked target tokens (--train-on {stats['train_on']})")
