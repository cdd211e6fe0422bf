"""Helpers shared by the train and resume tests (imported by name: pytest puts tests/ on sys.path)."""

import json
from pathlib import Path

import numpy as np

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--intermediate-size", "128",
         "--batch-size", "4", "--seq-len", "32", "--sample-tokens", "0", "--no-progress",
         "--log-every", "1", "--eval-batches", "2"]


def error_line(stderr: str) -> str:
    """The CLI's one error line. Looked up by its prefix, not taken as the last line: Orbax's
    background tasks from other tests may print to the same captured stderr late."""
    lines = [l for l in stderr.splitlines() if l.startswith("python -m jaxmem.train: error: ")]
    assert len(lines) == 1, stderr
    return lines[0]


def losses(run):
    return [(r["step"], r["loss"], r["grad_norm"], r["loss_scale"], r["skipped"])
            for r in map(json.loads, (Path(run) / "metrics.jsonl").read_text().splitlines())]


def params_of(run):
    from jaxmem.train.rundir import load_run
    import jax
    state = load_run(Path(run)).state
    return int(state.step), [np.asarray(x) for x in jax.tree_util.tree_leaves(state.params)]
