"""The train loop's tokens/s counts each step up to its result on the device and never an
evaluation or a save (issue 50: a step still running when an eval began finished inside it, so
a run evaluating every step printed the dispatch rate: 202,193 tok/s for a real 121).

The reference is measured from outside the loop: `_Run.evaluate` and `_Saves.save` are wrapped
so that each first waits for the train state (the step's result) and then takes the time, and
each eval also sleeps, so a loop that counted eval time would be far slow. The steps' wall time
is then the loop's time from the end of the last untimed step to the last step's result, less
the evals and saves in between.
"""

import json
import re
import time

import jax

from jaxmem.train import loop
from jaxmem.train.cli import main

from runs import SMALL  # noqa: E402

STEPS, B, T = 8, 8, 64
UNTIMED = 2  # Records: a process's first two steps (compilation) are not timed
EVAL_SLEEP_S = 0.15


def test_tokens_per_sec_is_step_time_only(tmp_path, corpus, monkeypatch, capsys):
    spans = {}  # step -> (start, end) of the evaluation and save after it
    saved = []
    evaluate, save = loop._Run.evaluate, loop._Saves.save

    def paused(step, fn, state):
        jax.block_until_ready(state)  # the step has finished: its time ends here
        t0 = time.perf_counter()
        out = fn()
        spans[step] = (spans.get(step, (t0,))[0], time.perf_counter())
        return out

    def slow_evaluate(self):
        return paused(int(self.state.step), lambda: time.sleep(EVAL_SLEEP_S) or evaluate(self),
                      self.state)

    monkeypatch.setattr(loop._Run, "evaluate", slow_evaluate)
    monkeypatch.setattr(loop._Saves, "save", lambda self, state, step: paused(
        step, lambda: saved.append(step) or save(self, state, step), state))
    out = tmp_path / "run"
    assert main([*SMALL, "--data", corpus, "--out", str(out), "--steps", str(STEPS),
                 "--batch-size", str(B), "--seq-len", str(T), "--eval-every", "1",
                 "--save-every", "3", "--no-tensorboard"]) == 0
    printed = capsys.readouterr().out
    assert sorted(spans) == list(range(1, STEPS + 1))  # an eval after every step
    assert saved == [3, 6, STEPS]  # --save-every 3, and the end's save after the loop
    # the timed steps: from the last untimed step's result to the last step's, less the pauses
    wall = spans[STEPS][0] - spans[UNTIMED][0]
    pauses = sum(spans[s][1] - spans[s][0] for s in range(UNTIMED, STEPS))
    want = (STEPS - UNTIMED) * B * T / (wall - pauses)
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == STEPS
    assert abs(last["tokens_per_sec"] / want - 1) < 0.10, (last["tokens_per_sec"], want)
    done = re.search(r"done: step 8, .*, ([\d,]+) tokens/s", printed)
    assert done and int(done.group(1).replace(",", "")) == round(last["tokens_per_sec"])
