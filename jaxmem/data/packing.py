"""Examples packed into fixed-length rows with segment ids, as resumable batches.

    ex = Examples.of([(ids, trained), ...])                 # flat storage of tokenized examples
    pieces, counts = cut_pieces(ex, seq_len, "split")        # examples longer than T + 1 tokens
    rows = plan_rows(pieces[:, 1] - 1, seq_len, pack=True)   # piece indices of each row
    PackedBatcher(ex, pieces, rows, B, T, seed, pad_id).batch_at(position)
    packed_eval_batches(ex, pieces, rows, B, T, max_batches, pad_id)

A piece of n tokens contributes n - 1 (input, target) pairs to a row. A batch is a dict of int32
arrays [B, T]: `inputs`, `targets`, `mask` (1 where the target is trained), `segment_ids`
(0 = padding, 1, 2, ... = the k-th piece in the row) and `positions` (0 at each piece's first
input, counting up; 0 in padding). The model reads the last two to keep attention inside a
segment and restart RoPE (the `packing` branch: jaxmem.train.loss.token_loss).

Truncation: a piece holds at most T + 1 tokens. `split` cuts a longer example into pieces of
T + 1 tokens with stride T (every target is kept once, each piece starts its own segment at
position 0), `drop` leaves it out; both are counted.

Packing is best-fit decreasing: pieces by length, longest first (ties in data order), each into
the fullest row it still fits (a new row otherwise). `pack=False` gives each piece its own row,
padded. The rows are fixed at load time, so batches are a pure function of (rows, seed,
position) exactly as the text windows are (jaxmem.data.batches): epoch e visits the rows in the
order `epoch_permutation(seed, e, n_rows)`, and the train state's data position (batches
consumed) is the whole of the packer's state: a resume sees the batches an uninterrupted run does.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from jaxmem.data.batches import EpochRows
from jaxmem.data.errors import DataError

KEYS = ("inputs", "targets", "mask", "segment_ids", "positions")


@dataclass(frozen=True)
class Examples:
    """Tokenized examples stored flat: example k is tokens[starts[k]:starts[k + 1]]; `trained`
    (bool, same length) marks the tokens that are training targets."""

    tokens: np.ndarray
    trained: np.ndarray
    starts: np.ndarray

    @classmethod
    def of(cls, encoded) -> "Examples":
        encoded = list(encoded)
        lengths = [ids.size for ids, _ in encoded]
        starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
        if not encoded:
            return cls(np.zeros(0, np.int32), np.zeros(0, bool), starts)
        return cls(np.concatenate([ids for ids, _ in encoded]).astype(np.int32),
                   np.concatenate([t for _, t in encoded]).astype(bool), starts)

    def __len__(self) -> int:
        return self.starts.size - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    def subset(self, lo: int, hi: int) -> "Examples":
        """Examples lo .. hi - 1."""
        a, b = int(self.starts[lo]), int(self.starts[hi])
        return Examples(self.tokens[a:b], self.trained[a:b], self.starts[lo:hi + 1] - a)


def cut_pieces(ex: Examples, seq_len: int, truncate: str = "split"):
    """(pieces int64 [P, 2] of (start, n_tokens) into ex.tokens, counts dict). Examples of fewer
    than 2 tokens (no target) are skipped and counted, and so are the pieces of a split example
    that hold no trained target (a long system prompt's first piece): they would add nothing to
    the loss but padding to a batch."""
    pieces, split, dropped, short, untrained = [], 0, 0, 0, 0
    for k in range(len(ex)):
        a, n = int(ex.starts[k]), int(ex.starts[k + 1] - ex.starts[k])
        if n < 2:
            short += 1
            continue
        if n <= seq_len + 1:
            pieces.append((a, n))
        elif truncate == "drop":
            dropped += 1
        else:
            split += 1
            for j in range(0, n - 1, seq_len):  # piece j: tokens [j, j + T + 1): targets j+1 ..
                m = min(seq_len + 1, n - j)
                if ex.trained[a + j + 1:a + j + m].any():
                    pieces.append((a + j, m))
                else:
                    untrained += 1
    arr = np.asarray(pieces, np.int64).reshape(-1, 2)
    return arr, {"examples_split": split, "examples_dropped": dropped,
                 "examples_too_short": short, "pieces": int(arr.shape[0]),
                 "pieces_without_trained_tokens": untrained}


def plan_rows(n_targets: np.ndarray, seq_len: int, pack: bool = True) -> list[list[int]]:
    """Piece indices of each row (best-fit decreasing; see the module docstring)."""
    n_targets = np.asarray(n_targets, np.int64)
    if n_targets.size and (n_targets.min() < 1 or n_targets.max() > seq_len):
        raise DataError(f"pieces must hold 1 to {seq_len} targets")
    if not pack:
        return [[i] for i in range(n_targets.size)]
    order = sorted(range(n_targets.size), key=lambda i: (-int(n_targets[i]), i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row index), sorted: best fit = first >= need
    for i in order:
        need = int(n_targets[i])
        j = bisect.bisect_left(free, (need, -1))
        if j == len(free):
            rows.append([i])
            room, r = seq_len - need, len(rows) - 1
        else:
            room, r = free.pop(j)
            rows[r].append(i)
            room -= need
        if room > 0:
            bisect.insort(free, (room, r))
    return rows


def build_row(ex: Examples, pieces: np.ndarray, row: list[int], seq_len: int, pad_id: int) -> dict:
    """The five [T] arrays of one row (see the module docstring)."""
    out = {k: np.zeros(seq_len, np.int32) for k in KEYS}
    out["inputs"][:] = pad_id
    out["targets"][:] = pad_id
    at = 0
    for seg, p in enumerate(row, 1):
        a, n = int(pieces[p, 0]), int(pieces[p, 1])
        m = n - 1
        out["inputs"][at:at + m] = ex.tokens[a:a + m]
        out["targets"][at:at + m] = ex.tokens[a + 1:a + n]
        out["mask"][at:at + m] = ex.trained[a + 1:a + n]
        out["segment_ids"][at:at + m] = seg
        out["positions"][at:at + m] = np.arange(m)
        at += m
    return out


def _stack(rows: list[dict]) -> dict:
    return {k: np.stack([r[k] for r in rows]) for k in KEYS}


class PackedBatcher(EpochRows):
    """Training batches [batch_size, seq_len] of packed rows; `batch_at(position)` is pure (the
    class caches epoch permutations), as `jaxmem.data.batches.Batcher`."""

    def __init__(self, ex: Examples, pieces: np.ndarray, rows: list[list[int]], batch_size: int,
                 seq_len: int, seed: int = 0, *, pad_id: int):
        if batch_size < 1 or seq_len < 1:
            raise DataError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        if not rows:
            raise DataError("no training rows: every example was filtered out")
        self.ex, self.pieces, self.rows = ex, pieces, rows
        self.batch_size, self.seq_len, self.seed, self.pad_id = batch_size, seq_len, int(seed), pad_id
        self.num_windows = len(rows)  # the name Batcher uses: rows visited once per epoch
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def _row(self, index: int) -> dict:
        return build_row(self.ex, self.pieces, self.rows[index], self.seq_len, self.pad_id)

    @staticmethod
    def _stack(rows):
        return _stack(rows)


def packed_eval_batches(ex: Examples, pieces: np.ndarray, rows: list[list[int]], batch_size: int,
                        seq_len: int, max_batches: int | None = None, *, pad_id: int) -> list[dict]:
    """Eval batches: the rows in order; the last batch filled with all-padding rows (mask 0,
    segment 0)."""
    n_batches = math.ceil(len(rows) / batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    batches = []
    for b in range(n_batches):
        chunk = rows[b * batch_size:(b + 1) * batch_size]
        chunk = chunk + [[]] * (batch_size - len(chunk))
        batches.append(_stack([build_row(ex, pieces, r, seq_len, pad_id) for r in chunk]))
    return batches
