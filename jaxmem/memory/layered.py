"""The run configuration as `jaxmem.train` and `jaxmem.memory` both take it: flags, `--config
FILE` and `--recipe NAME` layered by jaxmem.config.files (default < recipe < file < flag), the
inputs that fix the model (`--init-from`'s config.json, never its weights; `--tokenizer`'s
vocabulary), and which of the settings the planner uses: it takes every flag of jaxmem.train,
and names on one line those that change no memory instead of refusing them.

An app-tier module (jaxmem.train.cli and jaxmem.memory.cli import it; no cli module imports
another), since `--recipe` reads jaxmem.recipes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxmem.config.files import Layers, layers
from jaxmem.config.flags import (PLANNER_ONLY, PLANNER_SECTIONS, add_other_flags,
                                 given_overrides)
from jaxmem.config.run import all_paths, flag_names
from jaxmem.errors import ConfigError

IGNORED_TITLE = "ignored by the planner (no effect on memory)"
# jaxmem.train's own flags that are not RunConfig fields: accepted by the planner, ignored.
TRAIN_ONLY = ("resume", "resume_step", "dry_run", "coordinator", "num_processes", "process_id",
              "heartbeat_timeout")
# The planner's flags: jaxmem.config.flags.PLANNER_SECTIONS / PLANNER_ONLY (the fields that
# change memory, which jaxmem.train.failures.fit_command writes) and what fixes the model.
SECTIONS = PLANNER_SECTIONS + ("init",)
ONLY = {**PLANNER_ONLY, "data": PLANNER_ONLY["data"] + ("tokenizer",)}


def find_recipe(name: str) -> Path:
    """The file of recipe `name`: jaxmem.recipes.recipe_path (ConfigError naming the nearest)."""
    try:
        from jaxmem.recipes import recipe_path  # noqa: PLC0415
    except ImportError:
        raise ConfigError(f"--recipe {name}: this jaxmem has no recipes (jaxmem.recipes)") from None
    return Path(recipe_path(name))


def run_layers(args: argparse.Namespace) -> Layers:
    """The command line's layers (recipe, --config, flags); ConfigError on a bad file. With
    --init-from (from any layer) the checkpoint sets the model and tokenizer: a recipe's or a
    file's model fields and tokenizer give way to it (listed in `replaced`); flags for them are
    refused, as ever (jaxmem.train.init_from)."""
    lay = layers(args, given_overrides(args), find_recipe)
    if lay.overrides.get("init.init_from"):
        for key in [k for k in lay.overrides if (k.startswith("model.") or k == "data.tokenizer")
                    and not lay.sources[k].startswith("flag ")]:
            lay.replaced.append(f"{key} ({lay.sources.pop(key)})")
            del lay.overrides[key]
    return lay


def model_inputs(lay: Layers) -> Layers:
    """`lay` with what fixes the model resolved as jaxmem.train resolves it: --init-from's
    config.json (the model's fields, its tokenizer.json) and a --tokenizer's vocabulary size
    (when --vocab-size is not given). Reads no weights. HFError / ConfigError / DataError."""
    from jaxmem.data.tokenizers import TOKEN_NAMES, load_tokenizer  # noqa: PLC0415
    from jaxmem.train.init_from import init_from_overrides  # noqa: PLC0415

    given = lay.overrides
    resolved = init_from_overrides(dict(given))
    for key in resolved:
        if key not in given or resolved[key] != given[key]:
            lay.sources[key] = f"--init-from {resolved['init.init_from']}"
    if "data.tokenizer" in resolved and "model.vocab_size" not in resolved:
        tokenizer = load_tokenizer(resolved["data.tokenizer"],
                                   **{k: resolved.get(f"data.{k}") for k in TOKEN_NAMES})
        resolved["model.vocab_size"] = tokenizer.vocab_size
        lay.sources["model.vocab_size"] = f"the tokenizer ({lay.source('data.tokenizer')})"
    lay.overrides = resolved
    return lay


def planner_paths() -> set[str]:
    """The RunConfig fields the planner uses (`SECTIONS` / `ONLY`)."""
    return {p for p in all_paths() if p.split(".")[0] in SECTIONS
            and p.split(".")[1] in ONLY.get(p.split(".")[0], (p.split(".")[1],))}


def add_ignored_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of jaxmem.train the planner takes and ignores, in a group of their own."""
    from jaxmem.parallel.distributed import add_process_flags  # noqa: PLC0415

    g = parser.add_argument_group(
        IGNORED_TITLE, "jaxmem.train's other flags (see python -m jaxmem.train --help), "
                       "accepted so that a train command line plans as it is; those given are "
                       "named on stderr")
    add_other_flags(g, SECTIONS, ONLY)
    g.add_argument("--resume", action="store_true")
    g.add_argument("--resume-step", metavar="STEP")
    g.add_argument("--dry-run", action="store_true")
    add_process_flags(g)
    for action in g._group_actions:  # one line each: their help is jaxmem.train's
        action.help, action.default = None, argparse.SUPPRESS  # given or not: in vars(args)


def planner_layers(args: argparse.Namespace) -> tuple[Layers, list[str]]:
    """(the layers the planner uses, the settings it ignores as flag names): `args` is updated
    so that given_overrides(args) is the planner's resolved overrides."""
    lay = run_layers(args)
    used = planner_paths()
    ignored = [flag_names(p)[0] for p in lay.overrides if p not in used]
    ignored += ["--" + n.replace("_", "-") for n in TRAIN_ONLY if n in vars(args)]
    lay.overrides = {p: v for p, v in lay.overrides.items() if p in used}
    lay = model_inputs(lay)
    for key in [k for k in vars(args) if "." in k]:
        delattr(args, key)
    for key, value in lay.overrides.items():
        setattr(args, key, value)
    return lay, ignored


def say_ignored(prog: str, ignored: list[str]) -> None:
    if ignored:
        print(f"{prog}: {IGNORED_TITLE}: {', '.join(ignored)}", file=sys.stderr, flush=True)

