"""Measured peak memory: real train steps of one configuration (`measure_here`), each in its
own process (`measure_in_subprocess` starts it), since a device's peak_bytes_in_use never goes
down: a second configuration in the same process would report the larger of the two.

The worker protocol is one JSON object each way: `python -m jaxmem.memory --worker
'<StepSpec.to_json()>'` prints one JSON line. The parent sends the exact StepSpec it wants
measured (the one the planner chose, say), so the child never re-parses a command line: an argv
rewritten by the parent could not know what argparse would make of an abbreviated flag (`--fi
40` is `--fit 40`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp

from jaxmem.memory.spec import StepSpec
from jaxmem.train import create_train_state, jit_train_step, objective_batch, synthetic_batch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure_available() -> str | None:
    """None if the device reports peak memory; otherwise why it cannot be measured here."""
    device = jax.devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # some runtimes raise instead of returning None
        stats = {}
    return None if "peak_bytes_in_use" in stats else (
        f"not measured: the {device.platform} backend reports no memory stats "
        f"(peak_bytes_in_use needs a GPU)")


def measure_in_subprocess(spec: StepSpec, timeout: float = 1800) -> dict:
    """Run real steps of `spec` in a fresh process and read its device peak (parent side)."""
    note = measure_available()
    if note:
        return {"peak_bytes": None, "note": note}
    # This checkout's jaxmem first, whatever the caller's working directory.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    try:
        p = subprocess.run([sys.executable, "-m", "jaxmem.memory", "--worker", spec.to_json()],
                           capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"peak_bytes": None, "note": f"measurement timed out after {timeout:.0f} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"peak_bytes": None, "note": f"measurement failed (exit {p.returncode}): {last}"}
    return json.loads(lines[-1])


def _batch(spec: StepSpec, key) -> dict:
    """A random micro-batch of the step's objective: the causal-LM batch of `spec.rows`
    sequences, plus any field the objective reads (ones) and a precomputed reference (zeros)."""
    b = synthetic_batch(key, spec.rows, spec.seq_len, spec.model.vocab_size)
    for k, v in objective_batch(spec.step, spec.batch_size, spec.seq_len).items():
        if k not in b:
            b[k] = jnp.ones(v.shape, v.dtype) if v.dtype == jnp.int32 else jnp.zeros(v.shape, v.dtype)
    return b


def measure_here(spec: StepSpec, steps: int = 3) -> dict:
    """Allocate the state, run `steps` real train steps, report peak_bytes_in_use (child side)."""
    cfg, loss_scale = spec.step_config()
    state = create_train_state(cfg, loss_scale=loss_scale)
    step = jit_train_step(cfg)
    keys = jax.random.split(jax.random.PRNGKey(1), spec.grad_accum)
    parts = [_batch(spec, k) for k in keys]
    batch = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *parts)
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    stats = jax.devices()[0].memory_stats() or {}
    return {"peak_bytes": int(stats["peak_bytes_in_use"]), "steps": steps,
            "note": f"peak_bytes_in_use after {steps} steps, own process"}
