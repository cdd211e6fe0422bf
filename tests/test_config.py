"""RunConfig: one source of truth for flags, config.json and the step config."""

import argparse
import json

import pytest

from jaxmem.config.flags import add_run_flags, given_overrides
from jaxmem.errors import ConfigError
from jaxmem.config.run import SCHEMA_VERSION, RunConfig, all_paths, flag_names
from jaxmem.train.rundir import RunError, read_run_config, write_run_config
from jaxmem.train.cli import build_parser

# What config.json held before RunConfig (schema 1: the train CLI's flags, flat), as written by
# the previous version of jaxmem.train for `--steps 6 --lr 0.002 --precision amp-bf16 ...`.
SCHEMA_1 = {
    "preset": "tiny", "num_layers": 2, "hidden_size": 64, "intermediate_size": 128,
    "num_heads": None, "num_kv_heads": None, "head_dim": None, "vocab_size": None,
    "precision": "amp-bf16", "remat": "full", "mu_dtype": "bf16", "loss_scale": None,
    "loss_scale_init": 65536.0, "loss_scale_growth_interval": 2000, "max_consecutive_skips": 100,
    "batch_size": 4, "seq_len": 32, "grad_accum": 2, "steps": 6, "lr": 0.002, "min_lr": 0.0003,
    "warmup_steps": 30, "weight_decay": 0.1, "clip": 1.0, "data": "corpus", "tokenizer": None,
    "out": "runs/old", "resume": False, "stop_at": None, "save_every": 100, "keep": 3,
    "eval_every": 100, "eval_batches": 2, "log_every": 1, "seed": 3, "sample_tokens": 0,
    "no_progress": True,
    "model": {"vocab_size": 259, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
              "num_heads": 4, "num_kv_heads": 2, "head_dim": None, "max_position_embeddings": 512,
              "rope_theta": 10000.0, "rms_norm_eps": 1e-05, "tie_embeddings": False},
    "data_stats": {"files": 2}, "data_sha256": "abc",
}


def parse(argv):
    return given_overrides(build_parser().parse_args(argv))


def test_config_json_round_trip(tmp_path):
    cfg = RunConfig().replace(parse(["--preset", "small", "--num-layers", "3", "--precision", "fp8",
                                     "--remat", "names:query,key", "--lr", "0.01", "--steps", "7",
                                     "--mu-dtype", "bf16", "--data", "x.txt", "--stop-at", "5",
                                     "--no-progress", "--temperature", "0"]))
    write_run_config(tmp_path, cfg, data_stats={"files": 1}, changes=[])
    back, record = read_run_config(tmp_path)
    assert back == cfg
    assert record["schema_version"] == SCHEMA_VERSION and record["data_stats"] == {"files": 1}
    assert record["resolved_model"]["num_layers"] == 3 and record["resolved_model"]["hidden_size"] == 512
    assert RunConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_schema_1_config_json_loads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SCHEMA_1))
    cfg, record = read_run_config(tmp_path)
    assert (cfg.precision.mode, cfg.remat.policy, cfg.optim.mu_dtype) == ("amp-bf16", "full", "bf16")
    assert (cfg.optim.total_steps, cfg.optim.lr, cfg.data.grad_accum, cfg.data.seed) == (6, 0.002, 2, 3)
    assert (cfg.model.num_layers, cfg.run.eval_batches, cfg.sample.max_new_tokens) == (2, 2, 0)
    assert cfg.model_config().hidden_size == 64 and record["resolved_model"]["num_heads"] == 4


@pytest.mark.parametrize("old, placement", [(True, "sandwich"), (False, "pre")])
def test_config_json_with_sandwich_norms_loads_and_resumes(tmp_path, old, placement):
    """A run written when ModelConfig had `sandwich_norms` (a bool; the model section's null:
    the preset's) reads as its norm_placement, and a resume sees no change in the model."""
    from jaxmem.train.cli import _fixed_differences

    cfg = RunConfig().replace({"model.norm_placement": placement})
    write_run_config(tmp_path, cfg)
    record = json.loads((tmp_path / "config.json").read_text())
    for model in (record["config"]["model"], record["resolved_model"]):
        del model["norm_placement"]
        model["sandwich_norms"] = old
    (tmp_path / "config.json").write_text(json.dumps(record))
    saved, record = read_run_config(tmp_path)
    assert saved == cfg and saved.model_config().norm_placement == placement
    assert record["resolved_model"]["norm_placement"] == placement
    assert "sandwich_norms" not in record["resolved_model"]
    assert _fixed_differences(saved, record, cfg) == []
    record["config"]["model"]["sandwich_norms"] = None  # the preset's ("pre" for tiny)
    assert RunConfig.from_dict({"schema_version": 2, **record["config"]}) == RunConfig()


