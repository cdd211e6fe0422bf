"""The `python -m jaxmem.memory` command line, and the `--measure` worker protocol."""

import contextlib
import dataclasses
import io
import json
import subprocess
import sys
import types

import pytest

from jaxmem.families import get_preset
from jaxmem.families.config import ModelConfig
from jaxmem.memory import StepSpec, measure
from jaxmem.memory.cli import main
from jaxmem.model.remat import RematPolicy
from jaxmem.model.precision import get_precision
from testenv import subprocess_env


def test_json_output_fields(capsys):
    assert main(["--preset", "tiny", "--num-layers", "2", "--batch-size", "2", "--seq-len", "32",
                 "--remat", "full", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    c = r["compiled"]
    assert r["params"] > 0 and r["flops"] > 0 and r["remat"] == "full"
    assert c["peak_bytes"] == (c["temp_bytes"] + c["argument_bytes"] + c["output_bytes"]
                               - c["alias_bytes"])
    # arguments are at least the fp32 params
    assert c["argument_bytes"] >= 4 * r["params"]


@pytest.mark.slow  # a compile; test_json_output_fields covers the report
def test_table_output(capsys):
    main(["--num-layers", "1", "--batch-size", "1", "--seq-len", "16"])
    out = capsys.readouterr().out
    assert "peak" in out and "MiB" in out


@pytest.mark.parametrize("argv, needle", [
    (["--remat", "bogus"], "unknown remat policy 'bogus'"),
    # a JAX process each; slow: the first runs by default
    pytest.param(["--preset", "huge"], "--preset", marks=pytest.mark.slow),
    pytest.param(["--batch-size", "0"], "--batch-size", marks=pytest.mark.slow),
    pytest.param(["--seq-len", "100000"], "--seq-len 100000 exceeds", marks=pytest.mark.slow),
    pytest.param(["--num-heads", "3"], "num_heads", marks=pytest.mark.slow),
])
def test_bad_input_exits_2(argv, needle):
    p = subprocess.run([sys.executable, "-m", "jaxmem.memory", *argv], capture_output=True,
                       text=True, env=subprocess_env())
    assert p.returncode == 2
    assert needle in p.stderr


@pytest.mark.parametrize("spec", [
    StepSpec.of(get_preset("tiny"), get_precision("fp32"), RematPolicy(), 2, 64),
    StepSpec.of(ModelConfig(hidden_size=40, intermediate_size=56, num_heads=4, num_kv_heads=2,
                            head_dim=12, rope_theta=500000.0, rms_norm_eps=1e-6,
                            tie_embeddings=True),
                get_precision("amp-fp16"), RematPolicy.parse("names:query,mlp_up"), 3, 48,
                grad_accum=5, mu_dtype="bf16", attention="cudnn"),
])
def test_spec_json_round_trip(spec):
    text = spec.to_json()
    assert StepSpec.from_json(text) == spec
    assert json.loads(text)["precision"] == spec.precision.name  # plain JSON, by name


def test_spec_json_from_before_norm_placement():
    """A spec JSON written before `norm_placement` replaced `sandwich_norms` (Gemma 3's sandwich
    as a bool) reads as the same spec."""
    spec = StepSpec.of(dataclasses.replace(get_preset("tiny"), norm_placement="sandwich"),
                       get_precision("fp32"), RematPolicy(), 2, 64)
    d = json.loads(spec.to_json())
    placement = d["model"].pop("norm_placement")
    d["model"]["sandwich_norms"] = placement == "sandwich"
    assert StepSpec.from_json(json.dumps(d)) == spec
    d["model"]["sandwich_norms"] = False
    assert StepSpec.from_json(json.dumps(d)).model.norm_placement == "pre"


@pytest.mark.parametrize("flags", [
    # the old argv rewriter kept abbreviations (then --fi): the child refused. --fi itself is
    # ambiguous since --fit-seq; argparse says so (exit 2)
    pytest.param(["--fit", "40", "--global-batch", "4"], marks=pytest.mark.slow),
    pytest.param(["--fit", "40", "--glob", "4"], marks=pytest.mark.slow),
    pytest.param(["--fit=40", "--glob=4"], marks=pytest.mark.slow),
    ["--glob", "4"],  # no planner: batch 2 x accum 2
])
@pytest.mark.slow  # 3.0 s cold on 2 cores (default run kept under 5 min)
def test_measure_worker_gets_the_chosen_spec(flags, monkeypatch):
    """Abbreviated flags reach the measurement: the child measures exactly the parent's spec.

    The subprocess is replaced by the child's own entry point run in-process (the real
    `python -m jaxmem.memory` argument handling), and measure_here by a recorder.
    """
    measured = []

    def fake_measure_here(spec, steps=3):
        measured.append(spec)
        return {"peak_bytes": 12345, "steps": steps, "note": "fake"}

    def fake_run(cmd, **kwargs):
        assert cmd[1:3] == ["-m", "jaxmem.memory"]
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                rc = main(cmd[3:])
        except SystemExit as e:  # argparse errors in the child
            rc = e.code
        return types.SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr="")

    monkeypatch.setattr(measure, "measure_available", lambda: None)
    monkeypatch.setattr(measure, "measure_here", fake_measure_here)
    monkeypatch.setattr(measure.subprocess, "run", fake_run)
    argv = ["--preset", "tiny", "--num-layers", "1", "--seq-len", "32", "--batch-size", "2",
            "--precision", "amp-bf16", "--measure", "--json", *flags]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    doc = json.loads(out.getvalue())
    report = doc["chosen"] if "chosen" in doc else doc
    assert report["measured"] == {"peak_bytes": 12345, "steps": 3, "note": "fake"}
    (spec,) = measured
    expected = StepSpec.of(get_preset("tiny", num_layers=1), get_precision("amp-bf16"),
                           RematPolicy.parse(report["remat"]), 2, 32, grad_accum=2,
                           mu_dtype=report["mu_dtype"])
    assert spec == expected
    assert (report["batch_size"], report["grad_accum"]) == (2, 2)
