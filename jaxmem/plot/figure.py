"""The one place matplotlib is imported: a Figure without pyplot, and saving it."""

from __future__ import annotations

from pathlib import Path


class PlotError(ValueError):
    """matplotlib is missing, or there is nothing to draw; the message says which."""


def new_figure(width: float, height: float):
    """A `matplotlib.figure.Figure` (Agg canvas, no pyplot state); PlotError if not installed."""
    try:
        from matplotlib.figure import Figure  # noqa: PLC0415 (optional extra)
    except ImportError:
        raise PlotError("plotting needs matplotlib: pip install -e '.[plot]'") from None
    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def save(fig, path) -> Path:
    path = Path(path)
    if path.parent and not path.parent.exists():
        raise PlotError(f"--out {path}: directory {path.parent} does not exist")
    fig.savefig(path)
    return path
