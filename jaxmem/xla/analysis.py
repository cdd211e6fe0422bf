"""Memory analysis of any function `jax.jit` can compile: XLA's plan, and what a backward keeps.

`analyze(fn, *args)` compiles fn ahead of time (ShapeDtypeStructs: nothing is allocated) and
returns a `MemoryAnalysis`; `MemoryAnalysis.of_compiled(c)` reads an executable compiled
elsewhere (jaxmem.memory.compiled.compiled_stats). Every number is XLA's own (`memory_analysis()`,
`cost_analysis()`) or jax's own (`saved_residuals`, through jaxmem.xla.residuals); nothing is
estimated. Only jax, numpy and jaxmem.xla are imported, so a user's model code can call it
without jaxmem's trainer; matplotlib is imported by `.plot` alone.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from jaxmem.xla.residuals import Residual, group_residuals, residual_list  # noqa: F401
from jaxmem.xla.verdict import COMMON_GIB, GiB, verdict_lines

_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


@dataclass(frozen=True)
class MemoryAnalysis:
    """XLA's memory plan of one compiled function, per device, and the residuals of a backward
    (docs/api.md lists the fields).

    Figures are bytes on ONE device (under a mesh XLA plans each device alike; `devices` says
    how many run it). A CPU figure is XLA:CPU's program, not a GPU figure and no bound on one
    (16-bit math emulated in fp32, other fusions); compile inside `jaxmem.target.compiling_for`
    for a GPU's. alias_bytes: outputs written over donated inputs, counted in argument_bytes and
    output_bytes too. xla_peak_bytes: XLA's buffer-assignment peak where this jax reports it (it
    can be lower than peak_bytes: a temp may reuse a dead argument's space). host_*_bytes: the
    same figures in host memory (offloaded values). precision: the narrowest float dtype among
    the arguments. residuals: None unless analyze was asked for them.
    """

    name: str
    backend: str
    jax_version: str
    devices: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    xla_peak_bytes: int | None = None
    generated_code_bytes: int = 0
    host_argument_bytes: int = 0
    host_output_bytes: int = 0
    host_alias_bytes: int = 0
    host_temp_bytes: int = 0
    flops: float = float("nan")
    precision: str = "float32"
    residuals_of: str | None = None
    residuals: tuple[Residual, ...] | None = field(default=None, repr=False)

    @property
    def peak_bytes(self) -> int:
        """temp + argument + output - alias: what the executable needs at once on one device."""
        return self.temp_bytes + self.argument_bytes + self.output_bytes - self.alias_bytes

    @property
    def host_bytes(self) -> int:
        """Host-memory temp + argument + output - alias (0 unless something is offloaded)."""
        return (self.host_temp_bytes + self.host_argument_bytes + self.host_output_bytes
                - self.host_alias_bytes)

    @property
    def residual_bytes(self) -> int:
        """Bytes of the saved residuals that are not the function's own arguments."""
        return sum(r.bytes for r in self.residuals or () if not r.argument)

    def stats(self) -> dict[str, int]:
        """The dict `jaxmem.memory.compiled.compiled_stats` returns (host_bytes: never part of
        the device peak)."""
        return {"temp_bytes": self.temp_bytes, "argument_bytes": self.argument_bytes,
                "output_bytes": self.output_bytes, "alias_bytes": self.alias_bytes,
                "peak_bytes": self.peak_bytes, "host_bytes": self.host_bytes}

    @classmethod
    def of_compiled(cls, compiled, name: str = "", precision: str = "float32") -> "MemoryAnalysis":
        """The figures of a `jax.stages.Compiled` (`jax.jit(f).lower(...).compile()`)."""
        mem = compiled.memory_analysis()
        get = lambda k: int(getattr(mem, k, 0) or 0)  # noqa: E731 (host fields: newer jaxlibs)
        cost = compiled.cost_analysis()
        if isinstance(cost, (list, tuple)):  # older jax returns one dict per computation
            cost = cost[0] if cost else {}
        # argument_bytes = argument_size_in_bytes, ..., host_temp_bytes = host_temp_size_in_bytes
        sizes = {f"{host}{k}_bytes": get(f"{host}{k}_size_in_bytes") for host in ("", "host_")
                 for k in ("argument", "output", "alias", "temp")}
        return cls(name=name, backend=jax.default_backend(), jax_version=jax.__version__,
                   devices=_device_count(compiled), **sizes,
                   xla_peak_bytes=get("peak_memory_in_bytes") or None,
                   generated_code_bytes=get("generated_code_size_in_bytes"),
                   flops=float((cost or {}).get("flops", float("nan"))), precision=precision)

    def report(self) -> str:
        """A text table of the figures (and of the residual groups, when there are any)."""
        where = f"{self.backend}, jax {self.jax_version}, " + (
            "1 device" if self.devices == 1 else f"{self.devices} devices, bytes per device")
        lines = [f"memory of {self.name} ({where})"]
        rows = [("argument", self.argument_bytes), ("output", self.output_bytes),
                ("alias (donated, in both above)", self.alias_bytes), ("temp", self.temp_bytes),
                ("peak = temp + argument + output - alias", self.peak_bytes)]
        if self.xla_peak_bytes is not None:
            rows.append(("XLA buffer-assignment peak", self.xla_peak_bytes))
        if self.host_bytes or self.host_argument_bytes:
            rows += [("host argument", self.host_argument_bytes),
                     ("host output", self.host_output_bytes), ("host temp", self.host_temp_bytes)]
        lines += [f"  {k:<42}{_size(v):>14}" for k, v in rows]
        lines.append(f"  {'flops':<42}{self.flops:>14.4g}")
        if self.residuals is not None:
            kept = [r for r in self.residuals if not r.argument]
            args = [r for r in self.residuals if r.argument]
            lines += ["", f"saved for the backward of {self.residuals_of}: "
                      f"{_size(self.residual_bytes).strip()} in {sum(r.count for r in kept)} "
                      f"values (+ {_size(sum(r.bytes for r in args))} of its own "
                      f"arguments, counted in argument above)",
                      f"  {'name':<52}{'shape':<22}{'dtype':<10}{'count':>6}{'bytes':>14}"]
            lines += [f"  {r.name[:51]:<52}{str(list(r.shape)):<22}{r.dtype:<10}{r.count:>6}"
                      f"{_size(r.bytes):>14}" for r in kept]
        return "\n".join(lines)

    def verdict(self, device: int | str | None = None) -> str:
        """The verdict lines of `python -m jaxmem.memory` for this peak, joined by newlines.
        device: bytes (int) or a size such as "80GiB", "24 GiB", "40GB" (10^9) or "512MiB";
        None: the common sizes (verdict.COMMON_GIB)."""
        sizes = COMMON_GIB if device is None else (_gib(device),)
        return "\n".join(verdict_lines(self.peak_bytes, "compiled", self.backend, self.precision,
                                       sizes))

    def plot(self, path: str | os.PathLike) -> str:
        """Write a bar chart of the figures (and the largest residual groups) to `path` (.png,
        .svg, .pdf: by suffix). Needs matplotlib (`pip install 'jaxmem[plot]'`): ImportError
        saying so when it is missing; ValueError when path's directory does not exist."""
        try:
            from matplotlib.figure import Figure  # noqa: PLC0415 (optional `plot` extra)
        except ImportError:
            raise ImportError("MemoryAnalysis.plot needs matplotlib: "
                              "pip install 'jaxmem[plot]'") from None
        path = os.fspath(path)
        parent = os.path.dirname(path)
        if parent and not os.path.isdir(parent):
            raise ValueError(f"{path}: directory {parent} does not exist")
        kept = [r for r in self.residuals or () if not r.argument][:12]
        fig = Figure(figsize=(10 if kept else 6, 4), dpi=100, layout="constrained")
        axes = fig.subplots(1, 2 if kept else 1, squeeze=False)[0]
        names = ["argument", "output", "alias", "temp", "peak"]
        values = [self.argument_bytes, self.output_bytes, self.alias_bytes, self.temp_bytes,
                  self.peak_bytes]
        axes[0].barh(names[::-1], [v / 2**20 for v in values[::-1]], color="tab:blue")
        axes[0].set_xlabel("MiB per device")
        axes[0].set_title(f"{self.name} ({self.backend})")
        if kept:
            axes[1].barh([r.name[:40] for r in kept[::-1]],
                         [r.bytes / 2**20 for r in kept[::-1]], color="tab:orange")
            axes[1].set_xlabel("MiB")
            axes[1].set_title(f"saved for the backward ({_size(self.residual_bytes).strip()})")
        fig.savefig(path)
        return path


