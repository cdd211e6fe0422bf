"""Run configuration files: `--config FILE` and `--recipe NAME` of jaxmem.train and jaxmem.memory.

A config file is YAML (or JSON, which YAML reads) holding RunConfig.to_dict()'s sections as keys:

    description: "QLoRA of Qwen3-8B on one 24 GB card"   # one line; the trainer ignores it
    card: rtx4090              # a jaxmem.target card: the default --target of the planner
    model: {preset: qwen3-8b}
    optim: {lr: 2e-4, total_steps: 1000}
    peft: {lora_rank: 16, quantize_base: nf4}

`schema_version` is optional (2 when given). A run's own `config.json` is one too: its "config"
record is read and the rest (resolved_model, data_stats, changes, ...) left out, and so are the
fields that belong to the run directory or to one invocation (run.out, run.stop_at,
parallel.mesh, run.no_memory_check, run.profile) and, for an --init-from run, the model and
tokenizer the checkpoint sets again; what is left starts a new run.

Layers, lowest first: the defaults (RunConfig()), the recipe, the file, the flags given.
`Layers.sources` says where each value came from: "recipe NAME", "FILE:LINE" or "flag --x"
(anything else: "default"). An unknown key or a value of the wrong type raises ConfigError
naming the file, the line and the key (with the nearest valid key), before anything is done.
"""

from __future__ import annotations

import argparse
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from jaxmem.config.run import SCHEMA_VERSION, RunConfig, all_paths, field_metadata, flag_names
from jaxmem.errors import ConfigError

METADATA_KEYS = ("card", "description", "schema_version")
# Fields a run's config.json holds that are no part of a new run made from it.
RECORD_DROPPED = ("run.out", "run.stop_at", "parallel.mesh", "run.no_memory_check", "run.profile")


@dataclass(frozen=True)
class ConfigFile:
    """A config file read and checked: values {'section.field': value}, each key's line (1-based),
    the recipe metadata (card, description), and whether it is a run's config.json (`record`)."""

    path: Path
    values: dict[str, Any]
    lines: dict[str, int]
    card: str | None = None
    description: str | None = None
    record: bool = False

    def source(self, key: str) -> str:
        return f"{self.path}:{self.lines[key]}"


def _loader():
    """yaml.SafeLoader, reading `2e-4` as a float as YAML 1.2 and JSON do (1.1 needs a dot)."""
    import yaml  # noqa: PLC0415  (pyyaml: a maintained parser, installed with flax)

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))
    return yaml, Loader


def _nearest(word: str, candidates) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.5)
    return f" (nearest valid key: {close[0]!r})" if close else ""


def _nearest_field(section: str, name: str, names: dict[str, list[str]]) -> str:
    """The nearest 'section.field': the same name in another section, else a close one in
    this section, else a close one anywhere."""
    elsewhere = [f"{s}.{name}" for s in names if name in names[s]]
    if elsewhere:
        return f" (nearest valid key: {elsewhere[0]!r})"
    return _nearest(f"{section}.{name}", [f"{section}.{n}" for n in names[section]]) or \
        _nearest(f"{section}.{name}", [f"{s}.{n}" for s in names for n in names[s]])


def _pairs(node, path: Path, where: str):
    """(key, line, value node) of a YAML mapping node; ConfigError unless it is one."""
    import yaml  # noqa: PLC0415
    if isinstance(node, yaml.ScalarNode) and node.value in ("", "~", "null"):
        return []
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(f"{path}:{node.start_mark.line + 1}: {where} must be a mapping of keys "
                          f"to values")
    pairs, seen = [], {}
    for k, v in node.value:
        line = k.start_mark.line + 1
        if k.value in seen:  # yaml would keep the last one silently
            raise ConfigError(f"{path}:{line}: key {k.value!r} is given twice in {where} (first "
                              f"on line {seen[k.value]})")
        seen[k.value] = line
        pairs.append((k.value, line, v))
    return pairs


