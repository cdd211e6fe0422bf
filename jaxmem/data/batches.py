"""Packed, resumable training batches and deterministic eval batches (see jaxmem.data.sources
for the windowing and shuffling rules)."""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

from jaxmem.data.errors import DataError


# ----------------------------------------------------------------------------- batches


def num_windows(n_tokens: int, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens with stride seq_len that cover n_tokens (the last may be
    partial and padded); at least 1."""
    return max(1, math.ceil((n_tokens - 1) / seq_len))


def window(tokens: np.ndarray, index: int, seq_len: int, pad_id: int):
    """(inputs, targets, mask) of window `index`, each int32 [seq_len]."""
    start = index * seq_len
    w = np.asarray(tokens[start:start + seq_len + 1], dtype=np.int32)
    n_real = w.size
    if n_real < seq_len + 1:
        w = np.concatenate([w, np.full(seq_len + 1 - n_real, pad_id, np.int32)])
    mask = (np.arange(seq_len) < n_real - 1).astype(np.int32)  # 0 wherever the target is PAD
    return w[:-1], w[1:], mask


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The window order of `epoch`: a fixed function of (seed, epoch, n)."""
    return np.random.Generator(np.random.PCG64([int(seed), int(epoch)])).permutation(n)


def _stack(rows):
    inputs, targets, mask = zip(*rows)
    return {"inputs": np.stack(inputs), "targets": np.stack(targets), "mask": np.stack(mask)}


def batch_at(tokens: np.ndarray, seed: int, batch_size: int, seq_len: int, position: int,
             pad_id: int) -> dict:
    """Batch number `position` (a pure function of its arguments; see the module docstring)."""
    return Batcher(tokens, batch_size, seq_len, seed, pad_id=pad_id).batch_at(position)


class EpochRows:
    """Batches of `batch_size` rows out of `num_windows`, each epoch in its own seeded order:
    `batch_at(position)` is pure (only the epoch permutations are cached). A subclass sets
    `num_windows`, `batch_size`, `seed`, `_perms` and says what row `index` is (`_row`)."""

    num_windows: int
    batch_size: int
    seed: int
    _perms: OrderedDict

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms[epoch] = epoch_permutation(self.seed, epoch, self.num_windows)
            while len(self._perms) > 4:
                self._perms.popitem(last=False)
        return self._perms[epoch]

    def epoch(self, position: int) -> float:
        """Epochs completed (fractional) before batch `position`."""
        return position * self.batch_size / self.num_windows

    def indices_at(self, position: int) -> list[int]:
        """The rows (their indices in the split) of batch `position`, in order."""
        if position < 0:
            raise DataError(f"batch position must be >= 0, got {position}")
        out = []
        for k in range(position * self.batch_size, (position + 1) * self.batch_size):
            epoch, i = divmod(k, self.num_windows)
            out.append(int(self._perm(epoch)[i]))
        return out

    def batch_at(self, position: int) -> dict:
        return self._stack([self._row(i) for i in self.indices_at(position)])

    @staticmethod
    def _stack(rows):
        return _stack(rows)


class Batcher(EpochRows):
    """Packed training batches of shape [batch_size, seq_len] from a token stream.

    `batch_at(position)` is pure; the class only caches epoch permutations. Save `position + 1`
    (the index of the next batch) in the checkpoint and resume with `batch_at` from there.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0,
                 *, pad_id: int):
        if batch_size < 1 or seq_len < 1:
            raise DataError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        if int(seed) < 0:
            raise DataError(f"seed must be >= 0, got {seed}")
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.size < 2:
            raise DataError(f"need a 1-D token stream of at least 2 tokens, got shape "
                            f"{tokens.shape}")
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.seed, self.pad_id = int(seed), pad_id
        self.num_windows = num_windows(tokens.size, seq_len)
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def _row(self, index: int) -> dict:
        return window(self.tokens, index, self.seq_len, self.pad_id)

    def iterate(self, start: int = 0):
        """Batches start, start + 1, ... forever."""
        position = start
        while True:
            yield self.batch_at(position)
            position += 1


def eval_batches(eval_tokens: np.ndarray, batch_size: int, seq_len: int,
                 max_batches: int | None = None, *, pad_id: int) -> list[dict]:
    """Deterministic eval batches: the windows in stream order, no shuffling. The last batch is
    filled up with all-PAD rows (mask 0) so every batch has the same shape [B, T]. Empty for an
    empty (or 1-token) eval split."""
    eval_tokens = np.asarray(eval_tokens)
    if eval_tokens.size < 2:
        return []
    n = num_windows(eval_tokens.size, seq_len)
    n_batches = math.ceil(n / batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    empty = (np.full(seq_len, pad_id, np.int32), np.full(seq_len, pad_id, np.int32),
             np.zeros(seq_len, np.int32))
    out = []
    for b in range(n_batches):
        rows = [window(eval_tokens, j, seq_len, pad_id) if j < n else empty
                for j in range(b * batch_size, (b + 1) * batch_size)]
        out.append(_stack(rows))
    return out
