"""What a user sees while training: plain log lines, eval perplexity, TensorBoard, W&B, the OOM
paragraph, restore failures that name older steps, data warnings, tokenizer handling."""

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxmem.train.cli import main

from runs import SMALL, losses  # noqa: E402
from testenv import subprocess_env

QUIET = [a for a in SMALL if a != "--no-progress"]  # capsys' stdout is not a terminal


def records(run):
    return [json.loads(l) for l in (Path(run) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # CLI runs
def test_plain_lines_when_stdout_is_not_a_terminal_and_eval_perplexity(tmp_path, corpus, capsys):
    out = tmp_path / "r"
    assert main([*QUIET, "--data", corpus, "--out", str(out), "--steps", "6", "--log-every", "2",
                 "--eval-every", "3", "--no-tensorboard"]) == 0
    printed = capsys.readouterr().out
    lines = [l for l in printed.splitlines() if l.startswith("step ")]
    # logged steps 2, 4, 6 and the eval at 3; no progress bar carriage returns
    assert [l.split()[1] for l in lines] == ["2/6", "3/6", "4/6", "6/6"], printed
    assert "\r" not in printed
    for part in ("loss ", "lr ", "grad norm ", "scale ", "tok/s", "ETA "):
        assert part in lines[-1]
    recs = {r["step"]: r for r in records(out)}
    for step in (3, 6):
        r = recs[step]
        np.testing.assert_allclose(r["eval_perplexity"], math.exp(r["eval_loss"]), rtol=1e-12)
        np.testing.assert_allclose(r["eval_bits_per_byte"], r["eval_loss"] / math.log(2), rtol=1e-12)
        by_step = {int(l.split()[1].split("/")[0]): l for l in lines}
        assert f"eval loss {r['eval_loss']:.4f} ppl {r['eval_perplexity']:.3g} bpb " in by_step[step]
    assert "perplexity" in printed.splitlines()[[l.startswith("done:") for l in
                                                 printed.splitlines()].index(True)]
    assert not (out / "tensorboard").exists()


@pytest.mark.slow  # CLI runs
def test_tensorboard_events_equal_metrics_jsonl(tmp_path, corpus):
    pytest.importorskip("tensorboardX")
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    out = tmp_path / "r"
    assert main([*SMALL, "--data", corpus, "--out", str(out), "--steps", "4",
                 "--eval-every", "2"]) == 0
    (events,) = (out / "tensorboard").iterdir()
    acc = ea.EventAccumulator(str(events.parent))
    acc.Reload()
    recs = records(out)
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                     ("eval_loss", "eval/loss"), ("eval_perplexity", "eval/perplexity")):
        want = [(r["step"], r[key]) for r in recs if key in r]
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in want], tag
        # TensorBoard stores float32 scalars
        np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-6)


@pytest.mark.slow  # CLI runs
def test_wandb_offline_files_are_written(tmp_path, corpus, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "r"
    assert main([*SMALL, "--data", corpus, "--out", str(out), "--steps", "2", "--no-tensorboard",
                 "--wandb-project", "jaxmem-test"]) == 0
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("run-*.wandb")), list(runs[0].iterdir())
    assert json.loads((out / "config.json").read_text())["config"]["run"]["wandb_project"] == \
        "jaxmem-test"


@pytest.mark.slow  # CLI runs
def test_out_of_memory_prints_one_paragraph_and_the_run_continues(tmp_path, corpus, capsys,
                                                                   monkeypatch):
    import jaxmem.train.loop as loop

    real = loop.jit_train_step

    def exhausted(step_cfg):
        step = real(step_cfg)
        calls = []

        def fail_on_third(state, batch):
            calls.append(1)
            if len(calls) == 3:  # as XLA says it (the message is then pages of allocator state)
                raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                                   "17179869184 bytes.\nBufferAssignment OOM Debugging ...")
            return step(state, batch)
        return fail_on_third

    args = [*SMALL, "--data", corpus, "--out", str(tmp_path / "r"), "--steps", "4",
            "--save-every", "2", "--no-tensorboard"]
    monkeypatch.setattr(loop, "jit_train_step", exhausted)
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.count("error: out of device memory (RESOURCE_EXHAUSTED") == 1, err
    # the tiny step's compiled peak is a few MiB; CPU does not report its memory size, a GPU does
    device = ("the backend does not report" if jax.default_backend() == "cpu"
              else "the device has ")
    assert "was compiled to need " in err and f" MiB; {device}" in err
    assert "BufferAssignment" not in err
    assert "python -m jaxmem.memory --preset tiny --num-layers 2" in err and "--fit" in err
    assert "Traceback" not in err
    monkeypatch.setattr(loop, "jit_train_step", real)
    assert main(args) == 0  # the same command continues from the step-2 checkpoint
    assert "resuming at step 2" in capsys.readouterr().out
    assert [s for s, *_ in losses(tmp_path / "r")] == [1, 2, 3, 4]


