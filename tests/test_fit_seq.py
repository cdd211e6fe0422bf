"""`--fit-seq GIB` (jaxmem.memory.search): the longest sequence whose run fits."""

from __future__ import annotations

import dataclasses

import pytest

from jaxmem.config.run import RunConfig
from jaxmem.memory.cli import main
from jaxmem.memory.search import fit_seq
from jaxmem.memory.spec import StepSpec


def _spec(seq_len=2048, max_pos=131072):
    cfg = RunConfig().replace({"model.preset": "tiny", "model.max_position_embeddings": max_pos,
                               "data.seq_len": min(seq_len, max_pos)})
    return StepSpec.from_run_config(cfg).replace(seq_len=seq_len)


def _linear(per_token, fixed=0):
    """A fake compile whose peak is fixed + per_token x T, and phases that pass it on."""
    calls = []

    def compile_fn(s):
        calls.append(s.seq_len)
        return {"peak_bytes": fixed + per_token * s.seq_len, "host_bytes": 0}

    def phases_fn(s, step):
        return {"peak_bytes": step["peak_bytes"], "peak_phase": "step"}
    return compile_fn, phases_fn, calls


@pytest.mark.parametrize("start", [1024, 2048, 100_000])
def test_the_longest_multiple_of_the_granule_under_the_budget(start):
    compile_fn, phases_fn, calls = _linear(1000, fixed=10_000)
    budget = 10_000 + 1000 * 37_000  # fits up to T = 37,000: the answer is 36 x 1024 = 36,864
    r = fit_seq(_spec(start), budget, phases_fn, compile_fn=compile_fn)
    assert r["chosen"]["seq_len"] == 36_864 and r["limit"] == "memory"
    assert all(e["fits"] == (e["seq_len"] <= 37_000) for e in r["tried"])
    assert len(calls) == len(set(calls)) <= 12  # doubling/halving then bisection, no repeats


def test_the_model_positions_cap_the_search_and_say_so():
    compile_fn, phases_fn, _ = _linear(1)
    r = fit_seq(_spec(2048, max_pos=8192), 10**12, phases_fn, compile_fn=compile_fn)
    assert r["chosen"]["seq_len"] == 8192 and r["limit"] == "max_position_embeddings"


def test_nothing_fits_and_compile_errors_do_not_fit():
    def broken(s):
        raise ValueError("RESOURCE_EXHAUSTED: too big\nmore")
    r = fit_seq(_spec(4096), 10**12, lambda s, c: None, compile_fn=broken)
    assert r["chosen"] is None
    assert all(e["reason"] == "compile error: RESOURCE_EXHAUSTED: too big" for e in r["tried"])


@pytest.mark.parametrize("flags, batch", [([], 1), (["--batch-size", "2"], 2)])
def test_cli_fit_seq_says_its_batch_and_the_cards_share(flags, batch, monkeypatch, capsys):
    """Without --batch-size --fit-seq searches at micro-batch 1 (not the default 16), and its
    answer says so and what share of the card it assumed, in JSON and in text; a given
    --batch-size is searched and said. (The step's compile faked: its peak grows with B x T.)"""
    import json

    from jaxmem.memory import commands, search
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    seen = []

    def fake_step(spec, mesh=None):
        seen.append(spec.batch_size)
        return {"peak_bytes": 1000 * spec.batch_size * spec.seq_len, "host_bytes": 0}
    for module in (commands, search):  # the step compile of both search paths
        monkeypatch.setattr(module, "compile_step", fake_step)
    argv = ["--preset", "tiny", "--max-position-embeddings", "4096", *flags, "--fit-seq", "40"]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(seen) == {batch} and out["chosen"]["batch_size"] == batch
    assert out["batch_size"] == batch and out["batch_size_given"] == bool(flags)
    assert out["mem_fraction"] == 0.75 and out["usable_bytes"] == 30 * 2**30
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert f"longest sequence for a 40 GiB GPU at micro-batch {batch} " in text
    assert f"chosen: --seq-len 4096 --batch-size {batch} (" in text
    said = "(--batch-size)" if flags else "(--fit-seq's default; --batch-size N searches at N)"
    assert f"  assumed: micro-batch {batch} {said}\n  and XLA may use 75% of the 40 GiB card " \
        "(XLA_PYTHON_CLIENT_MEM_FRACTION" in text


@pytest.mark.slow  # 7.6 s cold on 2 cores (the README run stays near 5 min)
def test_cli_fit_seq_compiles_and_refuses_fit_with_it(capsys):
    rc = main(["--preset", "tiny", "--max-position-embeddings", "4096", "--seq-len", "1024",
               "--batch-size", "1",
               "--fit-seq", "0.9"])
    out = capsys.readouterr().out
    assert rc == 0 and "chosen: --seq-len" in out and "1,024 tokens: step" in out
    assert "--batch-size 1 (" in out and "assumed: micro-batch 1 (--batch-size)" in out
    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", "--fit-seq", "40", "--fit", "40"])
    assert e.value.code == 2 and "--fit-seq searches the sequence length" in \
        capsys.readouterr().err


@pytest.mark.slow  # a JAX subprocess compiling on 4 simulated CPU devices
def test_cli_fit_seq_on_a_context_mesh(tmp_path):
    """--fit-seq with --devices / --mesh context=N: the per-device step peak decides."""
    import subprocess
    import sys

    from testenv import ROOT, subprocess_env
    proc = subprocess.run(
        [sys.executable, "-m", "jaxmem.memory", "--preset", "tiny", "--num-layers", "2",
         "--max-position-embeddings", "8192", "--seq-len", "1024", "--batch-size", "1",
         "--devices", "4", "--mesh", "context=4", "--fit-seq", "0.9"],
        cwd=ROOT, env=subprocess_env(cpu_devices=4), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step per device (data=1,fsdp=1,tensor=1,context=4)" in proc.stdout
    assert "chosen: --seq-len" in proc.stdout
