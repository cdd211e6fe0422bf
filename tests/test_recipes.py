"""The shipped recipes (jaxmem.recipes): each file is a YAML mapping of RunConfig sections plus
`card` and `description`, builds a RunConfig and the planner's StepSpec, and its analytic plan
fits its card; `python -m jaxmem.recipes` lists one line per recipe, `show` prints the file, an
unknown name exits 2 with one line. The compiled plan per card: tests/test_gpu_target_recipes.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from jaxmem import recipes, target
from jaxmem.config.run import RunConfig
from jaxmem.errors import ConfigError
from jaxmem.memory.spec import StepSpec
from jaxmem.recipes.cli import main
from jaxmem.recipes.plan import plan

from testenv import subprocess_env
from tiers import RECIPES_IN_CI, nightly_except

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ["gemma-3-12b-qlora-24gb", "llama-3.1-70b-qlora-2x24gb-fsdp",
           "llama-3.1-8b-full-24gb-host", "llama-3.1-8b-full-80gb", "qwen3-8b-dpo-qlora-24gb",
           "qwen3-8b-qlora-12gb", "qwen3-8b-qlora-24gb", "qwen3-8b-qlora-long-80gb",
           "tiny-pretrain-cpu"]


def test_the_named_recipes_are_shipped():
    assert recipes.names() == SHIPPED  # the README names them: a rename is a README change


@pytest.mark.parametrize("name", SHIPPED)
def test_recipe_is_run_config_sections_plus_card_and_description(name):
    d = yaml.safe_load(recipes.recipe_path(name).read_text())
    assert d["card"] in target.CARDS
    assert isinstance(d["description"], str) and "\n" not in d["description"]
    sections = {k: v for k, v in d.items() if k not in recipes.METADATA}
    assert set(sections) <= set(RunConfig.sections())
    # the user gives the weights and the data (the pretraining quick start: built-in ones)
    assert "init_from" not in sections.get("init", {}) and "data" not in sections.get("data", {})
    # the model section names the planned shape only: --init-from's checkpoint replaces it whole
    assert set(sections.get("model", {})) <= {"preset"}
    cfg = RunConfig.from_dict({"schema_version": 2, **sections})
    assert cfg == recipes.run_config(name)
    for section, fields in sections.items():  # every value listed is the one the config holds
        for field, value in fields.items():
            assert cfg.get(f"{section}.{field}") == value, (section, field)
    spec = StepSpec.from_run_config(cfg)
    assert (spec.batch_size, spec.seq_len) == (cfg.data.batch_size, cfg.data.seq_len)


@pytest.mark.parametrize("name", SHIPPED)
def test_recipe_file_says_what_it_is_how_to_run_it_and_its_plan(name):
    text = recipes.recipe_path(name).read_text()
    head = text[:text.index("\ncard:")].splitlines()
    assert all(line.startswith("#") for line in head) and head[0].startswith(f"# {name}: ")
    command = f"python -m jaxmem.train --recipe {name}"
    assert any(command in line for line in head), head
    planned = [line for line in head if line.startswith("# Planned: ")]
    assert planned and "GiB" in planned[0] and "jax " in planned[0], planned


@pytest.mark.parametrize("name", SHIPPED)
def test_analytic_plan_fits_the_recipes_card(name):
    p = plan(name)
    assert p.source == "analytic" and p.peak_bytes > 0
    assert p.fits, (name, p)
    # the size a name states is the budget where smaller than the card (12 GiB on a 4090)
    assert p.budget_bytes == (12 * 2**30 if name.endswith("-12gb")
                              else target.CARDS[p.card].memory_bytes)


def test_listing_prints_one_line_per_recipe(capsys):
    assert main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "analytic, jaxmem.memory" in lines[0]
    assert [line.split()[0] for line in lines[1:]] == SHIPPED
    for name, line in zip(SHIPPED, lines[1:]):
        cfg = recipes.run_config(name)
        pairs = 2 if cfg.objective.objective == "dpo" else 1  # a pair is two rows
        tokens = pairs * cfg.data.batch_size * cfg.data.seq_len * cfg.data.grad_accum
        assert cfg.model.preset in line and f"{tokens:,}" in line and " fits " in line, line
    assert "2 x rtx4090" in lines[1 + SHIPPED.index("llama-3.1-70b-qlora-2x24gb-fsdp")]


def test_show_prints_the_file(capsys):
    name = "qwen3-8b-qlora-24gb"
    assert main(["show", name]) == 0
    assert capsys.readouterr().out == recipes.recipe_path(name).read_text()


def test_unknown_recipe_is_one_line_naming_the_nearest():
    with pytest.raises(ConfigError, match=r"unknown recipe 'qwen3-8b-qlora'; did you mean "
                                          r"qwen3-8b-qlora-24gb"):
        recipes.recipe_path("qwen3-8b-qlora")
    p = subprocess.run([sys.executable, "-m", "jaxmem.recipes", "show", "llama-8b-full"],
                       cwd=ROOT, capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    lines = [line for line in p.stderr.splitlines() if "error" in line]
    assert lines == [p.stderr.strip()], p.stderr
    assert "unknown recipe 'llama-8b-full'" in lines[0] and "llama-3.1-8b-full-80gb" in lines[0]


def test_a_malformed_recipe_is_refused_naming_what_is_wrong(tmp_path, monkeypatch):
    (tmp_path / "bad.yaml").write_text("card: h100\nmodel: tiny\nwarmup: {x: 1}\n")
    monkeypatch.setattr(recipes, "HERE", tmp_path)
    with pytest.raises(ConfigError, match=r"no description.*unknown section\(s\) warmup.*"
                                          r"section\(s\) model not a mapping"):
        recipes.load("bad")


def test_pyproject_ships_the_recipe_files():
    """The installed package carries the YAML files (setuptools' package-data; checked by hand
    with `pip wheel . --no-deps`: the wheel lists jaxmem/recipes/*.yaml)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["package-data"]["jaxmem.recipes"] == ["*.yaml"]
    assert any(d.startswith("pyyaml") for d in project["project"]["dependencies"])


# nightly (73 s on 2 cores, warm): CI runs its claims apart, more cheaply: a 30-step QLoRA run
# --init-from a tiny Qwen3 lowers the eval loss (test_family_lora::
# test_qlora_fine_tune_lowers_the_eval_loss[qwen3]), a QLoRA fine-tune on chat rows from a real
# checkpoint (test_smollm2_real), and this recipe's settings in the CI recipes' 2-step runs
# (test_the_recipes_trained_in_ci_hold_every_other_recipes_settings, below)
@pytest.mark.nightly
def test_qwen3_qlora_recipe_trains_a_tiny_qwen3_on_chat_rows(tmp_path):
    """The issue's acceptance on CPU: the 24 GB QLoRA recipe with only --init-from, --data and
    --steps 20 lowers the loss of a tiny random Qwen3 checkpoint on chat rows."""
    from chat_files import CHAT_FILE, write_chat_tokenizer
    from hf_files import random_params
    from jaxmem.families import PRESETS
    from jaxmem.io.hf_export import save_hf

    cfg = PRESETS["tiny"].replace(family="qwen3", qk_norm=True, tie_embeddings=True,
                                  vocab_size=400, hidden_size=64, intermediate_size=128,
                                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                  max_position_embeddings=4096)
    tok = write_chat_tokenizer(tmp_path / "tok", vocab_size=400)
    save_hf(tmp_path / "hf", cfg, random_params(cfg), tokenizer=str(tok), bos_token_id=0,
            eos_token_id=1)
    argv = ["--recipe", "qwen3-8b-qlora-24gb", "--init-from", str(tmp_path / "hf"),
            "--data", str(CHAT_FILE), "--steps", "20", "--out", str(tmp_path / "run")]
    p = subprocess.run([sys.executable, "-m", "jaxmem.train", *argv], cwd=ROOT,
                       capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    # logged every 10 steps (the default): step 10's loss and step 20's
    assert [r["step"] for r in rows if "loss" in r][-1] == 20 and losses[-1] < losses[0] - 0.1, losses
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["config"]
    assert saved["peft"]["quantize_base"] == "nf4" and saved["data"]["seq_len"] == 1024
    assert saved["model"]["family"] == "qwen3" and saved["model"]["hidden_size"] == 64


# CI trains tiers.RECIPES_IN_CI: the other recipes' settings are subsets of theirs (checked
# below; their dry runs above resolve every one of them), and their 2-step runs are nightly.
@pytest.mark.slow  # 2 steps of the tiny preset per recipe: ~15 to 25 s each on 2 cores
@pytest.mark.parametrize("name", nightly_except(SHIPPED, RECIPES_IN_CI))
def test_the_trainer_takes_every_recipes_settings(name, tmp_path):
    """Each recipe's settings but its model and sequence length, on the tiny preset from random
    init: the trainer refuses none of them (in-backward with --clip 0 and the state on the host,
    the fsdp=2 mesh with the base on the host, DPO with the adapters-off reference)."""
    argv = ["--recipe", name, "--preset", "tiny", "--seq-len", "64", "--steps", "2",
            "--out", str(tmp_path / "run"), "--no-progress", "--sample-tokens", "0",
            "--eval-batches", "1"]
    if recipes.run_config(name).objective.objective == "dpo":
        rows = [{"prompt": f"Question {i}: what is {i} + 1?", "chosen": f" It is {i + 1}.",
                 "rejected": f" No idea {i}."} for i in range(40)]
        (tmp_path / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        argv += ["--data", str(tmp_path / "prefs.jsonl")]
    # the fsdp=2 recipe on 2 simulated CPU devices (JAX_PLATFORMS=cpu: a GPU machine too)
    env = subprocess_env(cpu_devices=2) if recipes.run_config(name).parallel.mesh else \
        subprocess_env()
    p = subprocess.run([sys.executable, "-m", "jaxmem.train", *argv], cwd=ROOT,
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["config"]
    for section, fields in recipes.sections(name).items():
        for field, value in fields.items() if section != "model" else ():
            if f"{section}.{field}" not in ("data.seq_len", "optim.total_steps"):
                assert saved[section][field] == value, (section, field)


def test_the_recipes_trained_in_ci_hold_every_other_recipes_settings():
    """What lets the other recipes' 2-step runs be nightly: each of their settings (a string or
    boolean with its value, a number by its field) is one a recipe that CI trains sets too."""
    def settings(name):
        return {(section, field, v if isinstance(v, (str, bool)) else "number")
                for section, fields in recipes.sections(name).items() if section != "model"
                for field, v in fields.items()}
    covered = set().union(*(settings(n) for n in RECIPES_IN_CI))
    assert set(RECIPES_IN_CI) < set(SHIPPED)
    for name in set(SHIPPED) - set(RECIPES_IN_CI):
        assert settings(name) <= covered, (name, settings(name) - covered)


@pytest.mark.parametrize("name", SHIPPED)
def test_each_recipe_dry_runs(name, tmp_path, capsys, monkeypatch):
    """`jaxmem.train --recipe NAME --dry-run` resolves the recipe (each value with its source),
    plans every phase for the recipe's card and gives a verdict, exits 0 and makes no run
    directory. (On CPU without the gpu-plan extra the plan is the analytic one, said on a line.)"""
    from jaxmem.train.cli import main as train_main

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    assert train_main(["--recipe", name, "--dry-run", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert f"(recipe {name})" in text and "verdict:" in text, text[-2000:]
    assert "phases of the run" in text and "\n* " in text.split("phases of the run")[-1]
    assert not out.exists() and not (tmp_path / "runs").exists()