def read_config(path) -> ConfigFile:
    """Read and check a config file (see the module docstring); ConfigError names the file, and
    where it can, the line and the key."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    yaml, Loader = _loader()
    try:
        root, data = yaml.compose(text, Loader=Loader), yaml.load(text, Loader=Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{line}: not valid YAML or JSON "
                          f"({getattr(e, 'problem', None) or e})") from None
    if root is None:
        return ConfigFile(path, {}, {})
    top = {k: (line, v) for k, line, v in _pairs(root, path, "the file")}
    record = "config" in top and isinstance(data.get("config"), dict)
    if record:  # a run's config.json: {"schema_version", "config": {...}, "resolved_model", ...}
        body, body_data = top["config"][1], data["config"]
        version_line = top.get("schema_version", (1, None))[0]
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ConfigError(f"{path}:{version_line}: a run config of schema_version "
                              f"{data.get('schema_version')!r}; this jaxmem starts a run from "
                              f"version {SCHEMA_VERSION} (resume the old run instead)")
    else:
        body, body_data = root, data
    values, lines, meta = _read_sections(path, body, body_data, record)
    if record:
        values, lines = _new_run_values(values, lines)
    return ConfigFile(path, values, lines, meta.get("card"), meta.get("description"), record)


def _read_sections(path: Path, body, data: dict, record: bool):
    """(values, lines, metadata) of the sections' mapping; ConfigError on an unknown key."""
    sections = RunConfig.sections()
    names = {s: [p.split(".")[1] for p in all_paths() if p.startswith(s + ".")] for s in sections}
    values, lines, meta, defaults = {}, {}, {}, RunConfig()
    for key, line, node in _pairs(body, path, "the file"):
        if key in METADATA_KEYS:
            meta[key] = _metadata(path, line, key, data[key])
            continue
        if key not in sections:
            raise ConfigError(f"{path}:{line}: unknown key {key!r}"
                              + _nearest(key, [*sections, *METADATA_KEYS]))
        section_data = data[key] or {}
        if key == "model" and record:
            from jaxmem.families.config import upgrade_fields  # noqa: PLC0415
            section_data = upgrade_fields(section_data)
        for name, fline, _ in _pairs(node, path, f"section {key!r}"):
            consumed = key == "model" and record and name not in section_data  # renamed
            if name not in names[key] and not consumed:
                raise ConfigError(f"{path}:{fline}: unknown key '{key}.{name}'"
                                  + _nearest_field(key, name, names))
        for name, value in section_data.items():
            p = f"{key}.{name}"
            fline = next((ln for n, ln, _ in _pairs(node, path, key) if n == name), line)
            if value is None and defaults.get(p) is None:
                continue  # "not set" (to_dict writes every field): as if the key were absent
            values[p], lines[p] = _check_value(path, fline, p, value), fline
    return values, lines, meta


def _metadata(path: Path, line: int, key: str, value):
    if key == "schema_version":
        if value != SCHEMA_VERSION:
            raise ConfigError(f"{path}:{line}: schema_version {value!r} is not supported "
                              f"(config files are version {SCHEMA_VERSION})")
        return value
    if key == "card":
        from jaxmem.target import CARDS  # noqa: PLC0415
        if value not in CARDS:
            raise ConfigError(f"{path}:{line}: card {value!r} is not a jaxmem.target card"
                              + _nearest(str(value), CARDS) + f"; known: {', '.join(sorted(CARDS))}")
    if not isinstance(value, str) or "\n" in value.strip():
        raise ConfigError(f"{path}:{line}: {key} must be one line of text, got {value!r}")
    return value