def test_newer_or_malformed_config_json_is_refused_naming_the_problem(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"schema_version": 3, "config": {}}))
    with pytest.raises(RunError, match="schema_version 3 is not supported"):
        read_run_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"schema_version": 2, "config": {
        "optim": {"lr": 0.1, "momentum": 0.9}}}))
    with pytest.raises(RunError, match="unknown run config field 'optim.momentum'"):
        read_run_config(tmp_path)
    with pytest.raises(ConfigError, match="optimizer lr=-1.0 is invalid"):
        RunConfig().replace({"optim.lr": -1.0})


def test_flags_are_generated_from_the_config_and_help_explains_each():
    text = build_parser().format_help()
    for group in ("model:", "memory and precision:", "optimization:", "data and batch:",
                  "run directory:", "sampling:"):
        assert text.count("\n" + group) == 1, group  # one group per title, --resume included
    parser = build_parser()
    options = {s for a in parser._actions for s in a.option_strings}
    helps = {s: a.help for a in parser._actions for s in a.option_strings}
    for path in all_paths():
        for flag in flag_names(path):
            if flag in options:
                assert helps[flag] and len(helps[flag]) > 10, flag
    # every configurable field that is a flag is reachable, and flags set exactly one field
    assert parse(["--steps", "9"]) == {"optim.total_steps": 9}
    assert parse([]) == {}
    assert "(default: 0.003)" in helps["--lr"] and "(default: 128)" in helps["--seq-len"]


def test_subset_of_sections_for_other_programs():
    p = argparse.ArgumentParser()
    add_run_flags(p, ["data"], only={"data": ("batch_size", "seq_len")})
    assert given_overrides(p.parse_args(["--seq-len", "64"])) == {"data.seq_len": 64}
    with pytest.raises(SystemExit):
        p.parse_args(["--seed", "1"])  # not part of this program's flags


def test_memory_planner_and_train_share_flags_and_defaults():
    from jaxmem.memory import cli as memory_cli
    train, memory = build_parser(), memory_cli.build_parser()
    helps = [{s: a.help for a in p._actions for s in a.option_strings} for p in (train, memory)]
    shared = set(helps[0]) & set(helps[1]) - {"-h", "--help"}
    assert {"--preset", "--num-layers", "--precision", "--remat", "--mu-dtype", "--batch-size",
            "--seq-len", "--grad-accum"} <= shared
    assert set(helps[0]) <= set(helps[1])  # the planner takes every flag of jaxmem.train
    ignored = {s for g in memory._action_groups if g.title == memory_cli.layered.IGNORED_TITLE
               for a in g._group_actions for s in a.option_strings}
    assert {"--lr", "--clip", "--steps", "--out", "--resume", "--coordinator"} <= ignored
    assert not ignored & {"--preset", "--batch-size", "--lora-rank", "--init-from", "--tokenizer"}
    for flag in shared - {"--target"}:  # --target: each program says what it does with it
        if flag in ignored:  # one line each in the planner's --help, under the group's title
            assert helps[1][flag] is None, flag
        else:
            assert helps[0][flag] == helps[1][flag], flag  # same text, same default shown
    spec, global_batch, max_micro = memory_cli._resolve(memory, memory.parse_args([]))
    cfg = RunConfig()
    assert (spec.batch_size, spec.seq_len, global_batch, max_micro) == (
        cfg.data.batch_size, cfg.data.seq_len, cfg.data.batch_size, None) == (16, 128, 16, None)
    # the spec's step config is the one a training run builds from the same RunConfig
    from jaxmem.train.run import build_step_config
    assert spec.step == build_step_config(cfg)[1]
