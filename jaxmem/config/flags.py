"""Command-line flags generated from RunConfig's field metadata (jaxmem.config.run).

    parser = argparse.ArgumentParser(...)
    add_run_flags(parser, ["model", "precision", "remat", "optim", "data", "run", "sample"])
    overrides = given_overrides(parser.parse_args(argv))   # {'optim.lr': 0.01, ...}
    cfg = RunConfig().replace(overrides)                    # or saved_config.replace(...)

Every flag defaults to "not given" (argparse.SUPPRESS), so a CLI knows exactly which fields the
user set: a resumed run compares only those with its saved config, and the defaults live in one
place, the dataclasses. `--help` shows each field's default and groups flags by section.
"""

from __future__ import annotations

import argparse
import dataclasses

from jaxmem.config.run import RunConfig, field_metadata, flag_names


def number_type(convert, ok, expected):
    """An argparse `type=`: converts, checks, and names what it expected in the error."""
    def parse(text):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        if not ok(value):  # NaN fails every comparison, so it lands here too
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return parse


positive_int = number_type(int, lambda v: v > 0, "a positive integer")
nonneg_int = number_type(int, lambda v: v >= 0, "an integer >= 0")
nonneg_float = number_type(float, lambda v: 0 <= v < float("inf"), "a finite number >= 0")
positive_float = number_type(float, lambda v: 0 < v < float("inf"), "a finite number > 0")
TYPES = {"positive_int": positive_int, "nonneg_int": nonneg_int, "nonneg_float": nonneg_float,
         "positive_float": positive_float}

# The RunConfig fields `python -m jaxmem.memory` takes (the planner): its sections, and the
# fields of the sections it takes in part. `jaxmem.train.failures.fit_command` writes its
# commands from the same lists.
PLANNER_SECTIONS = ("model", "precision", "remat", "optim", "data", "peft", "parallel", "sample",
                    "objective")
PLANNER_ONLY = {"precision": ("mode",), "data": ("batch_size", "seq_len", "grad_accum"),
                "optim": ("mu_dtype", "optimizer", "in_backward", "offload_optimizer",
                          "offload_params", "update_kernel"),
                "parallel": ("mesh",),
                "sample": ("max_new_tokens", "temperature", "top_k")}

SECTION_TITLES = {"model": "model", "precision": "memory and precision", "remat": "memory and precision",
                  "optim": "optimization", "data": "data and batch", "run": "run directory",
                  "sample": "sampling", "init": "model",
                  "peft": "fine-tuning (LoRA, quantized base)",
                  "parallel": "devices and processes",
                  "objective": "objective (causal LM, preference tuning)"}


def add_run_flags(parser: argparse.ArgumentParser, sections, only: dict[str, tuple[str, ...]] | None = None,
                  defaults: RunConfig | None = None) -> dict[str, argparse._ArgumentGroup]:
    """Add the flags of `sections` (names of RunConfig sections) to `parser`, grouped; returns
    the groups by title, so a program can add its own flags to one (e.g. "run directory").

    only: {section: (field, ...)} restricts a section to some of its fields.
    defaults: the config whose values `--help` shows (default: RunConfig()).
    """
    defaults = defaults or RunConfig()
    groups: dict[str, argparse._ArgumentGroup] = {}
    for section in sections:
        title = SECTION_TITLES[section]
        group = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        for path in _section_flags(section):
            if not (only and section in only and path.split(".")[1] not in only[section]):
                _add_flag(group, path, defaults.get(path))
    return groups


def add_other_flags(group, sections, only: dict[str, tuple[str, ...]],
                    defaults: RunConfig | None = None) -> list[str]:
    """On `group`, the flags of every RunConfig section that `sections` and `only` leave out
    (the planner's "ignored" group: jaxmem.memory takes every flag of jaxmem.train); returns
    their paths."""
    defaults = defaults or RunConfig()
    added = []
    for section in RunConfig.sections():
        for path in _section_flags(section):
            name = path.split(".")[1]
            if section not in sections or (section in only and name not in only[section]):
                _add_flag(group, path, defaults.get(path))
                added.append(path)
    return added


def _section_flags(section: str) -> list[str]:
    """The 'section.field' paths of a section's fields that are flags."""
    return [f"{section}.{f.name}" for f in dataclasses.fields(RunConfig.sections()[section])
            if field_metadata(f"{section}.{f.name}")["cli"]]


def _add_flag(group, path: str, default) -> None:
    md = field_metadata(path)
    kwargs = dict(dest=path, default=argparse.SUPPRESS)
    if md["store_true"]:
        kwargs.update(action="store_true", help=md["help"])
    else:
        shown = "" if default is None else f" (default: {default})"
        metavar = md["metavar"] or (None if md["choices"] else path.split(".")[1].upper())
        kwargs.update(help=md["help"] + shown, metavar=metavar,
                      type=TYPES.get(md["type"], md["type"]) if md["type"] else None,
                      choices=md["choices"])
    group.add_argument(*flag_names(path), **kwargs)


def given_overrides(args: argparse.Namespace) -> dict:
    """{'section.field': value} for the RunConfig flags given on the command line."""
    return {k: v for k, v in vars(args).items() if "." in k}
