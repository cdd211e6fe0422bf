"""Failures of a training run that should read like help: a step too big for the device.

Before the first step (jaxmem.train.loop), where the backend reports the device's size (GPUs:
`memory_stats()["bytes_limit"]`; the CPU does not, so no check there), the train step's own
compile is compared with it: a step compiled to need more exits 2 with `too_big_message`, before
any step runs or anything is written. After the fact, XLA reports an allocation it cannot make as an `XlaRuntimeError` (a `RuntimeError`) whose message
starts with `RESOURCE_EXHAUSTED`, followed by pages of allocator state. The user needs instead:
how much the step was compiled to need, how much the device has, and the command that finds a
configuration that fits (`python -m jaxmem.memory --fit`).
"""

from __future__ import annotations

import math
import shlex

from jaxmem.perf import device_gib_for

GiB = 2**30


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.1f} MiB"


def is_oom(e: BaseException) -> bool:
    """Is this XLA's out-of-memory error (RESOURCE_EXHAUSTED)?"""
    return "RESOURCE_EXHAUSTED" in str(e)[:2000] or "Out of memory" in str(e)[:2000]


def device_bytes() -> int | None:
    """What XLA may allocate on this process's first device (`memory_stats()["bytes_limit"]`),
    or None where the backend does not say (the CPU)."""
    import jax  # noqa: PLC0415

    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:
        return None
    return stats.get("bytes_limit")


def compiled_peak(compiled) -> int:
    """A compiled program's peak per device: temp + arguments + outputs - donated aliases."""
    mem = compiled.memory_analysis()
    return int(mem.temp_size_in_bytes + mem.argument_size_in_bytes
               + mem.output_size_in_bytes - mem.alias_size_in_bytes)


def _compiled_peak(cfg) -> int | None:
    """XLA's compiled peak of the run's train step (abstract shapes, nothing allocated): the
    compile the planner reports too (jaxmem.train.run.compile_run_step)."""
    try:
        from jaxmem.train.run import build_step_config, compile_run_step  # noqa: PLC0415

        _, step_cfg, loss_scale = build_step_config(cfg)
        d = cfg.data
        return compiled_peak(compile_run_step(step_cfg, loss_scale, d.batch_size, d.seq_len,
                                              d.grad_accum, d.seed))
    except Exception:  # the estimate is a courtesy: never hide the real error behind another
        return None


def budget_gib(limit_bytes: int) -> float:
    """The GPU size to give the planner for a device whose XLA limit is `limit_bytes`: the
    planner's GIB is the card's size, of which it allows `usable_bytes(GIB)` (XLA's share), so
    this inverts that rule (`jaxmem.perf.device_gib_for`), rounded down to 0.1 GiB."""
    return max(math.floor(device_gib_for(limit_bytes) * 10) / 10, 0.1)


def shortens_sequence(cfg) -> bool:
    """Is the sequence the thing to shorten (micro-batch 1, or the layer-by-layer optimizer,
    which the batch planner does not search), rather than the batch?"""
    return cfg.data.batch_size == 1 or cfg.optim.in_backward


