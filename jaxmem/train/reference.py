"""DPO's reference for a full fine-tune, precomputed (`--reference precompute`): one pass of the
step-0 model over every preference pair before training, so no second copy of the weights is
ever held (TRL's `precompute_ref_log_probs`).

    fn = make_logps_fn(step_cfg)             # jit(params, batch[, frozen]) -> per-row sums [2B]
    table = precompute(fn, params, pairs, B, T, pad_id)   # [n_pairs, 2] fp32: chosen, rejected
    batcher = WithReference(pairs.batcher(B, T, seed, pad_id), table)
    batcher.batch_at(position)["ref_logps"]   # [2B, T] fp32, each row's sum in column 0

The table is indexed by the pair's place in its split, which the batcher's order maps to
(`EpochRows.indices_at`), so a batch's reference values are a pure function of the
data position as its tokens are: a resumed run reads the saved table (reference_logps.npz in the
run directory) and sees the batches an uninterrupted one does. The objective reads the row sums
as `sum(ref_logps, -1)` (jaxmem.train.step.reference_sums).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from jaxmem.objective.base import row_logps
from jaxmem.train.step import EVAL_REMAT

REFERENCE_FILE = "reference_logps.npz"


def make_logps_fn(cfg):
    """jit(params, batch[, frozen]) -> each row's completion log-prob sum [rows] (fp32), under
    the evaluation's model (nothing differentiated) with the run's fused head."""
    model = cfg.build_model(EVAL_REMAT)

    @jax.jit
    def logps(params, batch, frozen=None):
        params, dtype = cfg.trainable.model_params(params, frozen, cfg.precision.compute_dtype)
        return row_logps(model, params, batch, cfg.attention_padding, dtype, cfg.loss_chunk)

    return logps


def precompute(fn, params, pairs, batch_size: int, seq_len: int, pad_id: int,
               place=lambda b: b) -> np.ndarray:
    """[len(pairs), 2] fp32: each pair's (chosen, rejected) completion log-prob sum under
    `params`, in the split's order (its eval batches: every pair once, padding pairs after)."""
    out = [np.asarray(fn(params, place(batch)), np.float32)
           for batch in pairs.eval_batches(batch_size, seq_len, None, pad_id)]
    rows = np.concatenate(out) if out else np.zeros(0, np.float32)
    return rows.reshape(-1, 2)[:len(pairs)]


def ref_column(table: np.ndarray, indices: np.ndarray, seq_len: int) -> np.ndarray:
    """[2B, T] fp32: the pairs' (chosen, rejected) sums in column 0, interleaved as the batch's
    rows; a padding pair (index -1) gets 0."""
    sums = np.where(indices[:, None] >= 0, table[np.maximum(indices, 0)], 0.0)  # [B, 2]
    col = np.zeros((2 * len(indices), seq_len), np.float32)
    col[:, 0] = sums.reshape(-1)
    return col


class WithReference:
    """A preference batcher whose batches carry `ref_logps` from a precomputed table."""

    def __init__(self, batcher, table: np.ndarray, seq_len: int):
        self.batcher, self.table, self.seq_len = batcher, table, seq_len

    def batch_at(self, position: int) -> dict:
        batch = self.batcher.batch_at(position)
        idx = np.asarray(self.batcher.indices_at(position))
        return {**batch, "ref_logps": ref_column(self.table, idx, self.seq_len)}

    def epoch(self, position: int) -> float:
        return self.batcher.epoch(position)


def with_reference_eval(batches: list, table: np.ndarray, batch_size: int, seq_len: int) -> list:
    """The eval batches (in order, every pair once) with their `ref_logps` from `table`."""
    out = []
    for i, b in enumerate(batches):
        idx = np.arange(i * batch_size, (i + 1) * batch_size)
        idx = np.where(idx < len(table), idx, -1)
        out.append({**b, "ref_logps": ref_column(table, idx, seq_len)})
    return out


def reference_tables(s, params, par, resumed: bool):
    """A full fine-tune's DPO reference for the run `s` (jaxmem.train.setup.Setup): {"train",
    "eval"} tables of each pair's (chosen, rejected) log-prob sums under the step-0 `params`,
    computed once before the first step and kept in the run directory, which a resumed run
    reads (jaxmem.train.cli refuses a resume without it); None where the objective needs no
    precomputed reference (causal LM, ORPO, SimPO, a LoRA run's DPO)."""
    if not s.step_cfg.objective.reference or s.frozen is not None:
        return None
    path = s.out / REFERENCE_FILE
    if resumed:
        with np.load(path) as z:
            return {"train": z["train"], "eval": z["eval"]}
    d, fn = s.cfg.data, make_logps_fn(s.step_cfg)
    t0 = time.perf_counter()
    tables = {name: precompute(fn, params, split, d.batch_size, d.seq_len, s.tokenizer.pad_id,
                               place=par.eval_batch)
              for name, split in (("train", s.train_tokens), ("eval", s.eval_tokens))}
    print(f"DPO reference: the step-0 model's log-probs of {len(tables['train']):,} train and "
          f"{len(tables['eval']):,} eval pairs, precomputed in {time.perf_counter() - t0:.1f} s "
          f"(no reference weights are kept)", flush=True)
    return tables


def save_tables(s, tables, par) -> None:
    """Write the precomputed reference into the run directory (once, by the main process)."""
    path = s.out / REFERENCE_FILE
    if tables is not None and not path.is_file() and par.is_main:
        np.savez(path, **tables)
