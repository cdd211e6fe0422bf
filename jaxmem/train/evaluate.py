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
from dataclasses import dataclass, field, replace

import jax
import numpy as np

from jaxmem.objective import CausalLM

from jaxmem.data import PackedData, PreferencePairs, num_windows, split_eval_batches


class EvalBatches:
    """The eval batches [batch_size, seq_len] of a split from `load_corpus` (a token stream or
    `PackedData`), at most `max_batches` of them (None: all), built when indexed."""

    def __init__(self, split, batch_size: int, seq_len: int, pad_id: int,
                 max_batches: int | None = None):
        self.split, self.batch_size, self.seq_len, self.pad_id = split, batch_size, seq_len, pad_id
        self.built = None
        if isinstance(split, PreferencePairs):  # the pairs in order, built at once
            self.built = split.eval_batches(batch_size, seq_len, max_batches, pad_id)
            self.n = len(self.built)
            return
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
        if self.built is not None:
            return self.built[i]
        B, T = self.batch_size, self.seq_len
        if isinstance(self.split, PackedData):
            part = replace(self.split, rows=self.split.rows[i * B:(i + 1) * B])
        else:  # windows i*B ... i*B + B - 1: tokens from (i*B)*T, T + 1 for the last
            part = self.split[i * B * T:(i + 1) * B * T + 1]
        (batch,) = split_eval_batches(part, B, T, None, pad_id=self.pad_id)
        return batch


@dataclass(frozen=True)
class EvalResult:
    """loss: the objective's mean (causal LM: per target token, nats; nan when nothing was
    evaluated); tokens: the examples counted (causal LM: targets with mask 1; a preference
    objective: pairs); batches: how many batches were evaluated; metrics: the objective's
    (a preference objective's rewards/..., logps/...; {} for causal LM)."""

    loss: float
    tokens: int
    batches: int
    metrics: dict = field(default_factory=dict)


def _host_tree(tree):
    return jax.tree.map(np.asarray, tree)


def evaluate(eval_fn, params, batches, extra: tuple = (), place=lambda b: b,
             host=_host_tree, progress=None, objective=None) -> EvalResult:
    """The objective's mean of `params` over `batches` (a sequence of numpy batch dicts).

    extra: the eval function's arguments after the batch (a LoRA run's frozen base: the
    trainable's `step_args`). place: puts a host batch where the eval function takes it
    (`Placement.eval_batch`). host: reads a device value (`Placement.host`). progress: called
    with 1 after each batch is read back. objective: the run's (jaxmem.objective; None: causal
    LM), whose `value` turns the float64 totals of every batch's sums and counts into the loss
    and metrics. One batch is in flight while the previous one's sums are read, so the host
    builds the next batch while the device computes.
    """
    objective = CausalLM() if objective is None else objective
    total_sums: dict = {}
    total_counts: dict = {}
    pending = None

    def read(out):
        s, c = host(out)
        for totals, part in ((total_sums, s), (total_counts, c)):
            for k, v in part.items():
                totals[k] = totals.get(k, 0.0) + float(np.float64(v))
        if progress is not None:
            progress(1)

    for i in range(len(batches)):
        sums = eval_fn(params, place(batches[i]), *extra)
        if pending is not None:
            read(pending)
        pending = sums
    if pending is not None:
        read(pending)
    n = total_counts.get(objective.unit, 0.0)
    if not n:
        return EvalResult(float("nan"), 0, len(batches))
    loss, metrics = objective.value({k: np.float64(v) for k, v in total_sums.items()},
                                    {k: np.float64(v) for k, v in total_counts.items()}, xp=np)
    return EvalResult(float(loss), int(round(n)), len(batches),
                      {k: float(v) for k, v in metrics.items()})
