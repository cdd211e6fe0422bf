"""The report of experiments.compare: jax / torch ratios per (mode, remat), MFU, the text or
markdown tables, and the bar chart. Works on the result dicts the workers print, so a saved
results JSON can be re-reported without running anything."""

from __future__ import annotations

import platform
from pathlib import Path

from experiments.compare.workers import FRAMEWORKS, MODES, SELECTIVE, model_config

# jax blue, torch (eager) red, torch.compile orange
CHART_SERIES = (("jax", "jax", "C0"), ("torch", "torch (eager)", "C3"),
                ("torch-compile", "torch.compile", "C1"))


def versions() -> dict:
    import importlib.metadata as md
    v = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "flax", "optax", "torch", "numpy"):
        try:
            v[name] = md.version(name)
        except md.PackageNotFoundError:
            v[name] = None
    return v


def _ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def remat_label(remat: str) -> str:
    return "selective" if remat == SELECTIVE else remat


def _order(r: dict):
    s = r["spec"]
    remats = ["none", "full", SELECTIVE]
    return (MODES.index(s["mode"]), remats.index(s["remat"]) if s["remat"] in remats else 9,
            s["remat"], FRAMEWORKS.index(s["framework"]))


def _by_run(results: list[dict]) -> dict:
    """{(framework, mode, remat): result}, in table order."""
    return {(r["spec"]["framework"], r["spec"]["mode"], r["spec"]["remat"]): r
            for r in sorted(results, key=_order)}


def add_ratios(results: list[dict]) -> list[dict]:
    """One row per (mode, remat): jax vs torch eager and torch.compile, with the target ratios."""
    by = _by_run(results)
    rows = []
    for (fw, mode, remat), j in by.items():
        if fw != "jax":
            continue
        t, tc = by.get(("torch", mode, remat), {}), by.get(("torch-compile", mode, remat), {})
        rows.append({
            "mode": mode, "remat": remat,
            "saved_ratio": _ratio(j.get("saved_bytes"), t.get("saved_bytes")),  # target <= 1
            "tps_ratio_eager": _ratio(j.get("tokens_per_s"), t.get("tokens_per_s")),  # >= 1
            "tps_ratio_compile": _ratio(j.get("tokens_per_s"), tc.get("tokens_per_s")),  # >= 1
            "peak_ratio_compile": _ratio(j.get("peak_bytes"), tc.get("peak_bytes")),  # <= 1
            "loss_diff": (None if j.get("loss") is None or t.get("loss") is None
                          else j["loss"] - t["loss"]),
        })
    return rows


def add_mfu(results: list[dict]) -> None:
    """r["mfu"] = model FLOPs/s over the device's dense peak for the mode's compute dtype
    (jaxmem.perf); None on CPU and for fp32 runs, which are not MFU runs."""
    from jaxmem.families.params import model_flops
    from jaxmem.perf import peak_flops
    from jaxmem.model.precision import get_precision
    for r in results:
        if "error" in r:
            continue
        s = r["spec"]
        r["mfu"] = None
        if s["mode"] == "fp32":
            continue
        peak = peak_flops(r.get("device", ""), get_precision(s["mode"]).compute_dtype)
        if peak:
            r["mfu"] = model_flops(model_config(s), s["seq_len"]) * r["tokens_per_s"] / peak


def mib(x):
    return "-" if x is None else f"{x / 2**20:.2f}"


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def format_table(results: list[dict], rows: list[dict], markdown: bool = False) -> str:
    head = ["mode", "remat", "framework", "saved MiB", "peak est MiB", "peak MiB", "step ms",
            "tok/s", "loss", "MFU"]
    lines = []
    for r in sorted(results, key=_order):
        s = r["spec"]
        if "error" in r:
            lines.append([s["mode"], remat_label(s["remat"]), s["framework"], "error (see JSON)",
                          "", "", "", "", "", ""])
            continue
        lines.append([s["mode"], remat_label(s["remat"]), s["framework"], mib(r["saved_bytes"]),
                      mib(r.get("peak_est_bytes")), mib(r.get("peak_bytes")),
                      _f(r["step_ms"], ".1f"), _f(r["tokens_per_s"], ",.0f"), _f(r["loss"], ".4f"),
                      _f(r.get("mfu"), ".1%")])
    ratio_head = ["mode", "remat", "saved jax/torch (<=1)", "tok/s jax/eager (>=1)",
                  "tok/s jax/compile (>=1)", "peak jax/compile (<=1)", "loss jax-torch"]
    ratio_lines = [[r["mode"], remat_label(r["remat"]), _f(r["saved_ratio"], ".3f"),
                    _f(r["tps_ratio_eager"], ".3f"), _f(r["tps_ratio_compile"], ".3f"),
                    _f(r["peak_ratio_compile"], ".3f"), _f(r["loss_diff"], "+.2e")] for r in rows]

    def render(h, ls):
        if markdown:
            out = ["| " + " | ".join(h) + " |", "|" + "---|" * len(h)]
            return "\n".join(out + ["| " + " | ".join(map(str, x)) + " |" for x in ls])
        w = [max(len(str(x[i])) for x in [h] + ls) for i in range(len(h))]
        fmt = lambda x: "  ".join(str(v).rjust(w[i]) for i, v in enumerate(x))  # noqa: E731
        return "\n".join([fmt(h), fmt(["-" * n for n in w])] + [fmt(x) for x in ls])

    return render(head, lines) + "\n\n" + render(ratio_head, ratio_lines)


def chart(results: list[dict], title: str | None = None):
    """A matplotlib Figure: saved activations (MiB, top) and tokens/s (bottom), one group of bars
    per (mode, remat), one bar per framework; missing runs leave a gap."""
    from jaxmem.plot.figure import new_figure  # noqa: PLC0415 (matplotlib: the plot extra)

    by = _by_run([r for r in results if "error" not in r])
    groups = list(dict.fromkeys((mode, remat) for fw, mode, remat in by))
    fig = new_figure(max(7.0, 0.9 * len(groups) + 3), 6.5)
    ax_saved, ax_tps = fig.subplots(2, 1, sharex=True)
    width = 0.8 / len(CHART_SERIES)
    xs = range(len(groups))
    for k, (fw, label, color) in enumerate(CHART_SERIES):
        offs = [x + (k - (len(CHART_SERIES) - 1) / 2) * width for x in xs]
        for ax, key, div in ((ax_saved, "saved_bytes", 2**20), (ax_tps, "tokens_per_s", 1)):
            vals = [by.get((fw, m, r), {}).get(key) for m, r in groups]
            if any(v is not None for v in vals):
                ax.bar(offs, [(v or 0) / div for v in vals], width, color=color, label=label)
    ax_saved.set(ylabel="saved activations (MiB)",
                 title="Saved for the backward (lower is better)")
    ax_tps.set(ylabel="training throughput (tokens/s)", xlabel="precision mode / remat policy",
               title="Speed (higher is better)")
    ax_tps.set_xticks(list(xs), [f"{m}\n{remat_label(r)}" for m, r in groups], fontsize=8)
    for ax in (ax_saved, ax_tps):
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    dev = next((r.get("device") for r in results if r.get("device")), None)
    fig.suptitle(title or f"jaxmem vs PyTorch, same model and batches ({dev or 'device n/a'})")
    return fig


def write_chart(path: Path, results: list[dict]) -> None:
    """The chart as an image (the suffix picks the format); needs matplotlib."""
    from jaxmem.plot.figure import save  # noqa: PLC0415

    save(chart(results), path)
