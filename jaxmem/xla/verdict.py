"""The planner's verdict in words: does a peak fit the common GPU sizes (COMMON_GIB), with the
headroom assumed (`MemoryAnalysis.verdict()`, `python -m jaxmem.memory`, jaxmem.memory.report).

The budget rule, `usable_bytes` (XLA's preallocated share of the GPU, the CUDA context outside
it), lives in jaxmem.perf beside the device counters, so the trainer applies it too; `fits` and
`device_gib_for` are its test and its inverse.
"""

from __future__ import annotations

from jaxmem.perf import (CUDA_CONTEXT_GIB, GiB, device_gib_for, usable_bytes,  # noqa: F401
                         xla_fraction)

# RTX 3060 / 4070 12, RTX 4060 Ti / 4080 16, RTX 4090 / L4 24, A100 40, A100 / H100 80, H200 141
COMMON_GIB = (12, 16, 24, 40, 80, 141)


def usable_gib(device_gib: float, fraction: float | None = None) -> float:
    """GiB XLA can give a program on a `device_gib` GPU: `usable_bytes` in GiB."""
    return usable_bytes(device_gib, fraction) / GiB


def fits(peak_bytes: int, device_gib: float, fraction: float | None = None) -> bool:
    """Whether a peak of `peak_bytes` fits a GPU of `device_gib` GiB (`usable_bytes`' rule)."""
    return peak_bytes <= usable_bytes(device_gib, fraction)


def verdict_lines(peak_bytes: int, source: str, backend: str, precision: str,
                  sizes=COMMON_GIB) -> list[str]:
    """'verdict: ...' and the assumptions behind it."""
    frac = xla_fraction()
    peak = peak_bytes / GiB
    ok = [g for g in sizes if fits(peak_bytes, g, frac)]
    no = [g for g in sizes if g not in ok]
    say = lambda gs: ", ".join(f"{g:g} GiB" for g in gs)  # noqa: E731
    if not no:
        verdict = f"fits on every common GPU size ({say(sizes)})"
    elif not ok:
        verdict = f"does not fit on any common GPU size ({say(sizes)})"
    else:
        verdict = f"fits on {say(ok)}; does not fit on {say(no)}"
    lines = [f"verdict: {source} peak {peak:.2f} GiB {verdict}",
             f"  assumed: XLA may use {frac:.0%} of the device (JAX preallocates "
             f"XLA_PYTHON_CLIENT_MEM_FRACTION, default .75),",
             f"  plus ~{CUDA_CONTEXT_GIB} GiB of CUDA context outside it; to use nearly all of a "
             f"GPU, set XLA_PYTHON_CLIENT_MEM_FRACTION=.95"]
    card = _target_card()
    if card is not None:  # deviceless --target: the card's facts the figures assumed
        lines.append(f"  card: {card.describe()}")
    if backend == "cpu":
        lines.append("  compiled by XLA:CPU: not a GPU's program (8B bf16-sr + adamw8bit step: "
                     "83.95 GiB on")
        lines.append("  the CPU, 49.03 on the H100's compiler); plan a GPU with --target h100 "
                     "(docs/memory.md)")
    return lines


def _target_card():
    """The --target card being compiled for, or None (a real device, or XLA:CPU)."""
    from jaxmem import target  # noqa: PLC0415
    t = target.active()
    return None if t is None else t.card
