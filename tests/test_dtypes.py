"""The format table: every value equals ml_dtypes.finfo, and the known values are right."""

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from jaxmem.dtypes import table as dtypes
from jaxmem.dtypes.cli import main as dtypes_main
from testenv import subprocess_env


REPO = Path(__file__).resolve().parents[1]


def _all_values(dt):
    """Every value a format of at most 16 bits can hold, by enumerating its bit patterns."""
    bits = ml_dtypes.finfo(dt).bits
    raw = np.arange(2**bits, dtype=np.uint16 if bits > 8 else np.uint8)
    with np.errstate(invalid="ignore"):  # NaN patterns warn on the cast
        return raw.view(dt).astype(np.float64)


def test_json_matches_finfo(capsys):
    assert dtypes_main(["--format", "json"]) == 0
    rows = {row["dtype"]: row for row in json.loads(capsys.readouterr().out)}
    assert set(rows) == {dt.name for _, dt in dtypes.available_dtypes()}
    for name, row in rows.items():
        fi = ml_dtypes.finfo(np.dtype(name))
        assert row["bits"] == fi.bits
        assert row["exponent_bits"] == fi.nexp
        assert row["mantissa_bits"] == fi.nmant
        assert row["sign_bits"] + fi.nexp + fi.nmant == fi.bits, name
        for key in ("min", "max", "smallest_normal", "smallest_subnormal", "eps"):
            assert row[key] == float(getattr(fi, key)), (name, key)  # exact: json keeps repr


def test_required_formats_present():
    names = {dt.name for _, dt in dtypes.available_dtypes()}
    required = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
                "float8_e8m0fnu", "float6_e3m2fn", "float6_e2m3fn", "float4_e2m1fn"}
    assert required <= names


def test_known_values():
    rows = {row["dtype"]: row for row in dtypes.format_table()}
    assert rows["float8_e4m3fn"]["max"] == 448.0
    assert rows["float8_e5m2"]["max"] == 57344.0
    assert rows["float4_e2m1fn"]["max"] == 6.0
    assert rows["float6_e2m3fn"]["max"] == 7.5
    assert rows["float6_e3m2fn"]["max"] == 28.0
    assert rows["bfloat16"]["eps"] == 2.0**-7
    assert rows["float16"]["max"] == 65504.0
    # fp4 has an eps (1 mantissa bit: 1 + 2^-1 is the next value after 1).
    assert rows["float4_e2m1fn"]["eps"] == 0.5
    # e8m0fnu: unsigned, exponent only; min and max the right way round.
    e8m0 = rows["float8_e8m0fnu"]
    assert e8m0["sign_bits"] == 0
    assert e8m0["min"] == 2.0**-127
    assert e8m0["max"] == 2.0**127
    assert e8m0["min"] < e8m0["max"]


@pytest.mark.parametrize(
    "dtype, has_inf, has_nan",
    [
        ("float32", True, True),
        ("bfloat16", True, True),
        ("float16", True, True),
        ("float8_e4m3fn", False, True),  # inf casts to NaN
        ("float8_e5m2", True, True),
        ("float8_e8m0fnu", False, True),
        ("float6_e3m2fn", False, False),  # inf saturates to max, NaN becomes -0
        ("float6_e2m3fn", False, False),
        ("float4_e2m1fn", False, False),
    ],
)
def test_inf_nan_flags(dtype, has_inf, has_nan):
    row = dtypes.describe(np.dtype(getattr(ml_dtypes, dtype, None) or dtype))
    assert (row["has_inf"], row["has_nan"]) == (has_inf, has_nan)


def test_inf_nan_flags_agree_with_bit_patterns():
    """The cast-based flags agree with an exhaustive look at every bit pattern (<= 16 bits)."""
    for _, dt in dtypes.available_dtypes():
        if ml_dtypes.finfo(dt).bits > 16:
            continue
        values = _all_values(dt)
        row = dtypes.describe(dt)
        assert row["has_inf"] == bool(np.isinf(values).any()), dt.name
        assert row["has_nan"] == bool(np.isnan(values).any()), dt.name
        finite = values[np.isfinite(values)]
        assert row["max"] == finite.max() and row["min"] == finite.min(), dt.name


@pytest.mark.parametrize("fmt", dtypes.FORMATS)
def test_every_format(fmt, capsys):
    assert dtypes_main(["--format", fmt]) == 0
    out = capsys.readouterr().out
    n = len(dtypes.available_dtypes())
    if fmt == "json":
        assert len(json.loads(out)) == n
    elif fmt == "csv":
        rows = list(csv.DictReader(io.StringIO(out)))
        assert len(rows) == n
        e4m3 = next(r for r in rows if r["dtype"] == "float8_e4m3fn")
        assert float(e4m3["max"]) == 448.0
    elif fmt == "markdown":
        lines = out.strip().splitlines()
        assert len(lines) == n + 2 and all(line.startswith("|") for line in lines)
        assert "| fp8 e4m3fn | float8_e4m3fn | 8 | 1 | 1 | 4 | 3 | -448 | 448 |" in out
    else:  # text: within 120 columns, a row per format and a line pointing to --wide
        lines = out.strip().splitlines()
        assert len(lines) == n + 2 and lines[0].startswith("name") and "--wide" in lines[-1]
        assert max(map(len, lines)) <= 120
        assert "fp16             16    1/5/10   -65504        65504 " in out


def test_wide_text_has_every_column_exact(capsys):
    assert dtypes_main(["--wide"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(dtypes.available_dtypes()) + 1 and "PyTorch dtype" in lines[0]
    assert "1.7976931348623157e+308" in lines[1]


def test_default_is_text(capsys):
    dtypes_main([])
    assert capsys.readouterr().out.startswith("name ")


def test_bad_format_exits_2():
    proc = subprocess.run(
        [sys.executable, "-m", "jaxmem.dtypes", "--format", "xml"],
        capture_output=True, text=True, check=False, cwd=REPO, env=subprocess_env(),
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "invalid choice: 'xml'" in proc.stderr
