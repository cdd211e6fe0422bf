"""Failures of a training run that should read like help: out of device memory.

XLA reports an allocation it cannot make as an `XlaRuntimeError` (a `RuntimeError`) whose message
starts with `RESOURCE_EXHAUSTED`, followed by pages of allocator state. The user needs instead:
how much the step was compiled to need, how much the device has, and the command that finds a
configuration that fits (`python -m jaxmem.memory --fit`).
"""

from __future__ import annotations

import shlex

GiB = 2**30


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.1f} MiB"


def is_oom(e: BaseException) -> bool:
    """Is this XLA's out-of-memory error (RESOURCE_EXHAUSTED)?"""
    return "RESOURCE_EXHAUSTED" in str(e)[:2000] or "Out of memory" in str(e)[:2000]


def _device_bytes() -> int | None:
    import jax  # noqa: PLC0415

    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:
        return None
    return stats.get("bytes_limit")


def _compiled_peak(cfg) -> int | None:
    """XLA's compiled peak of the run's train step (abstract shapes, nothing allocated): the
    compile the planner reports too (jaxmem.train.run.compile_run_step)."""
    try:
        from jaxmem.train.run import build_step_config, compile_run_step  # noqa: PLC0415

        _, step_cfg, loss_scale = build_step_config(cfg)
        d = cfg.data
        mem = compile_run_step(step_cfg, loss_scale, d.batch_size, d.seq_len, d.grad_accum,
                               d.seed).memory_analysis()
        return int(mem.temp_size_in_bytes + mem.argument_size_in_bytes
                   + mem.output_size_in_bytes - mem.alias_size_in_bytes)
    except Exception:  # the estimate is a courtesy: never hide the real error behind another
        return None


def fit_command(cfg, budget_gib: float | None) -> str:
    """The `jaxmem.memory --fit` command for this run's model, precision and global batch."""
    m, d = cfg.model, cfg.data
    args = ["python", "-m", "jaxmem.memory", "--preset", m.preset]
    for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                 "head_dim", "vocab_size", "max_position_embeddings"):
        if getattr(m, name) is not None:
            args += [f"--{name.replace('_', '-')}", str(getattr(m, name))]
    args += ["--precision", cfg.precision.mode, "--seq-len", str(d.seq_len),
             "--global-batch", str(d.batch_size * d.grad_accum),
             "--fit", f"{budget_gib:.0f}" if budget_gib else "GIB"]
    return shlex.join(args).replace("'GIB'", "GIB")


def oom_message(cfg, out, error: BaseException, peak: int | None = None,
                device_bytes: int | None = None) -> str:
    """One paragraph: estimate, device size, what to run; the run directory stays usable."""
    peak = _compiled_peak(cfg) if peak is None else peak
    device_bytes = _device_bytes() if device_bytes is None else device_bytes
    first = str(error).strip().splitlines()[0][:200].rstrip(".") if str(error).strip() else \
        type(error).__name__
    d = cfg.data
    est = _size(peak) if peak else "an unknown amount"
    have = (f"the device has {_size(device_bytes)} for XLA" if device_bytes else
            "the backend does not report the device's size")
    budget = device_bytes / GiB if device_bytes else None
    return (f"error: out of device memory ({first}). The train step ({cfg.model.preset}, "
            f"{cfg.precision.mode}, remat {cfg.remat.policy}, micro-batch {d.batch_size} x "
            f"{d.seq_len} tokens, grad accum {d.grad_accum}) was compiled to need {est}; {have}. "
            f"Find a configuration that fits with:\n"
            f"  {fit_command(cfg, budget)}\n"
            f"then rerun with its flags (e.g. a smaller --batch-size with --grad-accum, --remat "
            f"full, --mu-dtype bf16) and a new --out (a run's batch and remat cannot change). "
            f"Nothing was saved for the failed step; config.json and the checkpoints in {out} are "
            f"untouched, and the same command continues that run.")
