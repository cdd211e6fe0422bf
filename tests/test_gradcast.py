"""`python -m jaxmem.dtypes --gradients RUN_DIR`, and an fp8 run that saves and resumes."""

import json
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxmem.dtypes.cli import main as dtypes_main
from jaxmem.dtypes.gradients import cast_stats
from jaxmem.train.cli import main as train_main


def test_cast_stats_exact_on_crafted_values():
    fp16 = np.dtype(np.float16)
    # 1e5 overflows fp16 (max 65504); 1e-9 flushes to 0 (smallest subnormal 6e-8);
    # 1e-7 is a subnormal with ~1 significant bit (relative error ~ 0.19 > 2**-5.5);
    # 0.1 is a normal number (relative error < 2**-11); zeros are not counted.
    values = np.array([1e5, -1e5, 1e-9, 1e-7, 0.1, 0.25, 0.0, 0.0], np.float32)
    s = cast_stats(values, fp16)
    assert s["nonzero_values"] == 6
    assert s["overflow"] == pytest.approx(2 / 6)
    assert s["underflow"] == pytest.approx(1 / 6)
    assert s["precision_lost"] == pytest.approx(1 / 6)
    # bf16 holds all of them within half its precision
    assert cast_stats(values, np.dtype(ml_dtypes.bfloat16)) == {
        "overflow": 0.0, "underflow": 0.0, "precision_lost": 0.0, "negative": None,
        "nonzero_values": 6}
    # e4m3fn has no inf: 1e5 becomes NaN, and is counted as overflow; 448 saturates fine
    assert cast_stats(np.array([1e5, 448.0], np.float32),
                      np.dtype(ml_dtypes.float8_e4m3fn))["overflow"] == pytest.approx(0.5)


def test_unsigned_format_counts_negatives_apart_from_overflow():
    e8m0 = np.dtype(ml_dtypes.float8_e8m0fnu)  # exponent only: 2^-127 ... 2^127, no sign
    values = np.array([-1.0, -0.5, 0.25, 3e38, 3.0, -2.0**-130], np.float32)
    s = cast_stats(values, e8m0)
    assert s["negative"] == pytest.approx(3 / 6)  # were counted as overflow before
    assert s["overflow"] == pytest.approx(1 / 6)  # 3e38 > max 2^127 (1.7e38), < fp32 max
    assert s["underflow"] == 0.0
    # 3.0 rounds to a power of two: relative error 1/3 > 2**-0.5? no (0.33 < 0.71): kept
    assert s["precision_lost"] == 0.0


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / "run"
    text = Path(np.__file__).read_text()[:40000]
    data = out.parent / "corpus.txt"
    data.write_text(text)
    args = ["--num-layers", "2", "--hidden-size", "64", "--intermediate-size", "128",
            "--batch-size", "4", "--seq-len", "32", "--sample-tokens", "0", "--no-progress",
            "--precision", "fp8", "--data", str(data), "--out", str(out), "--steps", "4",
            "--log-every", "1"]
    assert train_main([*args, "--stop-at", "2"]) == 0
    assert train_main([*args, "--resume"]) == 0  # the fp8 state restores and trains on
    return out


@pytest.mark.slow  # two fp8 CLI runs: 57 s of CPU cold
def test_fp8_run_resumes_and_reports_gradients(fp8_run, capsys):
    recs = [json.loads(l) for l in (fp8_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss"]) for r in recs)
    capsys.readouterr()
    assert dtypes_main(["--gradients", str(fp8_run), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["precision"] == "fp8" and report["run_loss_scale"] == 1.0
    scales = sorted({r["scale"] for r in report["rows"]})
    assert scales == [1.0, 65536.0]
    by = {(r["format"], r["scale"]): r for r in report["rows"]}
    assert by[("fp32", 1.0)] == {**by[("fp32", 1.0)], "overflow": 0.0, "underflow": 0.0,
                                 "precision_lost": 0.0}
    # the reason for loss scaling, on real gradients: fp16 loses values at scale 1 that a
    # 2**16 scale keeps, while bf16 (fp32's exponent range) loses none at either scale
    assert by[("fp16", 1.0)]["underflow"] + by[("fp16", 1.0)]["precision_lost"] > \
        by[("fp16", 65536.0)]["underflow"] + by[("fp16", 65536.0)]["precision_lost"]
    assert by[("bf16", 1.0)]["underflow"] == 0.0
    assert by[("fp8 e8m0fnu", 1.0)]["negative"] > 0.3 and by[("fp16", 1.0)]["negative"] is None
    assert by[("fp8 e8m0fnu", 1.0)]["overflow"] == 0.0
    text_rc = dtypes_main(["--gradients", str(fp8_run)])
    out = capsys.readouterr().out
    assert text_rc == 0 and "fp8 e4m3fn" in out and "negative (unsigned format)" in out
    assert max(map(len, out.splitlines()[1:])) <= 120  # (the first line names the run's path)


def test_gradients_bad_run_dir_exits_2(tmp_path, capsys):
    assert dtypes_main(["--gradients", str(tmp_path / "nope")]) == 2
    errors = [l for l in capsys.readouterr().err.splitlines()
              if l.startswith("python -m jaxmem.dtypes: error: ")]
    assert len(errors) == 1 and "--gradients" in errors[0]