def _corrupt(step_dir: Path):
    for f in sorted(step_dir.rglob("*")):
        if f.is_file() and f.stat().st_size > 64 and "state" in f.parts and "manifest" in f.name:
            f.write_bytes(f.read_bytes()[:16])
            return
    big = max((f for f in step_dir.rglob("*") if f.is_file() and "state" in f.parts),
              key=lambda f: f.stat().st_size)
    big.write_bytes(big.read_bytes()[:16])


@pytest.mark.slow  # CLI runs
def test_failed_restore_names_older_steps_and_resume_step_uses_one(tmp_path, corpus, capsys):
    out = tmp_path / "r"
    base = [*SMALL, "--data", corpus, "--out", str(out), "--steps", "6", "--save-every", "2",
            "--no-tensorboard"]
    assert main([*base, "--stop-at", "4"]) == 0
    _corrupt(out / "checkpoints" / "4")
    cmd = [sys.executable, "-m", "jaxmem.train", "--out", str(out), "--resume"]
    # repeated failing restores: one line each time, never Orbax's stray thread tracebacks
    for _ in range(2):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=subprocess_env())
        assert p.returncode == 2, p.stderr
        # (the test corpus' b.txt is 6 bytes, one invalid: a "looks binary" warning comes first)
        lines = [l for l in p.stderr.strip().splitlines() if not l.startswith("warning: ")]
        assert len(lines) == 1 and lines[0].startswith("python -m jaxmem.train: error: "), p.stderr
        assert "checkpoint step 4" in lines[0]
        assert "older committed steps: 2 (restore one with --resume --resume-step 2)" in lines[0]
    from jaxmem.generate.cli import main as generate
    capsys.readouterr()
    assert generate(["--run", str(out), "--step", "2", "--prompt", "def f", "--max-new-tokens",
                     "4"]) == 0
    assert capsys.readouterr().out.startswith("def f")
    with pytest.raises(SystemExit):
        generate(["--run", str(out), "--step", "3"])
    assert "--step 3: no committed checkpoint step 3 in" in capsys.readouterr().err
    assert main(["--out", str(out), "--resume", "--resume-step", "2"]) == 0
    assert [s for s, *_ in losses(out)] == [1, 2, 3, 4, 5, 6]


def test_non_flag_errors_print_no_usage_block(tmp_path, corpus, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "none"), "--resume"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" not in err and err.count("\n") == 1, err


def _tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    words = sorted(set("the quick brown fox jumps over lazy dog".split()))
    vocab = {"[PAD]": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, **{w: 4 + i for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["[PAD]", "<s>", "</s>"])
    tok.save(str(tmp_path / "tok.json"))
    return tmp_path / "tok.json", len(vocab)


@pytest.mark.slow  # CLI runs
def test_vocab_size_comes_from_the_tokenizer_and_the_file_is_copied(tmp_path, capsys):
    tok, n = _tokenizer(tmp_path)
    (tmp_path / "d.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    out = tmp_path / "r"
    assert main([*SMALL, "--data", str(tmp_path / "d.txt"), "--tokenizer", str(tok),
                 "--out", str(out), "--steps", "2", "--no-tensorboard"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["config"]["model"]["vocab_size"] == n == cfg["resolved_model"]["vocab_size"]
    assert (out / "tokenizer.json").read_bytes() == tok.read_bytes()
    tok.unlink()  # generate uses the run directory's copy
    from jaxmem.train.rundir import load_run
    assert load_run(out).tokenizer.vocab_size == n
    with pytest.raises(SystemExit):
        main([*SMALL, "--data", str(tmp_path / "d.txt"), "--tokenizer",
              str(out / "tokenizer.json"), "--vocab-size", str(n - 1), "--out", str(tmp_path / "x")])
    assert "--vocab-size is 11" in capsys.readouterr().err


@pytest.mark.slow  # CLI runs
def test_data_warnings_binary_small_and_symlinks(tmp_path, capsys):
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_text("hello world\n" * 10)
    (d / "blob.txt").write_bytes(bytes(range(128, 256)) * 4 + b"some text")
    (d / "link.txt").symlink_to(d / "a.txt")
    assert main([*SMALL, "--data", str(d), "--out", str(tmp_path / "r"), "--steps", "2",
                 "--seq-len", "512", "--no-tensorboard"]) == 0
    err = capsys.readouterr().err
    assert f"warning: {d / 'blob.txt'} looks binary: " in err
    assert "less than one batch" in err and "(epochs)" in err
    assert "reached twice" in err and str(d / "link.txt") in err
    stats = json.loads((tmp_path / "r" / "config.json").read_text())["data_stats"]
    assert stats["duplicate_files_skipped"] == [str(d / "link.txt")] and stats["files"] == 2



@pytest.mark.slow  # CLI runs
def test_ten_failing_restores_in_one_process_leave_no_stray_tracebacks(tmp_path, corpus):
    out = tmp_path / "r"
    assert main([*SMALL, "--data", corpus, "--out", str(out), "--steps", "2", "--save-every", "1",
                 "--no-tensorboard"]) == 0
    manifest = out / "checkpoints" / "2" / "state" / "manifest.ocdbt"
    manifest.write_bytes(manifest.read_bytes()[:16])  # before the fix: 0-20 tracebacks a restore
    child = (
        "import sys\n"
        "from jaxmem.train.rundir import load_run\n"
        "from jaxmem.io.checkpoint import CheckpointError\n"
        "for i in range(10):\n"
        "    try:\n"
        "        load_run(sys.argv[1])\n"
        "    except CheckpointError as e:\n"
        "        print('failed', i, str(e).split('; older')[1])\n"
        "import gc, time; time.sleep(0.5); gc.collect()  # late callbacks, unretrieved futures\n")
    p = subprocess.run([sys.executable, "-c", child, str(out)], capture_output=True, text=True,
                       timeout=300, cwd=Path(__file__).parent.parent, env=subprocess_env())
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("failed") == 10, p.stdout
    assert " committed steps: 1 (restore one with --step 1)" in p.stdout, p.stdout
    assert "Traceback" not in p.stderr and "Error" not in p.stderr, p.stderr


def test_oom_message_names_estimate_device_and_fit_command(monkeypatch):
    from jaxmem.config.run import RunConfig
    from jaxmem.train.failures import is_oom, oom_message

    cfg = RunConfig().replace({"model.preset": "llama-3.2-1b", "precision.mode": "amp-bf16",
                               "data.batch_size": 8, "data.seq_len": 2048, "data.grad_accum": 2})
    err = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1 bytes.")
    assert is_oom(err) and not is_oom(RuntimeError("shapes do not match"))
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)  # the suite turns it off
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    msg = oom_message(cfg, "runs/x", err, peak=int(90.5 * 2**30), limit=60 * 2**30)
    assert "was compiled to need 90.50 GiB; the device has 60.00 GiB for XLA." in msg
    # the planner's GIB is the card (80 GiB gives XLA 60 by default), not XLA's share of it
    assert ("python -m jaxmem.memory --preset llama-3.2-1b --precision amp-bf16 --seq-len 2048 "
            "--global-batch 16 --fit 80") in msg
    assert msg.count("\n") == 2  # one paragraph, the command on its own line


@pytest.mark.slow  # CLI runs
def test_progress_bar_only_on_a_terminal_and_trackers_optional(tmp_path, corpus, monkeypatch):
    import io

    from jaxmem.train.trackers import plain_progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert plain_progress(False, Tty()) is False and plain_progress(True, Tty()) is True
    assert plain_progress(False, io.StringIO()) is True
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "wandb", None)
    out = tmp_path / "r"
    assert main([*SMALL, "--data", corpus, "--out", str(out), "--steps", "1",
                 "--wandb-project", "p"]) == 0  # trains; says W&B is not installed
    assert not (out / "tensorboard").exists() and not (out / "wandb").exists()


@pytest.mark.slow  # CLI runs
def test_tensorboard_after_a_crash_and_continue_has_each_step_once(tmp_path, corpus, monkeypatch):
    pytest.importorskip("tensorboardX")
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    import jaxmem.train.loop as loop

    real = loop.jit_train_step

    def crash_at_sixth_call(step_cfg):
        step, calls = real(step_cfg), []

        def run(state, batch):
            calls.append(1)
            if len(calls) == 6:  # step 4 is logged (after checkpoint 3), then the process dies
                raise RuntimeError("RESOURCE_EXHAUSTED: forced")
            return step(state, batch)
        return run

    # both runs within one second (tensorboardX names event files by the second: the second
    # run reopened and truncated the first one's file; seen in CI)
    import types

    import tensorboardX.event_file_writer as efw
    now = float(int(time.time()))  # this second: the writers' flush deadlines stay near now
    monkeypatch.setattr(efw, "time", types.SimpleNamespace(time=lambda: now))
    out = tmp_path / "r"
    args = [*SMALL, "--data", corpus, "--out", str(out), "--steps", "6", "--save-every", "3"]
    monkeypatch.setattr(loop, "jit_train_step", crash_at_sixth_call)
    assert main(args) == 1
    monkeypatch.setattr(loop, "jit_train_step", real)
    assert main(args) == 0  # continues from step 3 and redoes 4, 5, 6
    acc = ea.EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    want = [(r["step"], r["loss"]) for r in records(out)]
    assert [s for s, _ in got] == [1, 2, 3, 4, 5, 6] == [s for s, _ in want]
    np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-6)
