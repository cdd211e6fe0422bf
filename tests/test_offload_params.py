"""--offload-params host (issue 39, part 2): the trained params' stacked layer leaves live in
pinned host memory between steps, alone or with --offload-optimizer host, and the in-backward
step fetches each layer to the device. On a CPU host and device memory are the same RAM, so what
is tested is the numbers (bitwise the device-resident run: train step, eval, sample), where the
state says it lives, resume, and the refusals."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxmem.families import get_preset
from jaxmem.model.precision import get_precision
from jaxmem.model.remat import RematPolicy
from jaxmem.train.cli import main
from jaxmem.train.loss import synthetic_batch
from jaxmem.train.optim import OptimConfig
from jaxmem.train.placement import Placement
from jaxmem.train.run import make_eval_fn
from jaxmem.train.step import StepConfig

from runs import SMALL, error_line, losses
from testenv import ROOT, subprocess_env

OIB = ["--optimizer-in-backward", "--remat", "full", "--clip", "0"]
PLACEMENTS = {"device": Placement.single(), "params": Placement.single(offload_params="host"),
              "params+optimizer": Placement.single("host", "host")}


def _bits(x):
    return np.asarray(x).reshape(-1).view(np.uint8)


def _kinds(tree):
    return {jax.tree_util.keystr(p): x.sharding.memory_kind
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _on_host(tree):
    return {k for k, v in _kinds(tree).items() if v == "pinned_host"}


def _layers(tree):
    return {k for k in _kinds(tree) if "['layers']" in k}


def _arrays(tree):
    """--offload-optimizer host's leaves: every array of the optimizer state (not its counters)."""
    return {jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(tree)
            if x.ndim}


# the README's command and CI run adamw (25 s on 2 cores); adamw8bit's 10 steps (37 s) are
# nightly: its host-params path (bf16-sr, adamw8bit, in-backward) runs bitwise against the device
# run in CI's test_resume_is_bitwise_the_device_run below
@pytest.mark.parametrize("optimizer", [pytest.param("adamw8bit", marks=pytest.mark.nightly),
                                       "adamw"])
def test_host_params_are_bitwise_the_device_run_for_10_steps(optimizer):
    cfg = StepConfig(get_preset("tiny"), get_precision("bf16-sr"), RematPolicy("full"),
                     OptimConfig(optimizer=optimizer, clip=0.0, lr=1e-2, warmup_steps=2,
                                 total_steps=20, in_backward=True))
    batches = [jax.tree.map(lambda x: x[None], synthetic_batch(jax.random.PRNGKey(k), 2, 16, 259))
               for k in range(10)]
    runs = {}
    for name, par in PLACEMENTS.items():
        s = par.init_state(cfg, None, 1)
        step = par.train_step(cfg, s)
        ls = []
        for batch in batches:
            before = s
            s, m = step(s, batch)
            assert all(x.is_deleted() for x in jax.tree.leaves(before))  # donated
            ls.append(float(m["loss"]))
            if name != "device":  # the layers stay on the host, step after step
                assert _on_host(s.params) == _layers(s.params) != set()
            assert _on_host(s.opt_state) == (_arrays(s.opt_state) if "optimizer" in name
                                             else set())
        runs[name] = ls, s
    ref, ref_state = runs.pop("device")
    assert ref[-1] != ref[0]
    for ls, s in runs.values():
        assert ls == ref
        for a, b in zip(jax.tree.leaves(ref_state), jax.tree.leaves(s)):
            np.testing.assert_array_equal(_bits(a), _bits(b))
    # eval and sampling take the host params as they are (the Decoder fetches each layer)
    device, host = ref_state.params, runs["params"][1].params
    eval_fn = make_eval_fn(cfg)
    assert _on_host(host) and jax.tree.map(float, eval_fn(host, {k: v[0] for k, v in
                                                                batches[0].items()})) == \
        jax.tree.map(float, eval_fn(device, {k: v[0] for k, v in batches[0].items()}))
    from jaxmem.decode.sampling import generate_ids
    sample = lambda p: generate_ids(cfg.model, p, [[1, 2, 3]], 6, top_k=40)  # noqa: E731
    assert sample(host) == sample(device)


def test_without_optimizer_in_backward_exits_2_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([*SMALL, "--out", str(tmp_path / "run"), "--offload-params", "host"])
    assert e.value.code == 2
    assert "--offload-params host needs --optimizer-in-backward" in \
        error_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag", ["--offload-params", "--offload-optimizer"])
def test_on_a_mesh_exits_2_with_one_line(tmp_path, corpus, flag):
    """Two simulated CPU devices and --mesh fsdp=2: refused before anything is written."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxmem.train", *SMALL, "--data", corpus, "--out", str(out),
         "--mesh", "fsdp=2", *OIB, flag, "host"], cwd=ROOT, env=subprocess_env(cpu_devices=2),
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = error_line(proc.stderr)
    assert "--optimizer-in-backward runs on one device" in line and "fsdp" in line
    assert not out.exists()


@pytest.mark.slow  # three CLI runs
def test_resume_is_bitwise_the_device_run(tmp_path, corpus, monkeypatch):
    from jaxmem.train import loop
    from jaxmem.train.rundir import load_run
    args = [*SMALL, "--data", corpus, "--steps", "6", "--precision", "bf16-sr",
            "--optimizer", "adamw8bit", "--eval-every", "2", *OIB]
    host = [*args, "--offload-params", "host"]
    assert main([*args, "--out", str(tmp_path / "device")]) == 0
    where, evaluate = [], loop._Run.evaluate  # where the loop's params are at each eval

    def spy(run):
        where.append(_on_host(run.state.params) == _layers(run.state.params))
        return evaluate(run)
    monkeypatch.setattr(loop._Run, "evaluate", spy)
    assert main([*host, "--out", str(tmp_path / "split"), "--stop-at", "3"]) == 0
    # resumed with the optimizer state on the host too (the flags change no number), and a sample
    assert main([*host, "--offload-optimizer", "host", "--out", str(tmp_path / "split"),
                 "--resume", "--sample-tokens", "4"]) == 0
    assert where == [True] * 3  # steps 2, 4 and 6: fresh and restored, on the host
    record = json.loads((tmp_path / "split" / "config.json").read_text())
    assert record["config"]["optim"]["offload_params"] == "host"
    device, split = losses(tmp_path / "device"), losses(tmp_path / "split")
    assert device == split and len(device) == 6
    evals = lambda run: [(r["step"], r.get("eval_loss")) for r in map(  # noqa: E731
        json.loads, (run / "metrics.jsonl").read_text().splitlines())]
    assert evals(tmp_path / "device") == evals(tmp_path / "split")
    a, b = load_run(tmp_path / "device").state, load_run(tmp_path / "split").state
    assert int(a.step) == int(b.step) == 6
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(_bits(x), _bits(y))


def test_given_params_go_straight_to_the_host():
    """--init-from's params: placed with the host shardings and donated to the state creation,
    bitwise the device-resident state."""
    cfg = StepConfig(get_preset("tiny"), get_precision("bf16-sr"), RematPolicy("full"),
                     OptimConfig(optimizer="adamw8bit", clip=0.0, in_backward=True))
    ref = Placement.single().init_state(cfg, None, 1)
    given = jax.tree.map(np.asarray, ref.params)
    s = PLACEMENTS["params"].init_state(cfg, None, 1, params=given)
    assert _on_host(s.params) == _layers(s.params) != set() and not _on_host(s.opt_state)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(s)):
        np.testing.assert_array_equal(_bits(a), _bits(b))
