"""Bytes of the residuals jax keeps for a backward pass, counted from jax's own list.

jax's `saved_residuals(f, *args)` traces `vjp(f, *args)` and names every value the backward will
read, with where it came from: "from the argument params['lm_head']...", "named 'query' from ...",
"output of dot_general from ...". That list is the ground truth the planner's formulas and the
PyTorch comparison are checked against, so the counting (and which arguments are left out: the
parameters live in memory anyway, they are not activation memory) is written once, here.

jax 0.10 keeps the function private (`jax._src.ad_checkpoint`; `jax.ad_checkpoint` exports only
the printer `print_saved_residuals`), so it is looked up in both places and `available()` says
whether this jax has it; callers skip or report instead of guessing.
"""

from __future__ import annotations

import importlib
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
    token ids still count; False keeps everything. Returns None where this jax has no
    `saved_residuals`; raises RuntimeError if its descriptions are in a format this code does
    not know (the exclusion would silently count the wrong thing).
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
    is in a format this module does not know (jaxmem.memory.analyze groups them by it).
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
