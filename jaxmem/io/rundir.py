"""The run directory: `config.json`, `metrics.jsonl`, `checkpoints/`; clear errors about it."""

from __future__ import annotations

import json
from pathlib import Path


class RunError(ValueError):
    """Bad input to a run (flag, file or run directory); the message names it."""


def exit_after_failed_restore(parser, message: str) -> None:
    """argparse's error exit (usage, one line, status 2), and nothing printed after it.

    After a failed Orbax restore, TensorStore reads still in flight fail again on their own
    threads and print tracebacks into stderr, before, between and after the lines of the error
    (PyErr_Print from native threads: no Python hook reliably catches them). So stderr is
    pointed at /dev/null first, the message goes to the real stderr, and the process exits at
    once. Nothing is left to save at that point: no training has run.
    """
    import os
    import sys

    text = f"{parser.format_usage()}{parser.prog}: error: {message}\n"
    sys.stdout.flush()
    sys.stderr.flush()
    real_stderr = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.write(real_stderr, text.encode())
    os._exit(2)


def read_config(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise RunError(f"{path}: no run config here (was this directory made by jaxmem.train?)")
    except (OSError, json.JSONDecodeError) as e:
        raise RunError(f"{path}: unreadable run config ({e})")


def config_mismatch(saved: dict, new: dict) -> str:
    """'field: saved -> new, ...' for the fields that differ, or ''."""
    diffs = [f"{f}: {saved.get(f)!r} -> {new.get(f)!r}" for f in sorted(set(saved) | set(new))
             if saved.get(f) != new.get(f)]
    return ", ".join(diffs)


def load_run(run_dir: Path):
    """(ModelConfig, StepConfig, TrainState, tokenizer, run config) of the newest committed step."""
    from jaxmem.io.checkpoint import Checkpointer
    from jaxmem.data import load_tokenizer
    from jaxmem.train.run import abstract_train_state, build_step_config

    config = read_config(Path(run_dir) / "config.json")
    model_cfg, step_cfg, loss_scale = build_step_config(config)
    ckpt = Checkpointer(Path(run_dir) / "checkpoints", keep=config.get("keep", 3))
    step = ckpt.latest_step()
    if step is None:
        raise RunError(f"--run {run_dir}: no committed checkpoint in {Path(run_dir) / 'checkpoints'}")
    state, _ = ckpt.restore(step, abstract_train_state(step_cfg, loss_scale, config["seed"]))
    ckpt.close()
    return model_cfg, step_cfg, state, load_tokenizer(config.get("tokenizer")), config
