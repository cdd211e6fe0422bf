"""Bytes of the residuals jax keeps for a backward pass, counted from jax's own list.

jax's `saved_residuals(f, *args)` traces `vjp(f, *args)` and names every value the backward will
read, with where it came from: "from the argument params['lm_head']...", "named 'query' from ...",
"output of dot_general from ...". The planner's formulas and the PyTorch comparison are checked
against that list, so it is counted once, here (arguments left out: the parameters are in memory
anyway, they are not activation memory).

jax 0.10 keeps the function private (`jax._src.ad_checkpoint`; `jax.ad_checkpoint` exports only
the printer `print_saved_residuals`), so it is looked up in both places and `available()` says
whether this jax has it; callers skip or report instead of guessing.
"""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass
from typing import Callable, Collection, NamedTuple

import numpy as np

_ARGUMENT = "from the argument"
# Every description jax 0.10 writes starts with one of these. Anything else means the format
# changed, and "is this residual an argument?" can no longer be read off the text.
_KNOWN_PREFIXES = (_ARGUMENT, "from a literal", "from a constant", "named ", "output of ")


class SavedResiduals(NamedTuple):
    """What `saved_residual_bytes` counted: the kept residuals and the argument ones left out."""

    bytes: int  # sum of size x itemsize over the kept residuals
    count: int  # how many residuals were kept
    excluded: int  # how many were dropped as (excluded) function arguments


def _find() -> Callable | None:
    for mod in ("jax.ad_checkpoint", "jax._src.ad_checkpoint"):
        try:
            return getattr(importlib.import_module(mod), "saved_residuals")
        except (ImportError, AttributeError):
            continue
    return None


def available() -> bool:
    """Whether this jax has `saved_residuals` (public or private)."""
    return _find() is not None


def _is_excluded(description: str, exclude_arguments: bool | Collection[str]) -> bool:
    if not description.startswith(_ARGUMENT):
        return False
    if isinstance(exclude_arguments, bool):
        return exclude_arguments
    # "from the argument params['layers']['mlp']...": the name is followed by a path or nothing.
    rest = description[len(_ARGUMENT):].lstrip()
    return any(rest == name or rest.startswith((name + "[", name + "."))
               for name in exclude_arguments)


def saved_residual_bytes(fn: Callable, *args,
                         exclude_arguments: bool | Collection[str] = True) -> SavedResiduals | None:
    """Bytes jax saves for the backward of `fn(*args)` (args may be abstract ShapeDtypeStructs).

    exclude_arguments: True drops every residual that is one of fn's arguments as passed in;
    a collection of argument names (e.g. `("params",)`) drops only those, so inputs such as
    token ids still count; False keeps everything. None and RuntimeError: as `residual_list`.
    """
    res = residual_list(fn, *args)
    if res is None:  # pragma: no cover - a future jax that moved it
        return None
    kept = [a for a, d in res if not _is_excluded(d, exclude_arguments)]
    nbytes = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in kept)
    return SavedResiduals(nbytes, len(kept), len(res) - len(kept))


def residual_list(fn: Callable, *args) -> list[tuple] | None:
    """jax's own list for the backward of `fn(*args)`: (abstract value, description) pairs.

    Returns None where this jax has no `saved_residuals`; raises RuntimeError if a description
    is in a format this module does not know (which residuals are arguments, and their names,
    are read off it).
    """
    saved_residuals = _find()
    if saved_residuals is None:  # pragma: no cover - a future jax that moved it
        return None
    res = saved_residuals(fn, *args)
    unknown = [d for _, d in res if not d.startswith(_KNOWN_PREFIXES)]
    if unknown:
        raise RuntimeError("saved_residuals descriptions in an unknown format: "
                           + "; ".join(unknown[:3]))
    return res


@dataclass(frozen=True)
class Residual:
    """One group of the values jax saves for a backward: same name, shape and dtype.

    name: `named 'q'` (a `checkpoint_name`), `dot_general at model.py:42 (attn)` (an op's output
        and its source line), `argument params['w']` or `constant`. shape, dtype: of one value
        (a layer scan saves one stacked [L, ...] value); bytes: count x size x itemsize.
    argument: an input of the differentiated function, in memory for the call anyway
        (MemoryAnalysis.argument_bytes), so `residual_bytes` leaves it out.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    count: int
    bytes: int
    argument: bool


def group_residuals(listed) -> tuple[Residual, ...]:
    """jax's (aval, description) pairs as Residual groups, largest total first."""
    groups: dict[tuple, list] = {}
    for aval, desc in listed:
        shape, dtype = tuple(int(d) for d in aval.shape), np.dtype(aval.dtype)
        key = (_residual_name(desc), shape, dtype.name, desc.startswith(_ARGUMENT))
        g = groups.setdefault(key, [0, 0])
        g[0] += 1
        g[1] += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    out = [Residual(n, s, d, c, b, arg) for (n, s, d, arg), (c, b) in groups.items()]
    return tuple(sorted(out, key=lambda r: (r.argument, -r.bytes, r.name)))


_SOURCE = re.compile(r"(?P<path>[^\s:]+):(?P<line>\d+)(?::\d+)?(?P<rest>.*)")


def _residual_name(desc: str) -> str:
    """A short name from jax's description ('output of dot_general from /a/b/m.py:42:8 (f)'
    -> 'dot_general at m.py:42 (f)'; "named 'q' from ..." -> "named 'q'")."""
    if desc.startswith(_ARGUMENT):
        return "argument " + desc[len(_ARGUMENT):].strip()
    if desc.startswith("named "):
        return desc.split(" from ")[0]
    if desc.startswith("output of "):
        prim, _, src = desc[len("output of "):].partition(" from ")
        m = _SOURCE.match(src.strip())
        if not m:
            return prim
        fn = m["rest"].strip().strip("()").rpartition(".")[2]  # "(f.<locals>.block)": "block"
        return f"{prim} at {os.path.basename(m['path'])}:{m['line']}" + (f" ({fn})" if fn else "")
    return "constant"
