"""`python -m jaxmem.dtypes`: the floating-point format table (jaxmem.dtypes.table), or with
`--gradients RUN_DIR` a run's real gradients cast into each format (jaxmem.dtypes.gradients).

    python -m jaxmem.dtypes                    # aligned text table
    python -m jaxmem.dtypes --format markdown  # the table in docs/dtypes.md
    python -m jaxmem.dtypes --format csv|json
    python -m jaxmem.dtypes --gradients runs/my-run
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxmem.dtypes.table import FORMATS, available_dtypes, format_table, render


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxmem.dtypes",
        description="Floating-point formats from ml_dtypes.finfo: range, precision, inf/NaN.",
    )
    parser.add_argument("--format", choices=FORMATS, default="text",
                        help="output format (default: text, within 120 columns)")
    parser.add_argument("--wide", action="store_true",
                        help="text with every column and exact values (about 290 columns)")
    parser.add_argument("--gradients", metavar="RUN_DIR", default=None,
                        help="instead: cast one batch of a run's real gradients into each format "
                             "and report overflow / underflow / precision loss (jaxmem.dtypes.gradients)")
    args = parser.parse_args(argv)
    if args.gradients is None:
        print(render(format_table(), "wide" if args.wide and args.format == "text" else args.format))
        return 0
    from jaxmem.dtypes.gradients import gradient_report
    try:
        report = gradient_report(args.gradients, [(n, dt) for n, dt in available_dtypes()
                                                  if n != "fp64"])
    except (ValueError, RuntimeError) as e:  # RunError, CheckpointError, DataError
        print(f"{parser.prog}: error: --gradients {args.gradients}: {str(e).splitlines()[0]}",
              file=sys.stderr)  # not a flag's syntax: no usage block
        return 2
    if args.format == "json":
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['run']} ({report['precision']}): {report['values']:,} gradient values")
    print(f"|g| from {report['abs_min']:.3g} to {report['abs_max']:.3g} (median "
          f"{report['abs_median']:.3g}); run's loss scale {report['run_loss_scale']:g}")
    cols = [("format", "format"), ("scale", "scale"), ("overflow", "overflow"),
            ("underflow", "underflow to 0"), ("precision_lost", "< half precision"),
            ("negative", "negative (unsigned format)")]
    body = [[r["format"], f"{r['scale']:g}"] + ["-" if r.get(k) is None else f"{100 * r[k]:.3f}%"
                                                for k, _ in cols[2:]]
            for r in report["rows"]]
    widths = [max(len(x) for x in col) for col in zip([t for _, t in cols], *body)]
    for cells in [[t for _, t in cols]] + body:
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
    return 0

