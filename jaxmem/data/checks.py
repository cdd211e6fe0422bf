"""Warnings about training data that loads but is probably not what the user meant.

    dedupe_files(files)                  files reached twice (symlinks, overlapping globs) once
    binary_share(raw, replaced)          the share of a text file's bytes that were not UTF-8
    data_warnings(stats, batch_tokens, steps)   console lines for `jaxmem.train`

A warning never stops a run (the data may be exactly what was meant); it is printed before
training starts and recorded in config.json's data_stats.
"""

from __future__ import annotations

import os
from pathlib import Path

# Share of a text file's bytes replaced as invalid UTF-8 above which it "looks binary". Real text
# in a legacy encoding (Latin-1 accents) stays far below; images, archives and executables are
# typically 30-60% invalid.
BINARY_SHARE = 0.05
# Epochs over the train split above which repeating the data is called out as a warning.
MANY_EPOCHS = 10.0


def dedupe_files(files: list[Path]) -> tuple[list[Path], list[str]]:
    """(files in order, each real file once; the paths dropped as repeats of an earlier one)."""
    seen, kept, dropped = set(), [], []
    for f in files:
        real = os.path.realpath(f)
        if real in seen:
            dropped.append(str(f))
        else:
            seen.add(real)
            kept.append(f)
    return kept, dropped


def binary_share(n_bytes: int, replaced: int) -> float:
    return replaced / n_bytes if n_bytes else 0.0


def data_warnings(stats: dict, batch_tokens: int, steps: int) -> list[str]:
    """Console lines about the loaded data for a run of `steps` steps of `batch_tokens` tokens."""
    out = []
    for path, share in stats.get("binary_looking_files", {}).items():
        out.append(f"warning: {path} looks binary: {100 * share:.0f}% of its bytes are not UTF-8 "
                   f"(replaced); leave it out of --data unless it is really text")
    dropped = stats.get("duplicate_files_skipped") or []
    if dropped:
        out.append(f"note: {len(dropped)} file(s) reached twice (symlinks or overlapping patterns) "
                   f"read once: {', '.join(dropped[:3])}{' ...' if len(dropped) > 3 else ''}")
    train = stats.get("train_tokens", 0)
    if train and train < batch_tokens:
        out.append(f"warning: the training data is {train:,} tokens, less than one batch "
                   f"({batch_tokens:,} tokens = batch size x seq len x grad accum): every batch "
                   f"repeats it (padding fills the rest)")
    epochs = batch_tokens * steps / train if train else 0.0
    if epochs > MANY_EPOCHS:
        out.append(f"warning: {steps} steps of {batch_tokens:,} tokens go over the {train:,} "
                   f"training tokens {epochs:,.0f} times (epochs): expect memorization, or give "
                   f"more --data / fewer --steps")
    elif epochs > 1:
        out.append(f"note: {steps} steps cover the training data {epochs:.1f} times (epochs)")
    return out
