"""What casting a run's real gradients into each format does to them.

    python -m jaxmem.dtypes --gradients RUN_DIR

takes the newest checkpoint of a jaxmem run, computes the fp32 gradients of one held-out batch
(fp32 compute, no remat, whatever the run's precision: the true values), and reports for each
format the fraction of non-zero gradient values that, when cast,

    overflow        become inf or NaN, or saturate at the format's max (|g| > max)
    negative        (unsigned formats only, e8m0fnu) are negative: the format cannot hold
                    them at all; counted apart from overflow (about half of all gradients)
    underflow       flush to zero
    lose precision  keep less than half their significand bits: relative rounding error
                    above 2**-((mantissa_bits + 1) / 2)  (normal values err by at most
                    2**-(mantissa_bits + 1); subnormals lose bits as they shrink)

at scale 1 and at the run's loss scale (and at torch's default 2**16 when the run has no
scale), which shows on real numbers why fp16 needs loss scaling and bf16 does not.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

MAX_VALUES = 4_000_000  # a fixed, evenly strided sample of the gradient beyond this


def cast_stats(values: np.ndarray, dtype) -> dict:
    """Fractions of the non-zero `values` (fp32) that overflow, underflow or lose precision."""
    x = np.asarray(values, np.float32)
    x = x[x != 0]
    fi = ml_dtypes.finfo(dtype)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        q = x.astype(dtype).astype(np.float64)
    x64 = x.astype(np.float64)
    unsigned = float(fi.min) >= 0  # e8m0fnu: an exponent only, no sign bit
    negative = (x64 < 0) if unsigned else np.zeros(x64.shape, bool)
    overflow = ~negative & (~np.isfinite(q) | (np.abs(x64) > float(fi.max)))
    underflow = ~negative & ~overflow & (q == 0)
    ok = ~negative & ~overflow & ~underflow
    rel = np.abs(q[ok] - x64[ok]) / np.abs(x64[ok])
    lost = int(np.sum(rel > 2.0 ** (-(int(fi.nmant) + 1) / 2)))
    n = max(x.size, 1)
    return {"overflow": float(overflow.sum()) / n, "underflow": float(underflow.sum()) / n,
            "precision_lost": lost / n, "negative": float(negative.sum()) / n if unsigned else None,
            "nonzero_values": int(x.size)}


def run_gradients(run_dir: Path) -> tuple[np.ndarray, float, dict]:
    """(flat fp32 gradient sample, the run's loss scale, the run's RunConfig)."""
    from jaxmem.data import eval_batches, load_corpus
    from jaxmem.train.rundir import load_run
    from jaxmem.train.loss import token_loss
    from jaxmem import families
    from jaxmem.model.precision import cast_floating

    run = load_run(Path(run_dir))
    d = run.config.data
    _, eval_tokens, _ = load_corpus(d.data, run.tokenizer, run.model_config.vocab_size,
                                    seq_len=d.seq_len)
    batch = eval_batches(eval_tokens, d.batch_size, d.seq_len, 1, pad_id=run.tokenizer.pad_id)[0]
    params = cast_floating(run.state.params, np.float32)
    def mean_loss(p, b):  # the train step's loss (causal attention; padding only in the weights)
        total, count = token_loss(families.model(run.model_config), p, b)
        return total / jax.numpy.maximum(count, 1.0)

    grads = jax.jit(jax.grad(mean_loss))(params, batch)
    flat = np.concatenate([np.asarray(g, np.float32).ravel() for g in jax.tree_util.tree_leaves(grads)])
    if flat.size > MAX_VALUES:
        flat = flat[:: flat.size // MAX_VALUES + 1]
    return flat, float(run.state.loss_scale.loss_scale), run.config


def gradient_report(run_dir: Path, formats) -> dict:
    """Per format and scale: the cast statistics of the run's gradients."""
    grads, run_scale, config = run_gradients(run_dir)
    scales = sorted({1.0, run_scale} | ({2.0**16} if run_scale == 1.0 else set()))
    rows = []
    for scale in scales:
        for name, dt in formats:
            rows.append({"format": name, "scale": scale, **cast_stats(grads * scale, dt)})
    absg = np.abs(grads[grads != 0])
    return {"run": str(run_dir), "precision": config.precision.mode, "run_loss_scale": run_scale,
            "values": int(grads.size), "abs_min": float(absg.min()), "abs_median": float(np.median(absg)),
            "abs_max": float(absg.max()), "rows": rows}
