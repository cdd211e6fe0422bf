"""`jaxmem.train.host_state.create_on_host` with each of its programs printed as it ran: its
compiled memory (XLA's memory_analysis: temporaries, device output, host output) and the
device's peak and bytes in use after it (`python -m experiments.offload_peak --programs`)."""

from __future__ import annotations

import jax

from jaxmem.train.host_state import create_on_host


def _gib(n) -> str:
    return f"{(n or 0) / 2**30:6.2f}"


def device_line() -> str:
    """The device's peak so far and the bytes it holds now ("n/a" where it reports none)."""
    st = jax.devices()[0].memory_stats() or {}
    gib = lambda k: f"{st[k] / 2**30:6.2f} GiB" if k in st else "   n/a"  # noqa: E731
    return f"peak {gib('peak_bytes_in_use')}  in use {gib('bytes_in_use')}"


def _compiled(c) -> str:
    m = c.memory_analysis()
    get = lambda k: _gib(getattr(m, k, 0))  # noqa: E731
    return (f"temp {get('temp_size_in_bytes')}  out {get('output_size_in_bytes')}  "
            f"host out {get('host_output_size_in_bytes')}")


def _print(p, compiled, seconds):
    where = "rest" if p.kind == "device" else str(p.index)
    shape = "" if p.leaf is None else str(tuple(p.leaf.shape))
    print(f"{p.kind:<8} {where:>5} {shape:<24} {_compiled(compiled)}  {device_line()}"
          f"  {seconds:5.1f} s", flush=True)


def create_printing(fn, shardings, args=(), progress=False, pieces=True):
    """create_on_host, printing each program after it ran."""
    print(f"{'program':<8} {'leaf':>5} {'shape':<24} {'compiled (GiB)':<39}device after it",
          flush=True)
    return create_on_host(fn, shardings, args, progress, pieces, report=_print)