def fit_command(cfg, budget_gib: float | None, devices: int = 1) -> str:
    """The `python -m jaxmem.memory` command that finds what fits for this run: `--fit-seq GIB`
    (the longest sequence, everything else as the run has it) when `shortens_sequence(cfg)`,
    else `--fit GIB` over the run's global batch (the planner then picks the micro-batch, remat
    and the fused loss's chunk, and with `devices` > 1 the mesh). Every flag is one the memory
    CLI takes (jaxmem.config.flags.PLANNER_SECTIONS / PLANNER_ONLY): the run's fields that
    differ from the defaults, with --preset always (and --batch-size with --fit-seq)."""
    from jaxmem.config.flags import PLANNER_ONLY, PLANNER_SECTIONS  # noqa: PLC0415
    from jaxmem.config.run import RunConfig, all_paths, field_metadata, flag_names  # noqa: PLC0415

    seq = shortens_sequence(cfg)
    d = cfg.data
    # --fit searches the micro-batch (--global-batch), the remat policy and --mu-dtype itself
    searched = () if seq else ("data.batch_size", "data.grad_accum", "remat.policy",
                               "optim.mu_dtype", "parallel.mesh")
    # always written: --fit-seq without --batch-size searches at micro-batch 1, not the run's
    always = ("precision.mode", "data.seq_len") + (("data.batch_size",) if seq else ())
    base = RunConfig()
    args = ["python", "-m", "jaxmem.memory", "--preset", cfg.model.preset]
    for path in all_paths():
        section, name = path.split(".")
        md, value = field_metadata(path), cfg.get(path)
        if (section not in PLANNER_SECTIONS or name not in PLANNER_ONLY.get(section, (name,))
                or not md["cli"] or path in searched or path == "model.preset"
                or (value == base.get(path) and path not in always)):
            continue
        args += [flag_names(path)[0]] if md["store_true"] else [flag_names(path)[0], str(value)]
    if devices > 1:
        args += ["--devices", str(devices)]
    if not seq:
        args += ["--global-batch", str(d.batch_size * d.grad_accum)]
    gib = f"{budget_gib:g}" if budget_gib else "GIB"
    args += ["--fit-seq" if seq else "--fit", gib]
    return shlex.join(args).replace("'GIB'", "GIB")


def too_big_message(cfg, peak: int, limit: int, devices: int = 1) -> str | None:
    """The paragraph `jaxmem.train` exits 2 with before its first step when the train step was
    compiled to need more than the device has (`peak` > `limit`, bytes per device), else None."""
    if peak <= limit:
        return None
    d = cfg.data
    what = ("the sequence (--seq-len)" if shortens_sequence(cfg) else
            "the micro-batch, remat or mesh")
    return (f"error: the train step does not fit this device: {cfg.model.preset}, "
            f"{cfg.precision.mode}, remat {cfg.remat.policy}, micro-batch {d.batch_size} x "
            f"{d.seq_len} tokens was compiled to need {_size(peak)} per device; the device has "
            f"{_size(limit)} for XLA. Nothing ran and nothing was saved. Find {what} that "
            f"fits with:\n"
            f"  {fit_command(cfg, budget_gib(limit), devices)}\n"
            f"then rerun with its flags (a new --out for a new batch, remat or length: they "
            f"cannot change on resume), or pass --no-memory-check to try anyway.")


def oom_message(cfg, out, error: BaseException, peak: int | None = None,
                limit: int | None = None, devices: int = 1) -> str:
    """One paragraph: estimate, device size, what to run; the run directory stays usable."""
    peak = _compiled_peak(cfg) if peak is None else peak
    limit = device_bytes() if limit is None else limit
    first = str(error).strip().splitlines()[0][:200].rstrip(".") if str(error).strip() else \
        type(error).__name__
    d = cfg.data
    est = _size(peak) if peak else "an unknown amount"
    have = (f"the device has {_size(limit)} for XLA" if limit else
            "the backend does not report the device's size")
    budget = budget_gib(limit) if limit else None
    return (f"error: out of device memory ({first}). The train step ({cfg.model.preset}, "
            f"{cfg.precision.mode}, remat {cfg.remat.policy}, micro-batch {d.batch_size} x "
            f"{d.seq_len} tokens, grad accum {d.grad_accum}) was compiled to need {est}; {have}. "
            f"Find a configuration that fits with:\n"
            f"  {fit_command(cfg, budget, devices)}\n"
            f"then rerun with its flags (e.g. a smaller --batch-size with --grad-accum, --remat "
            f"full, --mu-dtype bf16) and a new --out (a run's batch and remat cannot change). "
            f"Nothing was saved for the failed step; config.json and the checkpoints in {out} are "
            f"untouched, and the same command continues that run.")