def analyze(fn: Callable, /, *args, jit_options: Mapping[str, Any] | None = None,
            residuals_of: Callable | None = None, residual_args: Sequence | None = None,
            name: str | None = None, **kwargs) -> MemoryAnalysis:
    """Compile `fn(*args, **kwargs)` ahead of time (nothing is run) and return XLA's memory plan.

    Args:
      fn: a plain function (compiled as `jax.jit(fn, **jit_options)`) or an already jitted one
        (its own jit options apply; jit_options must be None).
      *args, **kwargs: what `fn` is called with (arrays, or ShapeDtypeStructs: nothing allocated,
        a `sharding=` on them gives per-device figures; pytrees of them; static arguments' plain
        values). Keywords other than the four below go to fn.
      jit_options: keywords for `jax.jit` (static_argnums, donate_argnums, in_shardings, ...).
      residuals_of: the function `fn` differentiates (`loss` when fn calls
        `jax.value_and_grad(loss)`): what its VJP keeps, grouped by name, shape and dtype.
      residual_args: residuals_of's positional arguments; default `args` and `kwargs` (right
        when fn is `jax.grad(residuals_of)`), e.g. (state.params, batch) for a step(state, batch).
      name: the label in the report (default fn's __name__).
    Raises RuntimeError when residuals_of is given and this jax has no saved_residuals.

    Example (backend-independent figures):
    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.memory import analyze
    >>> w = jax.ShapeDtypeStruct((256, 256), jnp.float32)   # 256 KiB
    >>> x = jax.ShapeDtypeStruct((8, 256), jnp.float32)     # 8 KiB
    >>> loss = lambda w, x: jnp.sum(jnp.tanh(x @ w))
    >>> a = analyze(jax.grad(loss), w, x, residuals_of=loss)
    >>> a.argument_bytes, a.output_bytes                    # (w, x) in, dL/dw out
    (270336, 262144)
    >>> [(r.shape, r.bytes) for r in a.residuals if not r.argument]  # tanh(xw) and 1 - tanh^2
    [((8, 256), 8192), ((8, 256), 8192)]
    >>> a.residual_bytes
    16384
    >>> print(a.verdict("80GiB").splitlines()[0])
    verdict: compiled peak 0.00 GiB fits on every common GPU size (80 GiB)
    """
    label = name or getattr(fn, "__name__", None) or type(fn).__name__
    if hasattr(fn, "lower") and jit_options:  # already jitted
        raise TypeError("analyze: jit_options is for a plain function; fn is already "
                        "jitted, so its own jit options apply")
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn, **dict(jit_options or {}))
    compiled = jitted.lower(*args, **kwargs).compile()
    result = MemoryAnalysis.of_compiled(compiled, label, _narrowest_float((args, kwargs)))
    if residuals_of is None:
        return result
    of = residuals_of
    if residual_args is None:
        of, residual_args = functools.partial(residuals_of, **kwargs), args
    listed = residual_list(of, *residual_args)
    if listed is None:  # pragma: no cover - a future jax that moved saved_residuals
        raise RuntimeError("analyze: this jax has no saved_residuals (jax.ad_checkpoint)")
    of_name = getattr(residuals_of, "__name__", None) or type(residuals_of).__name__
    return dataclasses.replace(result, residuals_of=of_name, residuals=group_residuals(listed))


