"""The floating-point formats a training engineer chooses between, read from ml_dtypes at run time.

    format_table() -> one dict per format; render(rows, "text" | "wide" | "markdown" | "csv" |
    "json") -> the table as text (`python -m jaxmem.dtypes`: jaxmem.dtypes.cli)

Every number comes from `ml_dtypes.finfo` (which defers to `numpy.finfo` for fp64/fp32/fp16) on
the installed versions; none is typed in. Widely copied tables of these formats carry errors
(fp8 e8m0fnu with min and max swapped, fp4 e2m1fn without an eps); reading them from the
library that JAX itself uses for these dtypes is the way to stay right.

Two columns are not plain `finfo` fields, so they are derived here:

- sign bits: 1, unless `finfo.min >= 0` (e8m0fnu is unsigned: it stores only an exponent);
- has inf / has NaN: `float('inf')` and `float('nan')` are cast into the format and read back as
  float32. The result is not always what the name suggests: e4m3fn turns inf into NaN (it has no
  inf), fp6 and fp4 saturate inf to their max and turn NaN into -0 (they have neither).
"""

from __future__ import annotations

import csv
import io
import json
import math
import warnings

import ml_dtypes
import numpy as np

# (short name, attribute of ml_dtypes or numpy). Order: the formats people train in, then the
# fp8 / fp6 / fp4 family. Formats missing from the installed ml_dtypes are skipped at run time.
_FORMATS = (
    ("fp64", "float64"),
    ("fp32", "float32"),
    ("fp16", "float16"),
    ("bf16", "bfloat16"),
    ("fp8 e4m3fn", "float8_e4m3fn"),
    ("fp8 e5m2", "float8_e5m2"),
    ("fp8 e8m0fnu", "float8_e8m0fnu"),
    ("fp8 e4m3fnuz", "float8_e4m3fnuz"),
    ("fp8 e5m2fnuz", "float8_e5m2fnuz"),
    ("fp8 e4m3b11fnuz", "float8_e4m3b11fnuz"),
    ("fp8 e4m3", "float8_e4m3"),
    ("fp8 e3m4", "float8_e3m4"),
    ("fp6 e3m2fn", "float6_e3m2fn"),
    ("fp6 e2m3fn", "float6_e2m3fn"),
    ("fp4 e2m1fn", "float4_e2m1fn"),
)

# PyTorch dtype names (torch 2.11). A static map, so that torch stays an optional dependency.
# fp4 has no unpacked torch dtype: torch stores it two values per byte.
_TORCH = {
    "float64": "torch.float64",
    "float32": "torch.float32",
    "float16": "torch.float16",
    "bfloat16": "torch.bfloat16",
    "float8_e4m3fn": "torch.float8_e4m3fn",
    "float8_e5m2": "torch.float8_e5m2",
    "float8_e8m0fnu": "torch.float8_e8m0fnu",
    "float8_e4m3fnuz": "torch.float8_e4m3fnuz",
    "float8_e5m2fnuz": "torch.float8_e5m2fnuz",
    "float4_e2m1fn": "torch.float4_e2m1fn_x2 (packed, 2 per byte)",
}

COLUMNS = (
    ("name", "name"),
    ("dtype", "dtype"),
    ("bits", "bits"),
    ("bytes", "storage bytes"),
    ("sign_bits", "sign"),
    ("exponent_bits", "exp"),
    ("mantissa_bits", "mant"),
    ("min", "min"),
    ("max", "max"),
    ("smallest_normal", "smallest normal"),
    ("smallest_subnormal", "smallest subnormal"),
    ("eps", "eps"),
    ("has_inf", "inf"),
    ("has_nan", "NaN"),
    ("torch", "PyTorch dtype"),
)
FORMATS = ("text", "markdown", "csv", "json")


def available_dtypes() -> list[tuple[str, np.dtype]]:
    """(short name, numpy dtype) for every format in `_FORMATS` that this ml_dtypes provides."""
    found = []
    for name, attr in _FORMATS:
        dt = getattr(ml_dtypes, attr, None) or getattr(np, attr, None)
        if dt is not None:
            found.append((name, np.dtype(dt)))
    return found


def _roundtrip(value: float, dt: np.dtype) -> float:
    """`value` cast into `dt` and back to float32: what the format really stores for it."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")  # numpy warns on the inf/nan casts we do on purpose
        return float(np.array(value, np.float32).astype(dt).astype(np.float32))


def describe(dt: np.dtype, name: str | None = None) -> dict:
    """One row of the table for `dt`: plain Python values, ready for JSON."""
    fi = ml_dtypes.finfo(dt)
    return {
        "name": name or dt.name,
        "dtype": dt.name,
        "bits": int(fi.bits),
        "bytes": int(dt.itemsize),
        "sign_bits": 0 if float(fi.min) >= 0 else 1,
        "exponent_bits": int(fi.nexp),
        "mantissa_bits": int(fi.nmant),
        "min": float(fi.min),
        "max": float(fi.max),
        "smallest_normal": float(fi.smallest_normal),
        "smallest_subnormal": float(fi.smallest_subnormal),
        "eps": float(fi.eps),
        "has_inf": bool(np.isinf(_roundtrip(math.inf, dt))),
        "has_nan": bool(np.isnan(_roundtrip(math.nan, dt))),
        "torch": _TORCH.get(dt.name, ""),
    }


def format_table() -> list[dict]:
    """The rows shared by every output format and by the tests."""
    return [describe(dt, name) for name, dt in available_dtypes()]


def _cell(value) -> str:
    """Shortest exact text for a value; powers of two also as 2^k, as people reason about them."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        text = repr(value).removesuffix(".0")
        mantissa, exponent = math.frexp(abs(value))
        if mantissa == 0.5 and abs(exponent - 1) >= 4:
            text += f" (2^{exponent - 1})"
        return text
    return str(value)


def _short(value) -> str:
    """A short cell: 2^k for powers of two, else 5 significant digits."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    mantissa, exponent = math.frexp(abs(value))
    if mantissa == 0.5 and abs(exponent - 1) >= 4:
        return f"{'-' if value < 0 else ''}2^{exponent - 1}"
    return f"{value:.5g}"


def _compact(rows: list[dict]) -> str:
    """The table in at most ~110 columns: sign/exponent/mantissa bits in one column, values
    rounded to 5 digits or written as 2^k; no PyTorch names (those are in --wide)."""
    header = ["name", "bits", "s/e/m", "min", "max", "smallest normal", "smallest subnormal",
              "eps", "inf", "NaN"]
    body = [[r["name"], str(r["bits"]), f"{r['sign_bits']}/{r['exponent_bits']}/{r['mantissa_bits']}"]
            + [_short(r[k]) for k in ("min", "max", "smallest_normal", "smallest_subnormal", "eps",
                                      "has_inf", "has_nan")] for r in rows]
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
             for cells in [header] + body]
    return "\n".join(lines + ["(exact values and PyTorch dtype names: --wide, or --format "
                               "markdown / csv / json)"])


def render(rows: list[dict], fmt: str) -> str:
    """The table as text (compact, aligned), wide (every column, exact), markdown, csv or json."""
    if fmt == "json":
        return json.dumps(rows, indent=2)
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=[key for key, _ in COLUMNS], lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)  # csv writes floats with repr: exact
        return buf.getvalue().rstrip("\n")
    if fmt == "text":  # within 120 columns; --wide ("wide") is the exact, full table
        return _compact(rows)
    header = [title for _, title in COLUMNS]
    body = [[_cell(row[key]) for key, _ in COLUMNS] for row in rows]
    if fmt == "markdown":
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in [header] + body
    )
