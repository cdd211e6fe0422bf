"""`python -m jaxmem.plot RUN_DIR [RUN_DIR ...] --out curves.png`: training curves of runs.

Reads each run's metrics.jsonl; train and eval loss, learning rate, loss scale and skipped steps
over steps, the runs overlaid with a legend (labels: directory name, precision mode, remat).
Needs matplotlib (`pip install -e '.[plot]'`).
"""

from __future__ import annotations

import argparse
import sys

from jaxmem.plot.figure import PlotError, save


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxmem.plot",
        description="Plot the training curves of one or more jaxmem runs (metrics.jsonl), "
                    "overlaid: loss and eval loss, learning rate, loss scale, skipped steps.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (jaxmem.train --out)")
    p.add_argument("--out", default="curves.png", help="image to write (default: curves.png; "
                   "the suffix picks the format: .png, .svg, .pdf)")
    p.add_argument("--labels", default=None, help="comma-separated legend labels, one per run "
                   "(default: directory name, precision, remat)")
    return p


def main(argv=None) -> int:
    from jaxmem.plot.curves import plot_runs  # noqa: PLC0415

    p = build_parser()
    args = p.parse_args(argv)
    labels = args.labels.split(",") if args.labels else None
    if labels and len(labels) != len(args.runs):
        p.error(f"--labels has {len(labels)} names for {len(args.runs)} runs")
    try:
        path = save(plot_runs(args.runs, labels), args.out)
    except PlotError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
