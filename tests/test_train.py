"""`python -m jaxmem.train` end to end: a short run, exact resume, signals, bad input."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxmem.train.cli import main

from runs import SMALL, error_line, losses, params_of  # noqa: E402
from testenv import subprocess_env


@pytest.mark.slow  # 4.6 s cold on 2 cores (default run kept under 5 min)
def test_short_run_end_to_end(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    assert main([*SMALL, "--data", corpus, "--out", str(out), "--steps", "6", "--eval-every", "3",
                 "--sample-tokens", "8"]) == 0
    printed = capsys.readouterr().out
    assert "done: step 6" in printed
    # the sample's prompt is the first whole line of the eval data (the corpus' tail: b.txt's end)
    assert "sample (prompt '\ufffd tail\\n', from the eval data):\n\ufffd tail\n" in printed
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "lr", "grad_norm", "loss_scale", "skipped", "tokens_per_sec"):
        assert key in recs[0]
    assert "eval_loss" in recs[2] and "eval_loss" in recs[5] and "eval_loss" not in recs[0]
    assert recs[-1]["loss"] < recs[0]["loss"]
    config = json.loads((out / "config.json").read_text())
    assert config["schema_version"] == 2
    assert config["config"]["optim"]["total_steps"] == 6 and config["resolved_model"]["num_layers"] == 2
    assert config["data_stats"]["invalid_utf8_replacements"] >= 1
    assert sorted(os.listdir(out / "checkpoints")) == ["6"]


@pytest.mark.slow  # a CLI run: 17 s on 2 cores
def test_records_carry_the_peak_once_the_state_was_made(tmp_path, corpus, capsys, monkeypatch):
    # a CPU reports no device memory: a fake one whose peak grows by 1 GiB each time it is read,
    # so the state's peak (read first) and each record's process peak differ
    import jaxmem.train.loop as loop
    import jaxmem.train.records as records
    reads = []

    def memory(device):
        reads.append(device)
        return {"bytes_in_use": 2**30, "peak_bytes_in_use": len(reads) * 2**30}

    monkeypatch.setattr(loop, "device_memory", memory)
    monkeypatch.setattr(records, "device_memory", memory)
    out = tmp_path / "run"
    assert main([*SMALL, "--data", corpus, "--out", str(out), "--steps", "2",
                 "--sample-tokens", "0"]) == 0
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["state_peak_bytes_in_use"] for r in recs] == [2**30, 2**30]
    assert all(r["peak_bytes_in_use"] > 2**30 for r in recs)
    assert "(1.00 GiB once the state was made)" in capsys.readouterr().out


@pytest.mark.slow  # three CLI runs (amp-fp16)
def test_resume_is_bitwise_exact_even_after_a_skipped_step(tmp_path, corpus):
    # A scale of 2**40 overflows fp16: the first steps are skipped until the scale has backed
    # off, so the interruption at step 2 lands right after a skipped step. (fp32 resume is
    # checked by the SIGTERM test.)
    precision = "amp-fp16"
    args = [*SMALL, "--data", corpus, "--steps", "8", "--precision", precision,
            "--loss-scale-init", str(2.0**40)]
    assert main([*args, "--out", str(tmp_path / "straight")]) == 0
    assert main([*args, "--out", str(tmp_path / "split"), "--stop-at", "2"]) == 0
    assert main([*args, "--out", str(tmp_path / "split"), "--resume"]) == 0
    straight, split = losses(tmp_path / "straight"), losses(tmp_path / "split")
    assert straight == split  # exact floats: per-step loss, grad norm, scale, skipped
    if precision == "amp-fp16":
        assert straight[1][4] is True  # step 2 was skipped
    s1, p1 = params_of(tmp_path / "straight")
    s2, p2 = params_of(tmp_path / "split")
    assert s1 == s2 == 8
    for a, b in zip(p1, p2):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # a 40-step run, a subprocess run and a resume
def test_sigterm_saves_and_resume_matches(tmp_path, corpus):
    args = [*SMALL, "--data", corpus, "--steps", "40"]
    straight = tmp_path / "straight"
    assert main([*args, "--out", str(straight)]) == 0
    run = tmp_path / "run"
    # its own process (a JAX of its own): matmul precision and GPU determinism from TEST_ENV,
    # as this process has them, or its losses would not equal the in-process straight run's
    proc = subprocess.Popen([sys.executable, "-m", "jaxmem.train", *args, "--out", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=subprocess_env())
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "SIGTERM: saved step" in stdout
    saved = int(stdout.split("saved step ")[1].split()[0])
    assert 3 <= saved < 40 and (run / "checkpoints" / str(saved)).is_dir()
    assert main([*args, "--out", str(run), "--resume"]) == 0
    assert losses(run) == losses(straight)


@pytest.mark.slow  # a CLI run (amp-fp16); test_resume checks the count too
def test_too_many_consecutive_skips_stops_with_error(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    code = main([*SMALL, "--data", corpus, "--out", str(out), "--steps", "20",
                 "--precision", "amp-fp16", "--loss-scale", "static:1e30",
                 "--max-consecutive-skips", "3"])
    assert code == 1
    # the check reads each step's metrics while the next step runs, so it stops 1 step late at most
    err = capsys.readouterr().err
    assert "non-finite steps in a row (more than --max-consecutive-skips 3)" in err
    assert int(err.split("error: ")[1].split()[0]) in (4, 5)
    assert not (out / "checkpoints").exists() or not os.listdir(out / "checkpoints")


def run_cli(*argv):
    return subprocess.run([sys.executable, "-m", "jaxmem.train", *argv], capture_output=True,
                          text=True, timeout=120, env=subprocess_env())


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "empty.txt").write_text("")
    (d / "emptydir").mkdir()
    np.save(d / "big_ids.npy", np.array([1, 2, 300], np.int32))
    (d / "file").write_text("x")
    return d


@pytest.mark.parametrize("argv, needle", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
    (["--steps", "0"], "argument --steps: expected a positive integer, got '0'"),
    (["--batch-size", "-2"], "argument --batch-size"),
    (["--seq-len", "0"], "argument --seq-len"),
    (["--lr", "nan"], "argument --lr: expected a finite number >= 0, got 'nan'"),
    (["--lr", "-1e-3"], "argument --lr"),
    (["--seq-len", "4096"], "--seq-len 4096 exceeds the model's max_position_embeddings 512"),
    (["--precision", "fp7"], "argument --precision: invalid choice: 'fp7'"),
    (["--remat", "most"], "unknown remat policy 'most'"),
    (["--num-heads", "3"], "num_heads=3 does not divide"),
    (["--loss-scale", "static:-4"], "static:VALUE"),
    (["--data", "{d}/missing.txt"], "missing.txt"),
    (["--data", "{d}/empty.txt"], "empty.txt"),
    (["--data", "{d}/emptydir"], "emptydir"),
    (["--data", "{d}/big_ids.npy"], "big_ids.npy"),
    (["--out", "{d}/file/run"], "--out"),
    (["--resume", "--out", "{d}/nothing_here"], "no run config"),
])
def test_bad_input_exits_2_without_touching_anything(argv, needle, bad_files, capsys):
    before = sorted(p.name for p in bad_files.iterdir())
    argv = [a.replace("{d}", str(bad_files)) for a in argv]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--no-progress"] + ([] if "--out" in argv else ["--out", str(bad_files / "run")]))
    assert e.value.code == 2
    err = error_line(capsys.readouterr().err)
    assert needle in err, err
    assert sorted(p.name for p in bad_files.iterdir()) == before  # nothing created


def test_unknown_flag_exits_2_in_a_subprocess(tmp_path):
    p = run_cli("--steps", "-1", "--out", str(tmp_path / "x"))
    assert p.returncode == 2 and "--steps" in error_line(p.stderr)
    assert not (tmp_path / "x").exists()


@pytest.mark.slow  # CLI runs and a subprocess
def test_resume_refuses_changed_shapes_and_corrupt_checkpoints(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    args = [*SMALL, "--data", corpus, "--out", str(out), "--steps", "2"]
    assert main(args) == 0
    capsys.readouterr()
    before = (out / "metrics.jsonl").read_text()
    assert main(args) == 0  # same --out and flags: the run continues; it is already done
    assert "already at step 2 of 2; nothing to do" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # same --out, other flags, no --resume: refused
        main([*args, "--lr", "0.01"])
    assert e.value.code == 2
    err = error_line(capsys.readouterr().err)
    assert "already holds a run made with a different config (optim.lr: 0.003 -> 0.01)" in err
    assert (out / "metrics.jsonl").read_text() == before
    with pytest.raises(SystemExit) as e:
        main([*args, "--resume", "--precision", "bf16", "--hidden-size", "32"])
    assert e.value.code == 2
    err = error_line(capsys.readouterr().err)
    assert "model.hidden_size: 64 -> 32" in err and "precision.mode: 'fp32' -> 'bf16'" in err
    # corrupt the committed step: delete the array data of the state item
    step_dir = out / "checkpoints" / "2"
    victims = [p for p in (step_dir / "state").rglob("*") if p.is_file() and "manifest" in p.name
               or p.is_file() and p.suffix == "" and "ocdbt" in str(p)]
    for p in victims or [p for p in (step_dir / "state").rglob("*") if p.is_file()]:
        p.write_bytes(b"garbage")
    # a subprocess: after a failed restore the CLI exits at once (os._exit), see run.py
    p = run_cli("--out", str(out), "--resume")
    assert p.returncode == 2
    err = error_line(p.stderr)
    assert "step 2" in err and str(out / "checkpoints") in err
    assert err.startswith("python -m jaxmem.train: error: checkpoint step 2")
    assert sorted(os.listdir(out / "checkpoints")) == ["2"]  # nothing saved over it
