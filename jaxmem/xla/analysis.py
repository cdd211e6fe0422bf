"""Memory analysis of any function `jax.jit` can compile: XLA's plan, and what a backward keeps.

    analyze(fn, *args, **kwargs)       compile fn ahead of time for args (arrays or
                                       ShapeDtypeStructs: nothing is allocated) -> MemoryAnalysis
    MemoryAnalysis                     the figures in bytes per device, .report(), .verdict(), .plot()
    MemoryAnalysis.of_compiled(c)      the same figures of an executable compiled elsewhere
                                       (jaxmem.memory.compiled.compiled_stats reads them here)
    Residual                           one group of the residuals a backward saves

Every number is XLA's own (`compiled.memory_analysis()`, `cost_analysis()`) or jax's own
(`saved_residuals`, through jaxmem.xla.residuals); nothing is estimated. This module imports
only jax, numpy and jaxmem.xla.residuals / .verdict, so a user's model code can call it without
jaxmem's trainer; matplotlib is imported by `.plot` alone.
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
    """XLA's memory plan of one compiled function, per device, and the residuals of a backward.

    Figures are bytes on ONE device (under a mesh XLA plans each device alike; `devices` says
    how many run it). A CPU figure is XLA:CPU's program, not a GPU figure and no bound on one
    (16-bit math emulated in fp32, other fusions); compile inside `jaxmem.target.compiling_for`
    for a GPU's.

    argument_bytes, output_bytes: the inputs and results of the call (device memory space).
    alias_bytes: outputs written over donated inputs (`donate_argnums`), counted in both above.
    temp_bytes: XLA's scratch buffers (activations, gradients in flight, workspaces).
    peak_bytes (property): temp + argument + output - alias, the figure `python -m jaxmem.memory`
        uses; xla_peak_bytes: XLA's own buffer-assignment peak where this jax reports it (it can
        be lower: a temp may reuse a dead argument's space), else None.
    host_*_bytes: the same figures in host memory (offloaded values), 0 when nothing is there.
    generated_code_bytes: the executable itself. flops: XLA's cost analysis (nan if none).
    precision: the narrowest float dtype among the arguments (e.g. "bfloat16"): the verdict adds
        the CPU caveat for anything below fp32.
    residuals: the groups of values saved for the backward of `residuals_of`, largest first;
        None when analyze was not asked for them.
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
        """The dict `jaxmem.memory.compiled.compiled_stats` returns: temp, argument, output,
        alias and peak bytes (the device's), and host_bytes (host memory: offloaded values,
        never part of the device peak)."""
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
        return cls(name=name, backend=jax.default_backend(), jax_version=jax.__version__,
                   devices=_device_count(compiled),
                   argument_bytes=get("argument_size_in_bytes"),
                   output_bytes=get("output_size_in_bytes"),
                   alias_bytes=get("alias_size_in_bytes"), temp_bytes=get("temp_size_in_bytes"),
                   xla_peak_bytes=get("peak_memory_in_bytes") or None,
                   generated_code_bytes=get("generated_code_size_in_bytes"),
                   host_argument_bytes=get("host_argument_size_in_bytes"),
                   host_output_bytes=get("host_output_size_in_bytes"),
                   host_alias_bytes=get("host_alias_size_in_bytes"),
                   host_temp_bytes=get("host_temp_size_in_bytes"),
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
        """The verdict lines of `python -m jaxmem.memory` for this peak: does it fit?

        Args:
          device: the device size, as bytes (int) or a string such as "80GiB", "24 GiB",
            "40GB" (10^9) or "512MiB"; None: the common sizes 24, 40, 80 and 141 GiB.
        Returns:
          the lines, joined by newlines (the XLA preallocation assumption included).
        """
        sizes = COMMON_GIB if device is None else (_gib(device),)
        return "\n".join(verdict_lines(self.peak_bytes, "compiled", self.backend,
                                       _precision_label(self.precision), sizes))

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
    """Compile `fn(*args, **kwargs)` ahead of time and return XLA's memory plan of it.

    Nothing is run and nothing the size of the arguments is allocated when they are
    `jax.ShapeDtypeStruct`s (a `sharding=` on them places the call on a mesh: the figures are
    then per device).

    Args:
      fn: a plain function (compiled as `jax.jit(fn, **jit_options)`) or an already jitted one
        (its own static_argnums, donate_argnums and shardings apply; jit_options must be None).
      *args, **kwargs: what `fn` is called with: arrays, ShapeDtypeStructs, pytrees of them,
        and the plain values of static arguments. Keywords other than the four below go to fn.
      jit_options: keywords for `jax.jit` (static_argnums, donate_argnums, in_shardings, ...).
      residuals_of: the function whose backward to inspect, i.e. the one `fn` differentiates
        (`loss` when fn calls `jax.value_and_grad(loss)`); jax's `saved_residuals` lists what
        its VJP keeps, grouped here by name, shape and dtype.
      residual_args: residuals_of's positional arguments (arrays or ShapeDtypeStructs); default
        `args` and `kwargs` (right when fn is `jax.grad(residuals_of)`). Pass them when fn
        takes other arguments, e.g. (state.params, batch) for a train step fn(state, batch).
      name: the label in the report (default fn's __name__).
    Returns:
      a MemoryAnalysis (bytes per device; residuals None unless residuals_of was given).
    Raises:
      RuntimeError when residuals_of is given and this jax has no saved_residuals.

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
    compiled = _jitted(fn, jit_options).lower(*args, **kwargs).compile()
    result = MemoryAnalysis.of_compiled(compiled, label, _narrowest_float((args, kwargs)))
    if residuals_of is None:
        return result
    return _with_residuals(result, residuals_of, residual_args, args, kwargs)


def _jitted(fn: Callable, jit_options: Mapping[str, Any] | None):
    """`fn` if it is already jitted (then jit_options must be None), else jax.jit(fn, ...)."""
    if hasattr(fn, "lower"):
        if jit_options:
            raise TypeError("analyze: jit_options is for a plain function; fn is already "
                            "jitted, so its own jit options apply")
        return fn
    return jax.jit(fn, **dict(jit_options or {}))


def _with_residuals(result: MemoryAnalysis, residuals_of: Callable, residual_args, args,
                    kwargs) -> MemoryAnalysis:
    """`result` with what the VJP of `residuals_of` keeps (on residual_args, default fn's own
    arguments), grouped by name, shape and dtype."""
    if residual_args is None:
        of, residual_args = functools.partial(residuals_of, **kwargs), args
    else:
        of = residuals_of
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


def _precision_label(dtype_name: str) -> str:
    """verdict_lines' precision: "fp32" (no CPU caveat) or the 16/8-bit dtype's name."""
    return "fp32" if np.dtype(dtype_name).itemsize >= 4 else dtype_name


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
