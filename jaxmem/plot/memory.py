"""A train step's memory as stacked bars, one per configuration (`python -m jaxmem.memory --plot`).

The categories group the analytic model's components that are live at the peak
(jaxmem.memory.analytic): params (master and compute copies), gradients (and the accumulator),
optimizer (Adam moments, loss scale), activations (saved for the backward, logits excluded),
logits (the saved exp(logits - max) and, when it is the largest transient, logits + dlogits),
transient (one layer's backward when larger, the batch). XLA's compiled peak is drawn as a
marker on each bar, and the --fit budget as a horizontal line.
"""

from __future__ import annotations

from jaxmem.plot.figure import PlotError, new_figure

GiB = 2**30
CATEGORIES = ("params", "gradients", "optimizer", "activations", "logits", "transient")


# a component's kind (jaxmem.memory.counted.Kind, its value in the report) -> its category
_BY_KIND = {"params": "params", "compute copy": "params", "frozen base": "params",
            "one layer in flight": "params", "gradients": "gradients",
            "grad accumulator": "gradients", "optimizer state": "optimizer",
            "loss scale": "optimizer", "counters": "optimizer", "optimizer update": "optimizer"}


def categories(report: dict) -> dict[str, int]:
    """Bytes per category of a `jaxmem.memory.report.step_report` dict (live at the peak), by
    each component's kind: saved activations split into the loss's saved logits and the rest,
    the largest transient under logits when it is the loss's logits group."""
    a = report["analytic"]
    out = dict.fromkeys(CATEGORIES, 0)
    saved_logits = a["saved_activations"]["logits_bytes"]
    t = a["transients"]
    logits_transient = t["logits_group_bytes"] >= t["layer_backward_bytes"]
    for c in a["components"]:
        if not c["in_peak"] or not c["bytes"]:
            continue
        if c["kind"] == "saved activations":
            out["activations"] += c["bytes"] - saved_logits
            out["logits"] += saved_logits
        elif c["kind"] == "transient":
            out["logits" if logits_transient else "transient"] += c["bytes"]
        else:  # the batch, anything new: transient
            out[_BY_KIND.get(c["kind"], "transient")] += c["bytes"]
    return out


def plot_memory(reports: list[dict], labels: list[str], budget_gib: float | None = None,
                title: str | None = None):
    """Stacked bars per configuration, the compiled peak as a marker, the budget line.

    The unit is GiB, or MiB when every bar and the budget are below 1 GiB (tiny test models).
    """
    if not reports:
        raise PlotError("no configuration to plot")
    per = [categories(r) for r in reports]
    peaks = [r["compiled"]["peak_bytes"] for r in reports]
    top = max(peaks + [sum(p.values()) for p in per] + [(budget_gib or 0) * GiB])
    unit, div = ("GiB", GiB) if top >= GiB else ("MiB", 2**20)
    fig = new_figure(max(7.0, 1.4 * len(reports) + 4), 4.8)
    ax = fig.subplots()
    xs = list(range(len(reports)))
    bottoms = [0.0] * len(reports)
    for i, cat in enumerate(CATEGORIES):
        vals = [p[cat] / div for p in per]
        ax.bar(xs, vals, bottom=bottoms, color=f"C{i}", label=cat, width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.hlines([p / div for p in peaks], [x - 0.36 for x in xs], [x + 0.36 for x in xs],
              color="black", lw=2.5, label="compiled peak (XLA)")
    if budget_gib:
        ax.axhline(budget_gib * GiB / div, color="red", ls="--",
                   label=f"budget {budget_gib:g} GiB")
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_xlim(-0.7, len(reports) - 0.3)
    ax.set_ylabel(f"memory at the peak ({unit})")
    ax.set_xlabel("configuration")
    r0 = reports[0]
    ax.set_title(title or f"Train step memory by category\n(analytic model; {r0['precision']}, "
                          f"seq len {r0['seq_len']}, {r0['backend']})", fontsize=10)
    fig.legend(loc="outside right upper", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig
