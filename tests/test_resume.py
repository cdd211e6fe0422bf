"""Continuing runs: saves at stop points, runs that died before a checkpoint, what a resume may
change, the device state as the source of truth, the tokenizer's pad id."""

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest

import jaxmem.train.loop as loop
from jaxmem.data import ByteTokenizer
from jaxmem.train.cli import main
from runs import SMALL, error_line, losses

STEPS = ["--steps", "6", "--eval-every", "3"]


def ckpts(out):
    return sorted(int(s) for s in os.listdir(Path(out) / "checkpoints"))


@pytest.mark.slow  # CLI runs
def test_stop_at_on_a_save_step_saves_once(tmp_path, corpus, capsys):
    out = str(tmp_path / "run")
    args = [*SMALL, *STEPS, "--data", corpus, "--out", out, "--save-every", "2"]
    assert main([*args, "--stop-at", "4"]) == 0  # was: CheckpointError 'step 4 already exists'
    assert "--stop-at 4: saved step 4" in capsys.readouterr().out
    assert ckpts(out) == [2, 4]
    assert main(["--out", out, "--resume", "--stop-at", "4"]) == 0  # already there: exit 0
    assert "already at step 4 of 6 (--stop-at 4); nothing to do" in capsys.readouterr().out
    assert ckpts(out) == [2, 4]
    assert main(["--out", out, "--resume"]) == 0  # --stop-at is not inherited
    assert ckpts(out) == [2, 4, 6]
    straight = str(tmp_path / "straight")
    assert main([*args[:-2], "--out", straight]) == 0
    assert losses(out) == losses(straight)


@pytest.mark.slow  # CLI runs
def test_signal_landing_on_a_save_step_saves_once(tmp_path, corpus, monkeypatch, capsys):
    original = loop.Checkpointer.save

    def save_then_signal(self, step, *a, **k):
        original(self, step, *a, **k)
        if step == 2:  # SIGTERM arrives while step 2, a save step, is being saved
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(loop.Checkpointer, "save", save_then_signal)
    out = str(tmp_path / "run")
    assert main([*SMALL, *STEPS, "--data", corpus, "--out", out, "--save-every", "2"]) == 0
    assert "SIGTERM: saved step 2" in capsys.readouterr().out
    assert ckpts(out) == [2]


@pytest.mark.slow  # CLI runs
def test_run_that_died_before_its_first_checkpoint_restarts_with_the_same_command(
        tmp_path, corpus, monkeypatch, capsys):
    out = str(tmp_path / "run")
    args = [*SMALL, *STEPS, "--data", corpus, "--out", out]

    def out_of_memory(cfg):
        def step(state, batch):
            raise MemoryError("RESOURCE_EXHAUSTED: out of memory at the first step")
        return step

    with monkeypatch.context() as m:
        m.setattr(loop, "jit_train_step", out_of_memory)
        assert main(args) == 1  # one paragraph of help (tests/test_trackers.py), exit 1
    assert (Path(out) / "config.json").exists() and not ckpts(out)
    assert main(args) == 0  # the same command line: starts at step 0 in the same directory
    assert "no committed checkpoint, starting at step 0" in capsys.readouterr().out
    straight = str(tmp_path / "straight")
    assert main([*args[:-1], straight]) == 0
    assert losses(out) == losses(straight)


@pytest.mark.slow  # CLI runs
def test_resume_alone_uses_the_saved_config_and_refuses_schedule_changes(tmp_path, corpus, capsys):
    out = str(tmp_path / "run")
    args = [*SMALL, *STEPS, "--data", corpus, "--lr", "0.002"]
    assert main([*args, "--out", out, "--stop-at", "2"]) == 0
    for flag, value, needle in [("--steps", "80", "optim.total_steps: 6 -> 80"),
                                ("--lr", "0.01", "optim.lr: 0.002 -> 0.01"),
                                ("--warmup-steps", "1", "optim.warmup_steps: 30 -> 1"),
                                ("--min-lr", "0", "optim.min_lr: 0.0003 -> 0.0"),
                                ("--seed", "1", "data.seed: 0 -> 1"),
                                ("--batch-size", "2", "data.batch_size: 4 -> 2")]:
        with pytest.raises(SystemExit) as e:
            main(["--out", out, "--resume", flag, value])
        assert e.value.code == 2
        err = error_line(capsys.readouterr().err)
        assert needle in err and "cannot change on resume" in err, err
    # Nothing but --out and --resume: every other flag comes from config.json; a mutable flag
    # given with it is recorded with the step it took effect.
    assert main(["--out", out, "--resume", "--log-every", "2"]) == 0
    record = json.loads((Path(out) / "config.json").read_text())
    assert record["config"]["optim"]["lr"] == 0.002 and record["config"]["run"]["log_every"] == 2
    assert {"step": 2, "field": "run.log_every", "from": 1, "to": 2} in record["changes"]
    assert [r["step"] for r in map(json.loads, open(Path(out) / "metrics.jsonl"))] == [1, 2, 3, 4, 6]
    straight = str(tmp_path / "straight")
    assert main([*args, "--out", straight]) == 0
    steps_logged_by_both = {s for s, *_ in losses(out)}
    assert [x for x in losses(straight) if x[0] in steps_logged_by_both] == losses(out)


@pytest.mark.slow  # CLI runs
def test_skip_count_survives_resume(tmp_path, corpus, capsys):
    """The limit on non-finite steps in a row counts from the device state, across a resume."""
    out = str(tmp_path / "run")
    args = [*SMALL, "--steps", "20", "--data", corpus, "--out", out, "--precision", "amp-fp16",
            "--loss-scale", "static:1e30", "--max-consecutive-skips", "3"]
    assert main([*args, "--stop-at", "2"]) == 0  # two skipped steps, saved
    capsys.readouterr()
    assert main(["--out", out, "--resume"]) == 1
    err = capsys.readouterr().err
    # 2 before the resume + 2 after it exceed 3 (a host counter reset at resume reached step 6+)
    assert int(err.split("error: ")[1].split()[0]) in (4, 5), err
    assert max(s for s, *_ in losses(out)) in (4, 5)


@pytest.mark.slow  # CLI runs
def test_batches_pad_with_the_tokenizers_own_pad_id(tmp_path, corpus, monkeypatch):
    class Tok(ByteTokenizer):
        pad_id = 0  # not the byte tokenizer's 256

    seen = []
    real_batcher, real_evals = loop.train_batcher, loop.EvalBatches
    monkeypatch.setattr("jaxmem.train.cli.section_tokenizer", lambda section, path: Tok())
    monkeypatch.setattr(loop, "train_batcher", lambda *a, pad_id, **k: seen.append(
        ("train", pad_id)) or real_batcher(*a, pad_id=pad_id, **k))
    # EvalBatches(split, batch_size, seq_len, pad_id, max_batches): jaxmem.train.evaluate
    monkeypatch.setattr(loop, "EvalBatches", lambda *a: seen.append(("eval", a[3]))
                        or real_evals(*a))
    assert main([*SMALL, "--steps", "1", "--data", corpus, "--out", str(tmp_path / "r")]) == 0
    assert seen == [("train", 0), ("eval", 0)]
    batch = real_evals(np.arange(1, 11, dtype=np.int32), 2, 8, Tok.pad_id)[0]
    # row 1 is window 1: tokens 9, 10, then padding with id 0 (masked out of the loss)
    np.testing.assert_array_equal(batch["inputs"][1], [9, 10, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch["mask"][1], [1, 0, 0, 0, 0, 0, 0, 0])


@pytest.mark.slow  # 3.5 s cold on 2 cores (default run kept under 5 min)
def test_saves_are_asynchronous_and_their_pause_is_logged(tmp_path, corpus, capsys):
    """Each save step's record has the seconds the loop was held (`save_pause_s`); the run ends
    only after its last write committed (every save step is on disk when main returns)."""
    out = str(tmp_path / "run")
    assert main([*SMALL, *STEPS, "--data", corpus, "--out", out, "--save-every", "2"]) == 0
    assert ckpts(out) == [2, 4, 6]
    assert not [d for d in os.listdir(Path(out) / "checkpoints") if "tmp" in d]
    recs = [json.loads(l) for l in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    pauses = {r["step"]: r["save_pause_s"] for r in recs if "save_pause_s" in r}
    assert sorted(pauses) == [2, 4]  # the last step's save follows its record: in the summary
    assert all(0 <= p < 60 for p in pauses.values())
    summary = [l for l in capsys.readouterr().out.splitlines() if l.startswith("checkpoints: ")]
    assert len(summary) == 1 and summary[0].startswith("checkpoints: 3 saved; the loop paused ")
