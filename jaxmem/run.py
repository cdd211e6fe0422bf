"""Helpers the train and generate programs share: run config, abstract state, eval, device facts."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxmem.config import ModelConfig
from jaxmem.loss import cross_entropy
from jaxmem.precision import cast_params
from jaxmem.step import StepConfig, create_train_state


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


def abstract_train_state(cfg: StepConfig, loss_scale, seed: int = 0):
    """The train state's shapes and dtypes (for Orbax restore), allocating nothing."""
    return jax.eval_shape(lambda: create_train_state(cfg, loss_scale, seed))


def make_eval_fn(cfg: StepConfig):
    """jit(params, batch) -> (sum of token losses, tokens), in the mode's compute dtype."""
    model = cfg.build_model()

    @jax.jit
    def eval_fn(params, batch):
        p = cast_params(params, cfg.precision.compute_dtype)
        logits = model.apply({"params": p}, batch["inputs"])
        return cross_entropy(logits, batch["targets"], batch["mask"])

    return eval_fn


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x non-embedding params + attention (PaLM appendix B)."""
    n = config.num_params() - config.vocab_size * config.hidden_size * (1 if config.tie_embeddings else 2)
    head = 6 * config.vocab_size * config.hidden_size  # the LM head matmul is real work
    attn = 12 * config.num_layers * config.num_heads * config.resolved_head_dim * seq_len
    return 6 * n + head + attn


# Dense peak FLOP/s by device kind substring and compute dtype (vendor datasheets, no sparsity).
_PEAKS = {
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
}


def peak_flops(device, compute_dtype) -> float | None:
    """The device's dense peak FLOP/s for the compute dtype, where known (None on CPU)."""
    kind = getattr(device, "device_kind", "")
    for name, table in _PEAKS.items():
        if name in kind:
            return table.get(jnp.dtype(compute_dtype).name)
    return None


def device_memory(device) -> dict | None:
    """bytes_in_use and peak_bytes_in_use where the backend reports them (GPU), else None."""
    try:
        stats = device.memory_stats()
    except Exception:
        return None
    if not stats or "bytes_in_use" not in stats:
        return None
    return {"bytes_in_use": stats["bytes_in_use"],
            "peak_bytes_in_use": stats.get("peak_bytes_in_use")}


def build_step_config(flags: dict):
    """(ModelConfig, StepConfig, loss scale) from a dict of train flags (argparse vars or config.json).

    One place that turns flags into the objects that fix the state's shapes, so a resumed run and
    `jaxmem.generate` rebuild exactly the state the run saved.
    """
    from jaxmem.config import model_config_from_args
    from jaxmem.loss_scale import parse_loss_scale
    from jaxmem.optim import OptimConfig
    from jaxmem.precision import get_precision
    from jaxmem.remat import RematPolicy

    model_cfg = model_config_from_args(flags)
    precision = get_precision(flags["precision"])
    optim = OptimConfig(lr=flags["lr"], min_lr=flags["min_lr"], warmup_steps=flags["warmup_steps"],
                        total_steps=flags["steps"], weight_decay=flags["weight_decay"],
                        clip=flags["clip"], mu_dtype=flags["mu_dtype"])
    loss_scale = parse_loss_scale(flags["loss_scale"] or precision.loss_scale,
                                  init_scale=flags["loss_scale_init"],
                                  growth_interval=flags["loss_scale_growth_interval"])
    step_cfg = StepConfig(model_cfg, precision, RematPolicy.parse(flags["remat"]), optim,
                          grad_accum=flags["grad_accum"])
    return model_cfg, step_cfg, loss_scale
