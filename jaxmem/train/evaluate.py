"""Evaluation: the one function the train loop and `python -m jaxmem.eval` both call.

    batches = EvalBatches(split, batch_size, seq_len, pad_id, max_batches=None)
    result = evaluate(eval_fn, params, batches, extra=(frozen,), place=par.eval_batch,
                      host=par.host)
    result.loss, result.tokens      # mean loss per target token, targets counted

`eval_fn` is the trainer's (jaxmem.train.run.make_eval_fn, or Placement.eval_fn on a mesh):
(params, batch[, frozen base]) -> (sum of token losses, target tokens). The batches are those of
jaxmem.data.split_eval_batches, in order: the windows of a token stream (stride --seq-len), or
the packed example rows with their loss masks, the last batch filled up with padding rows (mask
0). `EvalBatches` builds them one at a time, so evaluating all of a large file never holds all
its batches; batch i is bitwise the i-th of `split_eval_batches` (tests/test_eval_cli.py).

The loss is the sum of every target's loss over the count of targets, both added on the host in
float64 in batch order: the same batches and weights give the same number in the train loop
(its held-out batches, every --eval-every steps) and in the eval command (all of --data).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from jaxmem.data import PackedData, num_windows, split_eval_batches


class EvalBatches:
    """The eval batches [batch_size, seq_len] of a split from `load_corpus` (a token stream or
    `PackedData`), at most `max_batches` of them (None: all), built when indexed."""

    def __init__(self, split, batch_size: int, seq_len: int, pad_id: int,
                 max_batches: int | None = None):
        self.split, self.batch_size, self.seq_len, self.pad_id = split, batch_size, seq_len, pad_id
        if isinstance(split, PackedData):
            rows = len(split.rows)
        else:
            self.split = split = np.asarray(split)
            rows = num_windows(split.size, seq_len) if split.size >= 2 else 0
        n = math.ceil(rows / batch_size)
        self.n = n if max_batches is None else min(n, max_batches)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        """Batch i: split_eval_batches of the part of the split that batch i covers."""
        if not 0 <= i < self.n:
            raise IndexError(i)
        B, T = self.batch_size, self.seq_len
        if isinstance(self.split, PackedData):
            part = replace(self.split, rows=self.split.rows[i * B:(i + 1) * B])
        else:  # windows i*B ... i*B + B - 1: tokens from (i*B)*T, T + 1 for the last
            part = self.split[i * B * T:(i + 1) * B * T + 1]
        (batch,) = split_eval_batches(part, B, T, None, pad_id=self.pad_id)
        return batch


@dataclass(frozen=True)
class EvalResult:
    """loss: mean loss per target token (nats; nan when no target was evaluated); tokens: the
    targets counted (mask 1); batches: how many batches were evaluated."""

    loss: float
    tokens: int
    batches: int


def evaluate(eval_fn, params, batches, extra: tuple = (), place=lambda b: b,
             host=np.asarray, progress=None) -> EvalResult:
    """The mean token loss of `params` over `batches` (a sequence of numpy batch dicts).

    extra: the eval function's arguments after the batch (a LoRA run's frozen base: the
    trainable's `step_args`). place: puts a host batch where the eval function takes it
    (`Placement.eval_batch`). host: reads a device value (`Placement.host`). progress: called
    with 1 after each batch is read back. One batch is in flight while the previous one's sums
    are read, so the host builds the next batch while the device computes.
    """
    total, count, pending = 0.0, 0.0, None

    def read(sums):
        nonlocal total, count
        loss_sum, n = host(sums)
        total += float(np.float64(loss_sum))
        count += float(np.float64(n))
        if progress is not None:
            progress(1)

    for i in range(len(batches)):
        sums = eval_fn(params, place(batches[i]), *extra)
        if pending is not None:
            read(pending)
        pending = sums
    if pending is not None:
        read(pending)
    return EvalResult(total / count if count else float("nan"), int(round(count)), len(batches))
