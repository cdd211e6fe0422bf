"""`jaxmem.train` refuses, before its first step, a train step compiled bigger than the device.

The CPU reports no device size, so the check is off there; these tests give the trainer a size
(`failures.device_bytes` monkeypatched) and check the refusal (exit 2, the numbers, a planner
command the memory CLI accepts, nothing written), the way past it (`--no-memory-check`), and that
the check's compile is the run's own (the step is compiled once).
"""

import logging
import os
import shlex

import jax
import pytest

from jaxmem.config.flags import given_overrides
from jaxmem.config.run import RunConfig
from jaxmem.train import failures
from jaxmem.train.cli import main

from runs import SMALL, losses  # noqa: E402

MiB = 2**20


def _planner_args(command: str):
    """The memory CLI's parse of a printed `python -m jaxmem.memory ...` command."""
    from jaxmem.memory.cli import build_parser

    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "jaxmem.memory"], command
    return build_parser().parse_args(argv[3:])  # exits 2 on a flag it does not take


def _command_in(text: str) -> str:
    (line,) = [l.strip() for l in text.splitlines() if l.strip().startswith("python -m jaxmem.memory")]
    return line


@pytest.mark.parametrize("overrides, devices, mode", [
    ({"model.preset": "llama-3.2-1b", "precision.mode": "amp-bf16", "data.batch_size": 8,
      "data.seq_len": 2048, "data.grad_accum": 2, "remat.policy": "full"}, 1, "fit"),
    ({"model.preset": "llama-3.1-8b", "model.max_position_embeddings": 262144,
      "precision.mode": "amp-bf16", "data.batch_size": 1, "data.seq_len": 262144,
      "remat.policy": "full", "peft.lora_rank": 16, "peft.quantize_base": "nf4",
      "peft.double_quant": True}, 1, "fit_seq"),
    ({"model.preset": "tiny", "model.max_position_embeddings": 65536, "data.batch_size": 1,
      "data.seq_len": 65536,
      "parallel.mesh": "context=4", "optim.mu_dtype": "bf16"}, 4, "fit_seq"),
    ({"model.preset": "small", "data.batch_size": 4, "data.seq_len": 1024,
      "parallel.mesh": "fsdp=2", "optim.optimizer": "adamw8bit"}, 2, "fit"),
])
def test_fit_command_is_one_the_memory_cli_takes(overrides, devices, mode):
    from jaxmem.memory.cli import _resolve, build_parser

    cfg = RunConfig().replace(overrides)
    command = failures.fit_command(cfg, 79.5, devices)
    args = _planner_args(command)
    assert getattr(args, mode) == 79.5 and getattr(args, "fit" if mode == "fit_seq" else "fit_seq") is None
    planned = RunConfig().replace(given_overrides(args))
    searched = {"data.batch_size", "data.grad_accum", "remat.policy", "optim.mu_dtype",
                "parallel.mesh"} if mode == "fit" else set()
    for path, value in overrides.items():  # the run's own fields, but what the planner searches
        assert planned.get(path) == (RunConfig().get(path) if path in searched else value), path
    if mode == "fit":
        assert args.global_batch == cfg.data.batch_size * cfg.data.grad_accum
    assert args.devices == (devices if devices > 1 else None)
    _resolve(build_parser(), args)  # the planner's own validation (exits 2 on a bad combination)


def test_budget_is_the_card_whose_usable_share_is_the_limit(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    # an 80 GiB card gives XLA 60 GiB by default: the planner is told 80, not 60
    assert failures.budget_gib(60 * 2**30) == 80.0
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".95")
    assert failures.budget_gib(int(.95 * 80 * 2**30)) == 80.0


def test_too_big_message_names_the_numbers_and_fits_returns_none():
    cfg = RunConfig().replace({"data.batch_size": 1, "data.seq_len": 65536})
    assert failures.too_big_message(cfg, 100 * MiB, 100 * MiB) is None
    msg = failures.too_big_message(cfg, 3 * 2**30, 60 * 2**30 // 100)
    assert "compiled to need 3.00 GiB per device; the device has 0.60 GiB for XLA" in msg
    assert "--fit-seq 1.1" in msg  # 0.6 GiB usable: 0.5 GiB CUDA context more and "--no-memory-check" in msg and msg.count("\n") == 2


def _snapshot(root):
    return sorted((os.path.relpath(os.path.join(d, f), root), os.stat(os.path.join(d, f)).st_mtime_ns)
                  for d, _, fs in os.walk(root) for f in fs)


@pytest.mark.slow  # four short CLI runs
def test_train_refuses_up_front_then_resumes_and_can_be_told_to_try(tmp_path, corpus, capsys,
                                                                   monkeypatch, caplog):
    args = [*SMALL, "--data", corpus, "--steps", "3"]
    fresh = tmp_path / "fresh"
    monkeypatch.setattr(failures, "device_bytes", lambda: 200_000)  # far less than the step
    assert main([*args, "--out", str(fresh)]) == 2
    err = capsys.readouterr().err
    assert "error: the train step does not fit this device" in err and "Traceback" not in err
    assert "the device has 0.2 MiB for XLA" in err and "was compiled to need " in err
    planned = _planner_args(_command_in(err))
    assert planned.fit == 0.5 and planned.global_batch == 4
    assert given_overrides(planned)["data.seq_len"] == 32 and given_overrides(planned)["model.num_layers"] == 2
    assert not fresh.exists()  # nothing written: the same --out is free

    run = fresh  # --no-memory-check: the user knows better (the CPU has room)
    assert main([*args, "--out", str(run), "--stop-at", "1", "--no-memory-check"]) == 0
    before = _snapshot(run)
    assert main([*args, "--out", str(run), "--resume"]) == 2  # still refused without the flag
    assert "does not fit" in capsys.readouterr().err
    assert _snapshot(run) == before  # config.json, metrics and the checkpoint untouched

    monkeypatch.setattr(failures, "device_bytes", lambda: 2**40)  # fits: the step compiles once
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        assert main([*args, "--out", str(run), "--resume"]) == 0
    compiles = [r.getMessage() for r in caplog.records
                if r.getMessage().startswith("Finished XLA compilation of jit(train_step)")]
    assert len(compiles) == 1, compiles
    assert [r[0] for r in losses(run)] == [1, 2, 3]