def _check_value(path: Path, line: int, key: str, value):
    """The value as the field's flag would give it; ConfigError naming file, line and key."""
    from jaxmem.config.flags import TYPES  # noqa: PLC0415
    md, default = field_metadata(key), RunConfig().get(key)

    def bad(expected):
        return ConfigError(f"{path}:{line}: {key}: expected {expected}, got {value!r}")

    if not md["cli"] or (value is None and default is None):
        return value  # not a flag's field (Adam's betas, a ModelConfig field): the section checks
    if md["store_true"]:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if value is None or isinstance(value, (bool, list, dict)):
        raise bad("a value" if md["type"] or md["choices"] else "a string")
    if md["type"]:
        convert = TYPES.get(md["type"], md["type"])
        try:
            value = convert(str(value))
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise bad(str(e).partition(", got")[0].removeprefix("expected ")
                      if isinstance(e, argparse.ArgumentTypeError) else md["type"].__name__) \
                from None
    elif not isinstance(value, str):
        raise bad("a string")
    if md["choices"] and value not in md["choices"]:
        raise bad(f"one of {', '.join(map(str, md['choices']))}")
    return value


def _new_run_values(values: dict, lines: dict):
    """A run's config.json as a new run's layer: the fields that differ from the defaults, less
    those of its directory and invocation, less what --init-from sets again."""
    defaults = RunConfig()
    drop = set(RECORD_DROPPED)
    if values.get("init.init_from"):
        drop |= {p for p in values if p.startswith("model.")} | {"data.tokenizer"}
    keep = {p: v for p, v in values.items() if p not in drop and v != defaults.get(p)}
    return keep, {p: lines[p] for p in keep}


# ----------------------------------------------------------------------------- layers


@dataclass
class Layers:
    """The run's overrides (recipe < file < flags, over the defaults) and where each came from."""

    overrides: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    card: str | None = None
    description: str | None = None
    files: list[ConfigFile] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)  # 'key (source)' that --init-from replaced

    def source(self, key: str) -> str:
        return self.sources.get(key, "default")

    def explain(self, message: str) -> str:
        """`message` (an error naming a flag, from checks across fields) with where that
        flag's value came from when it was not the command line: '... (FILE:LINE: key)'."""
        for token in re.findall(r"--[a-z][a-z0-9-]*", message):
            key = next((p for p in self.sources if token in flag_names(p)), None)
            if key is not None and not self.sources[key].startswith("flag "):
                return f"{message} ({self.sources[key]}: {key})"
        return message

    def add_file(self, file: ConfigFile, label: Callable[[str], str]) -> None:
        self.files.append(file)
        for key, value in file.values.items():
            self.overrides[key], self.sources[key] = value, label(key)
        self.card = file.card or self.card
        self.description = file.description or self.description


def add_config_flags(group) -> None:
    """--config FILE and --recipe NAME, on an argparse group."""
    group.add_argument("--config", metavar="FILE", default=None,
                       help="read the run config from a YAML (or JSON) file of RunConfig's "
                            "sections (model:, optim:, peft:, ...; a run's config.json starts a "
                            "new run); flags given beside it override it")
    group.add_argument("--recipe", metavar="NAME", default=None,
                       help="start from a named recipe (jaxmem.recipes), under --config and the "
                            "flags")


def layers(args: argparse.Namespace, flags: dict[str, Any],
           find_recipe: Callable[[str], Path] | None = None) -> Layers:
    """The layers of a command line: the recipe (`find_recipe(name)`: its file), --config, then
    the flags given ({'section.field': value}). ConfigError on a bad file."""
    out = Layers()
    if getattr(args, "recipe", None):
        if find_recipe is None:
            raise ConfigError("--recipe: no recipes in this jaxmem")
        name = args.recipe
        out.add_file(read_config(find_recipe(name)), lambda key: f"recipe {name}")
    if getattr(args, "config", None):
        file = read_config(args.config)
        out.add_file(file, file.source)
    for key, value in flags.items():
        out.overrides[key], out.sources[key] = value, f"flag {flag_names(key)[0]}"
    return out


def provenance_lines(cfg: RunConfig, sources: dict[str, str]) -> list[str]:
    """'  section.field = value   (source)' for every field of the config."""
    width = max(len(p) for p in all_paths())
    return [f"  {p:<{width}} = {cfg.get(p)!r:<24} ({sources.get(p, 'default')})"
            for p in all_paths()]
