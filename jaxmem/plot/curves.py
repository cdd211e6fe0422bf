"""Training curves of one or more runs from their metrics.jsonl, overlaid with a legend.

Four panels sharing the step axis: train loss (lines) and eval loss (dashed, markers); learning
rate; loss scale (log axis: it halves and doubles); skipped (non-finite) steps, cumulative. The
obvious use is comparing precision modes: `python -m jaxmem.plot runs/fp32 runs/amp-fp16`.
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxmem.plot.figure import PlotError, new_figure


def load_metrics(run_dir) -> list[dict]:
    """The records of `<run_dir>/metrics.jsonl` (PlotError naming the file when there are none)."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        recs = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    except FileNotFoundError:
        raise PlotError(f"{path}: not found (is {run_dir} a jaxmem.train run directory?)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise PlotError(f"{path}: unreadable ({e})") from None
    if not recs:
        raise PlotError(f"{path}: no records yet")
    return recs


def run_label(run_dir) -> str:
    """The run's directory name and its precision mode and remat, where config.json says."""
    name = Path(run_dir).resolve().name
    try:
        cfg = json.loads((Path(run_dir) / "config.json").read_text())["config"]
        mode, remat = cfg["precision"]["mode"], cfg["remat"]["policy"]
    except (OSError, KeyError, ValueError, TypeError):
        return name
    extra = [x for x in (mode if mode not in name else None,
                         f"remat {remat}" if remat != "none" and remat not in name else None) if x]
    return f"{name} ({', '.join(extra)})" if extra else name


def plot_runs(run_dirs, labels=None):
    """A Figure with the four panels; one color per run, in the order given."""
    runs = [(labels[i] if labels else run_label(d), load_metrics(d)) for i, d in enumerate(run_dirs)]
    fig = new_figure(10, 7.5)
    (ax_loss, ax_lr), (ax_scale, ax_skip) = fig.subplots(2, 2, sharex=True)
    for i, (label, recs) in enumerate(runs):
        color = f"C{i}"
        steps = [r["step"] for r in recs]
        ax_loss.plot(steps, [r["loss"] for r in recs], color=color, lw=1.2,
                     label=f"{label}: train")
        ev = [(r["step"], r["eval_loss"]) for r in recs if r.get("eval_loss") is not None]
        if ev:
            ax_loss.plot(*zip(*ev), color=color, ls="--", marker="o", ms=4,
                         label=f"{label}: eval")
        ax_lr.plot(steps, [r["lr"] for r in recs], color=color, label=label)
        ax_scale.plot(steps, [r["loss_scale"] for r in recs], color=color, label=label)
        skipped, total = [], 0
        for r in recs:
            total += bool(r.get("skipped"))
            skipped.append(total)
        ax_skip.step(steps, skipped, where="post", color=color, label=label)
    ax_loss.set(title="loss", ylabel="cross-entropy (nats/token)")
    ax_lr.set(title="learning rate", ylabel="lr")
    ax_scale.set(title="loss scale", ylabel="scale (log)", yscale="log", xlabel="optimizer step")
    ax_skip.set(title="skipped steps (non-finite gradients)", ylabel="count, cumulative",
                xlabel="optimizer step")
    ax_skip.set_ylim(bottom=0, top=max(1, ax_skip.get_ylim()[1]))
    ax_skip.yaxis.get_major_locator().set_params(integer=True)
    for ax in (ax_loss, ax_lr, ax_scale, ax_skip):
        ax.grid(alpha=0.3)
    ax_loss.legend(fontsize=8)
    ax_lr.legend(fontsize=8)
    fig.suptitle("jaxmem training curves (metrics.jsonl, one point per logged step)")
    return fig
