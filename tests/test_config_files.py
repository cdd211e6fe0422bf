"""`--config FILE`, `--recipe NAME` and `--dry-run` (jaxmem.config.files, jaxmem.memory.layered):
a file is the same run as its flags, bitwise; a bad file exits 2 naming file, line and key and
makes nothing; a run's config.json starts a new run; the layers and their sources; the planner
takes every train flag (and every train command line of the docs)."""

import json
import re
import shlex
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from jaxmem.config.files import read_config
from jaxmem.config.run import RunConfig
from jaxmem.errors import ConfigError
from jaxmem.train.cli import main
from runs import SMALL, error_line, losses, params_of

FLAGS = [*SMALL, "--steps", "10", "--eval-every", "5", "--save-every", "5", "--lr", "0.002",
         "--warmup-steps", "2", "--clip", "0.5"]
# SMALL and FLAGS above as a file; lr is wrong on purpose: the flag --lr overrides it.
YAML = """\
description: "SMALL of tests/runs.py, 10 steps"
model:
  num_layers: 2
  hidden_size: 64
  intermediate_size: 128
optim: {lr: 9e-1, total_steps: 10, warmup_steps: 2, clip: 0.5}
data:
  batch_size: 4
  seq_len: 32
run: {eval_every: 5, eval_batches: 2, save_every: 5, log_every: 1, no_progress: true}
sample:
  max_new_tokens: 0
"""


def test_read_config_values_lines_and_metadata(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("card: h100\n" + YAML)
    c = read_config(f)
    assert c.values["optim.lr"] == 0.9 and isinstance(c.values["optim.lr"], float)  # 9e-1: a float
    assert c.values["run.no_progress"] is True and c.values["data.seq_len"] == 32
    assert c.lines["optim.lr"] == 7 and c.lines["model.num_layers"] == 4
    assert c.lines["sample.max_new_tokens"] == 13
    assert (c.card, c.description, c.record) == ("h100", "SMALL of tests/runs.py, 10 steps", False)
    assert c.source("data.batch_size") == f"{f}:9"
    assert RunConfig().replace(c.values).model_config().num_layers == 2


BAD = [  # (file text, line, what the message says)
    ("optim:\n  lr: 0.1\n  lrr: 3\n", 3, "unknown key 'optim.lrr' (nearest valid key: 'optim.lr')"),
    ("optimm:\n  lr: 1\n", 1, "unknown key 'optimm' (nearest valid key: 'optim')"),
    ("data:\n  lr: 1\n", 2, "unknown key 'data.lr' (nearest valid key: 'optim.lr')"),
    ("cards: h100\n", 1, "unknown key 'cards' (nearest valid key: 'card')"),
    ("model: {preset: tiny}\noptim:\n  lr: fast\n", 3, "optim.lr: expected a finite number >= 0"),
    ("data:\n  batch_size: 0\n", 2, "data.batch_size: expected a positive integer, got 0"),
    ("precision: {mode: fp64}\n", 1, "precision.mode: expected one of fp32, bf16"),
    ("run:\n  no_progress: 3\n", 2, "run.no_progress: expected true or false, got 3"),
    ("card: h1000\n", 1, "card 'h1000' is not a jaxmem.target card (nearest valid key: 'h100')"),
    ("optim: [1, 2]\n", 1, "section 'optim' must be a mapping"),
    ("optim: {lr: 1\n", 2, "not valid YAML or JSON"),
    ("optim:\n  lr: 0.1\n  lr: 0.2\n", 3, "key 'lr' is given twice in section 'optim' (first on line 2)"),
]


@pytest.mark.parametrize("text,line,says", BAD, ids=[b[2].split(":")[0][:24] for b in BAD])
def test_a_bad_file_exits_2_naming_file_line_and_key_and_makes_nothing(tmp_path, capsys, text,
                                                                         line, says):
    f, out = tmp_path / "bad.yaml", tmp_path / "out"
    f.write_text(text)
    with pytest.raises(SystemExit) as e:
        main(["--config", str(f), "--out", str(out)])
    assert e.value.code == 2
    assert error_line(capsys.readouterr().err).startswith(
        f"python -m jaxmem.train: error: {f}:{line}: ")
    with pytest.raises(ConfigError, match="^" + f"{f}:{line}: ".replace(".", r"\.")) as err:
        read_config(f)
    assert says in str(err.value)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]
    from jaxmem.memory.cli import main as plan  # the planner refuses it the same way
    with pytest.raises(SystemExit) as e:
        plan(["--config", str(f)])
    assert e.value.code == 2 and f"{f}:{line}: " in capsys.readouterr().err


