"""Device facts and throughput arithmetic shared by training, the planner and the experiments:
training FLOPs per token, dense peak FLOP/s per device kind, device memory counters, and the
budget rule: what XLA may use of a GPU of a given size (`usable_bytes`) and its inverse
(`device_gib_for`), applied by the planner's verdicts and by the trainer's check before its first
step (re-exported by jaxmem.xla.verdict)."""

from __future__ import annotations

import math
import os

import jax.numpy as jnp


def flops_per_token(config, seq_len: int, num_params: int) -> float:
    """Training FLOPs per token of `config` (a jaxmem.families.config.ModelConfig, of
    `num_params` parameters: jaxmem.families.params.num_params): 6 x non-embedding params +
    attention (PaLM appendix B).

    The attention term is 12 L N H T (N query heads of width H), PaLM's 12 L H Q T, rather than
    the common shorthand 12 L D T: the two agree only where N H = D, and head_dim may be set
    apart from the width. The LM head counts once (tied or not); the embedding lookup does not.
    A sliding-window layer (the config's `local_layers`: Gemma 3's local ones, Mistral's with a
    window) attends to min(T, W) keys, so its term has min(T, W) for T.
    """
    n = num_params - config.vocab_size * config.hidden_size * (1 if config.tie_embeddings else 2)
    head = 6 * config.vocab_size * config.hidden_size  # the LM head matmul is real work
    window = getattr(config, "sliding_window", None)
    keys = sum(min(seq_len, window) if local else seq_len
               for local in getattr(config, "local_layers", (False,) * config.num_layers))
    attn = 12 * config.num_heads * config.resolved_head_dim * keys
    return 6 * n + head + attn


# Dense peak FLOP/s by device kind substring and compute dtype (vendor datasheets, no sparsity;
# float32 is the non-tensor-core rate). The longest matching name wins, so "A10" never takes an
# "A100", whatever the order here.
_PEAKS = {
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
    "A10": {"bfloat16": 125e12, "float16": 125e12, "float32": 31.2e12},
    "L4": {"bfloat16": 121e12, "float16": 121e12, "float32": 30.3e12},
}


def peak_flops(device, compute_dtype) -> float | None:
    """The device's dense peak FLOP/s for the compute dtype, where known (None on CPU).

    device: a jax Device, or its kind as a string (e.g. "cuda:NVIDIA H100 80GB HBM3" as recorded
    in a results file), so numbers can be computed after the run, away from the device.
    """
    kind = device if isinstance(device, str) else getattr(device, "device_kind", "")
    names = sorted((n for n in _PEAKS if n in kind), key=len, reverse=True)
    return _PEAKS[names[0]].get(jnp.dtype(compute_dtype).name) if names else None


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


GiB = 2**30
CUDA_CONTEXT_GIB = 0.5
DEFAULT_FRACTION = 0.75


def xla_fraction() -> float:
    """The share of a GPU XLA may use: XLA_PYTHON_CLIENT_MEM_FRACTION, else 0.75 (or ~all when
    preallocation is off)."""
    if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() in ("false", "0"):
        return 1.0
    try:
        return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_FRACTION))
    except ValueError:
        return DEFAULT_FRACTION


def usable_bytes(device_gib: float, fraction: float | None = None) -> int:
    """Bytes a compiled program (or a phase of a run) may need on a GPU of `device_gib` GiB.

    The rule: min(fraction x device, device - CUDA_CONTEXT_GIB), rounded down to a byte.
    fraction is the share XLA's client takes at start-up (`xla_fraction`:
    XLA_PYTHON_CLIENT_MEM_FRACTION, default .75; 1.0 with XLA_PYTHON_CLIENT_PREALLOCATE=false);
    CUDA_CONTEXT_GIB (0.5, assumed) is the margin for the CUDA context, which lives outside
    XLA's share: with the fraction near 1 it is what is left. No other margin is taken for what
    a compile cannot see (autotuning, cuDNN / cuBLAS workspaces, fragmentation): none has been
    measured yet. Every "fits" of jaxmem.memory is `peak_bytes <= usable_bytes(size)`: the
    verdict on each size, `--fit GIB` (GIB is the device's size), and the mesh planners.
    """
    fraction = xla_fraction() if fraction is None else fraction
    return int(min(fraction * device_gib, device_gib - CUDA_CONTEXT_GIB) * GiB)


def device_gib_for(peak_bytes: int, fraction: float | None = None) -> float:
    """The smallest device size in GiB (to 1e-9 GiB) whose `usable_bytes` holds `peak_bytes`:
    the inverse of the rule, e.g. the `--fit` that just admits a given peak."""
    fraction = xla_fraction() if fraction is None else fraction
    gib = max(peak_bytes / GiB / fraction, peak_bytes / GiB + CUDA_CONTEXT_GIB)
    gib = math.ceil(gib * 1e9) / 1e9
    while usable_bytes(gib, fraction) < peak_bytes:  # float rounding: a nano-GiB more
        gib += 1e-9
    return gib