def _narrowest_float(tree) -> str:
    """The float dtype with the fewest bits among the leaves of `tree` ("float32" if none)."""
    best = np.dtype("float32")
    for leaf in jax.tree_util.tree_leaves(tree):
        dt = getattr(leaf, "dtype", None)
        if dt is not None and jax.numpy.issubdtype(dt, jax.numpy.floating) \
                and np.dtype(dt).itemsize < best.itemsize:
            best = np.dtype(dt)
    return best.name


def _device_count(compiled) -> int:
    """How many devices run the executable (1 without a mesh)."""
    shardings = []
    for attr in ("input_shardings", "output_shardings"):
        try:
            shardings += jax.tree_util.tree_leaves(getattr(compiled, attr))
        except Exception:  # noqa: BLE001 - a jax without the attribute: one device assumed
            continue
    return max([len(s.device_set) for s in shardings if hasattr(s, "device_set")] or [1])


def _gib(device: int | str) -> float:
    """A device size in GiB, as verdict_lines takes it (whole numbers stay ints)."""
    if isinstance(device, bool) or not isinstance(device, (int, str)):
        raise ValueError(f"device {device!r}: give bytes (int) or a size such as '80GiB'")
    if isinstance(device, int):
        nbytes = device
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", device)
        unit = (m[2] or "b").lower() if m else None
        if unit not in _UNITS:
            raise ValueError(f"device {device!r}: expected a size such as '80GiB', '40GB' "
                             f"or '512MiB'")
        nbytes = float(m[1]) * _UNITS[unit]
    if nbytes <= 0:
        raise ValueError(f"device {device!r}: the size must be positive")
    g = nbytes / GiB
    return int(g) if float(g).is_integer() else round(g, 2)


def _size(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1, one decimal."""
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:,.1f} {unit}"
    return f"{n} B"