def test_a_missing_file_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--config", str(tmp_path / "none.yaml"), "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and "none.yaml: cannot read it" in error_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # three CLI runs of 10 steps
def test_a_config_file_is_its_flags_bitwise_and_a_runs_config_json_starts_a_new_run(
        tmp_path, corpus, capsys):
    flags, filed, again = (str(tmp_path / n) for n in ("flags", "filed", "again"))
    assert main([*FLAGS, "--data", corpus, "--out", flags]) == 0
    f = tmp_path / "run.yaml"
    f.write_text(YAML)
    assert main(["--config", str(f), "--lr", "0.002", "--data", corpus, "--out", filed]) == 0
    record = lambda run: json.loads((Path(run) / "config.json").read_text())  # noqa: E731
    a, b = record(flags)["config"], record(filed)["config"]
    assert a["run"].pop("out") == flags and b["run"].pop("out") == filed and a == b
    assert len(losses(flags)) == 10 and losses(flags) == losses(filed)
    (step_a, pa), (step_b, pb) = params_of(flags), params_of(filed)
    assert step_a == step_b == 10 and all(np.array_equal(x, y) for x, y in zip(pa, pb))
    # a run's config.json starts a new run (its run.out is not taken) ...
    assert main(["--config", str(Path(flags) / "config.json"), "--out", again]) == 0
    assert losses(again) == losses(flags)
    assert all(np.array_equal(x, y) for x, y in zip(params_of(again)[1], pa))
    # ... but never its own run again: that is --resume
    before = sorted(p.name for p in Path(flags).rglob("*"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["--config", str(Path(flags) / "config.json"), "--out", flags])
    assert e.value.code == 2 and "--resume" in error_line(capsys.readouterr().err)
    assert sorted(p.name for p in Path(flags).rglob("*")) == before


def test_a_runs_config_json_drops_its_directory_and_invocation_fields(tmp_path):
    from jaxmem.train.rundir import write_run_config
    cfg = RunConfig().replace({"run.out": "runs/x", "run.stop_at": 3, "optim.lr": 0.01,
                               "parallel.mesh": "fsdp=1", "run.profile": "p"})
    write_run_config(tmp_path, cfg, data_stats={"tokens": 1}, data_sha256="ab", changes=[])
    c = read_config(tmp_path / "config.json")
    assert c.record and c.values == {"optim.lr": 0.01}
    lr_line = _line_of_file(tmp_path / "config.json", '"lr"')
    assert c.source("optim.lr") == f"{tmp_path / 'config.json'}:{lr_line}"


@pytest.fixture
def recipes(tmp_path, monkeypatch):
    """A fake jaxmem.recipes (the recipes package is built on another branch): recipe `r`."""
    (tmp_path / "r.yaml").write_text("description: a recipe\ncard: h100\nmodel: {preset: tiny}\n"
                                     "optim: {lr: 1e-3, total_steps: 7}\ndata: {seq_len: 64}\n")

    def recipe_path(name):
        if name != "r":
            raise ConfigError(f"unknown recipe {name!r} (nearest: 'r')")
        return tmp_path / "r.yaml"

    monkeypatch.setitem(sys.modules, "jaxmem.recipes", types.SimpleNamespace(recipe_path=recipe_path))
    return tmp_path


def test_dry_run_layers_recipe_file_and_flags_with_their_sources(recipes, tmp_path, capsys,
                                                                 monkeypatch):
    import jaxmem.memory.commands as commands
    planned = []
    monkeypatch.setattr(commands, "plan_run", lambda cfg, card, prog: planned.append(card) or 0)
    f = tmp_path / "mine.yaml"
    f.write_text("optim:\n  total_steps: 20\ncard: rtx4090\n")
    out = tmp_path / "out"
    assert main(["--recipe", "r", "--config", str(f), "--steps", "30", "--warmup-steps", "3",
                 "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    line = lambda key: next(l for l in text.splitlines() if l.split()[:1] == [key])  # noqa: E731
    assert line("optim.lr").endswith("(recipe r)") and "0.001" in line("optim.lr")
    assert line("data.seq_len").endswith("(recipe r)")
    assert line("optim.total_steps").endswith("(flag --steps)") and "30" in line("optim.total_steps")
    assert line("optim.warmup_steps").endswith("(flag --warmup-steps)")
    assert line("data.batch_size").endswith("(default)")
    assert "description: a recipe" in text and planned == ["rtx4090"]  # the file's card wins
    assert not out.exists()
    f.write_text("optim:\n  total_steps: 20\n")
    assert main(["--recipe", "r", "--config", str(f), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert line("optim.total_steps").endswith(f"({f}:2)") and "20" in line("optim.total_steps")
    assert planned[-1] == "h100"  # the recipe's card
    with pytest.raises(SystemExit) as e:
        main(["--recipe", "nope", "--dry-run"])
    assert e.value.code == 2 and "unknown recipe 'nope'" in error_line(capsys.readouterr().err)


def test_dry_run_prints_the_plan_and_makes_no_run_directory(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*SMALL, "--lr", "0.01", "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "(flag --lr)" in text and "(default)" in text and "resolved config" in text
    assert "no GPU here and no card" in text  # this CPU: the analytic plan
    assert "phases of the run" in text and "* step" in text and "verdict: analytic peak" in text
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_dry_run_init_from_reads_config_json_only(recipes, tmp_path, capsys):
    from hf_files import write_tokenizer
    from jaxmem.families import get_preset
    from jaxmem.io.hf import config_to_hf
    hf = tmp_path / "hf"
    vocab = write_tokenizer(hf, Path(np.__file__).read_text()[:20000])
    model = get_preset("tiny", num_layers=3, vocab_size=vocab)
    (hf / "config.json").write_text(json.dumps(config_to_hf(model)))
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "tokenizer.json"]  # no weights
    assert main(["--init-from", str(hf), "--lora-rank", "4", "--dry-run"]) == 0
    text = capsys.readouterr().out
    layers = next(l for l in text.splitlines() if l.startswith("  model.num_layers"))
    assert "= 3 " in layers and f"(--init-from {hf.resolve()})" in layers
    assert "phases of the run" in text and "verdict:" in text
    # a recipe's model gives way to the checkpoint (README: --recipe NAME --init-from DIR)
    assert main(["--recipe", "r", "--init-from", str(hf), "--lora-rank", "4", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "the checkpoint (--init-from) sets the model in place of: model.preset (recipe r)" in text
    layers = next(l for l in text.splitlines() if l.startswith("  model.num_layers"))
    assert "= 3 " in layers and "seq_len" in text and "(recipe r)" in text
    with pytest.raises(SystemExit) as e:  # a flag for the model is refused, as ever
        main(["--recipe", "r", "--init-from", str(hf), "--num-layers", "2", "--dry-run"])
    assert e.value.code == 2 and "--num-layers cannot be given with --init-from" in capsys.readouterr().err


def test_the_planner_takes_every_train_flag_and_names_the_ignored(tmp_path, capsys):
    from jaxmem.memory.cli import main as plan
    f = tmp_path / "c.yaml"
    f.write_text("model: {preset: tiny}\noptim: {warmup_steps: 4}\ndata: {seq_len: 32}\n")
    assert plan(["--config", str(f), "--clip", "0.5", "--lr", "1e-3", "--steps", "5",
                 "--out", str(tmp_path / "r"), "--resume", "--batch-size", "2", "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert (report["batch_size"], report["seq_len"]) == (2, 32)
    assert [l for l in captured.err.splitlines() if "ignored" in l] == [
        "python -m jaxmem.memory: ignored by the planner (no effect on memory): --warmup-steps, "
        "--clip, --lr, --steps, --out, --resume"]
    assert not (tmp_path / "r").exists()


ROOT = Path(__file__).resolve().parent.parent
TRAIN = re.compile(r"python -m jaxmem\.train(?=[\s`]|$)")


def doc_train_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every `python -m jaxmem.train` command line of README.md and docs/*.md:
    in code blocks (fenced or indented; continuation lines joined) and in inline backticks
    (across line breaks); the command ends at a comment, pipe, `;`, `&&` or redirection."""
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        lines, fenced, i = text.splitlines(), False, 0
        while i < len(lines):
            line, start = lines[i], i
            fenced ^= line.lstrip().startswith("```")
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            if (fenced or line.startswith("    ")) and TRAIN.search(line):
                found.append((f"{doc.name}:{start + 1}", TRAIN.split(line, 1)[1]))
            i += 1
        for m in re.finditer(r"`(python -m jaxmem\.train(?=[\s`])[^`]*)`", text):
            where = f"{doc.name}:{text.count(chr(10), 0, m.start()) + 1}"
            found.append((where, TRAIN.split(m.group(1).replace("\n", " "), 1)[1]))
    return [(where, _argv(rest)) for where, rest in found]


def _argv(rest: str) -> list[str]:
    rest = re.split(r"\s#|\||;|&&|\s>|`", rest)[0]
    tokens = shlex.split(rest)
    # placeholders: a whole <flags> or ... is dropped; a value in capitals (T, HF_DIR,
    # HOST:PORT, <DIR>, $VAR) becomes 1
    tokens = [t for t in tokens if t not in ("...", "[...]") and not re.fullmatch(r"<[a-z ]+>", t)]
    return [re.sub(r"^(<[A-Z_ ]+>|[A-Z][A-Z_:]*|\$\w+|\$\{\w+\})$", "1", t) for t in tokens]


def test_every_train_command_of_the_docs_is_a_planner_command(capsys):
    """`python -m jaxmem.memory` in place of `python -m jaxmem.train` parses every train
    command line the docs show, and its flags resolve to a RunConfig (placeholders: parsed only;
    files and checkpoints named are not read, nothing is planned)."""
    from jaxmem.memory.cli import build_parser
    from jaxmem.memory.layered import run_layers
    commands = doc_train_commands()
    assert len(commands) >= 20, commands  # README and docs: ~25 when this was written
    refused = []
    parser = build_parser()
    for where, argv in commands:
        if len(argv) == 1 and argv[0].startswith("--"):  # prose naming a flag: "`... --remat` takes"
            assert argv[0] in parser._option_string_actions, (where, argv)
            continue
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            refused.append(f"{where}: {argv}: {capsys.readouterr().err.splitlines()[-1]}")
            continue
        if args.config or args.recipe:  # a file the docs name: parsed, not read here
            continue
        lay = run_layers(args)
        if "1" not in argv:  # no placeholder: the values are the docs' own
            RunConfig().replace(lay.overrides)
    assert not refused, "\n".join(refused)


def test_a_check_across_fields_names_the_files_line(tmp_path, capsys):
    f, out = tmp_path / "q.yaml", tmp_path / "out"
    f.write_text("model: {preset: tiny}\npeft:\n  quantize_base: nf4\n")  # needs --lora-rank
    for cli in ("jaxmem.train.cli", "jaxmem.memory.cli"):
        main_of = __import__(cli, fromlist=["main"]).main
        with pytest.raises(SystemExit) as e:
            main_of(["--config", str(f), "--out", str(out)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--quantize-base nf4 needs --lora-rank" in err, err
        assert f"({f}:3: peft.quantize_base)" in err
    assert not out.exists()


def test_to_dicts_layout_as_json_is_a_config_file(tmp_path):
    cfg = RunConfig().replace({"model.preset": "small", "optim.lr": 2e-5, "peft.lora_rank": 8,
                               "data.seq_len": 256, "run.no_progress": True})
    f = tmp_path / "c.json"
    f.write_text(json.dumps(cfg.to_dict(), indent=2))
    c = read_config(f)
    assert not c.record and RunConfig().replace(c.values) == cfg
    assert "model.vocab_size" not in c.values  # null (the preset's) is "not set"
    assert c.lines["optim.lr"] == _line_of_file(f, '"lr"')


def _line_of_file(f, text):
    return next(i + 1 for i, line in enumerate(Path(f).read_text().splitlines()) if text in line)


def test_the_files_card_is_the_planners_target(tmp_path, capsys):
    """card: in the file is the default --target; without the deviceless compiler, the planner
    says so on one line and plans on this machine's backend."""
    from jaxmem import target
    from jaxmem.memory.cli import main as plan
    f = tmp_path / "c.yaml"
    f.write_text("card: h100\nmodel: {preset: tiny}\ndata: {batch_size: 1, seq_len: 32}\n")
    try:
        target.check_installed()
        installed = True
    except target.TargetError:
        installed = False
    assert plan(["--config", str(f), "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    if installed:
        assert "H100" in report["compiler"]
    else:
        assert "the config's card h100 needs XLA's GPU compiler, which is not installed: " \
               "planning on this machine's backend" in captured.err
        assert report["backend"] == "cpu"


def test_target_without_dry_run_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--target", "h100", "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and "--target plans for a GPU: it needs --dry-run" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a CLI run of 2 steps
def test_dry_run_of_a_resume_shows_the_saved_config_under_the_flags(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    assert main([*SMALL, "--steps", "2", "--lr", "0.01", "--data", corpus, "--out", str(out)]) == 0
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    capsys.readouterr()
    assert main(["--out", str(out), "--resume", "--log-every", "2", "--dry-run"]) == 0
    text = capsys.readouterr().out
    line = lambda key: next(l for l in text.splitlines() if l.split()[:1] == [key])  # noqa: E731
    assert f"continues the run in {out}" in text
    assert "0.01" in line("optim.lr") and line("optim.lr").endswith("config.json: the run's saved config)")
    assert line("run.log_every").endswith("(flag --log-every)")
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # nothing changed
    with pytest.raises(SystemExit) as e:  # as the real resume would, before anything
        main(["--out", str(out), "--resume", "--lr", "0.5", "--dry-run"])
    assert e.value.code == 2 and "optim.lr" in error_line(capsys.readouterr().err)


def test_recipe_without_the_recipes_package_exits_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "jaxmem.recipes", None)  # import fails: not merged yet
    with pytest.raises(SystemExit) as e:
        main(["--recipe", "qlora", "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    assert error_line(capsys.readouterr().err).endswith(
        "--recipe qlora: this jaxmem has no recipes (jaxmem.recipes)")
    assert not (tmp_path / "out").exists()
