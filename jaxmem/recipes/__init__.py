"""Recipes: one YAML file per tested configuration, shipped with the package
(`python -m jaxmem.recipes` lists them, `python -m jaxmem.recipes show NAME` prints one;
`python -m jaxmem.train --recipe NAME` runs one; docs/recipes.md).

A recipe file is a YAML mapping whose keys are RunConfig sections exactly as
`RunConfig.to_dict()` writes them (`model:`, `precision:`, `remat:`, `optim:`, `data:`, `peft:`,
`parallel:`, `objective:` ..., each a mapping of that section's field names to the values that
differ from the defaults), plus two metadata keys: `card` (a jaxmem.target card name: the GPU the
recipe was planned for) and `description` (one line). A fine-tuning recipe names its model's
preset (`model.preset`) for planning only: `--init-from HF_DIR` replaces the model section with
the checkpoint's, and it never sets `init.init_from` or `data.data` (the user gives them).

    recipe_path(name)  the file (ConfigError naming the nearest names for an unknown one)
    names()            every recipe, sorted
    load(name)         the file's mapping; `sections(name)` without the metadata keys
    run_config(name)   the RunConfig its sections make (defaults elsewhere)
"""

from __future__ import annotations

import difflib
from pathlib import Path

from jaxmem.errors import ConfigError

HERE = Path(__file__).resolve().parent
METADATA = ("card", "description")  # the top-level keys that are not RunConfig sections

__all__ = ["METADATA", "load", "names", "recipe_path", "run_config", "sections"]


def names() -> list[str]:
    """Every shipped recipe's name (its file name without `.yaml`), sorted."""
    return sorted(p.stem for p in HERE.glob("*.yaml"))


def recipe_path(name: str) -> Path:
    """The YAML file of recipe `name`; ConfigError naming it and the nearest names if unknown."""
    path = HERE / f"{name}.yaml"
    if name in names():
        return path
    near = difflib.get_close_matches(name, names(), n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(near)}?" if near else ""
    raise ConfigError(f"unknown recipe {name!r}{hint} (python -m jaxmem.recipes lists them)")


def load(name: str) -> dict:
    """The recipe's mapping as its file writes it (sections and metadata), checked for shape:
    a mapping with `card` and `description`, every other key a RunConfig section of mappings."""
    import yaml  # noqa: PLC0415  (pyyaml: only where a recipe is read)

    from jaxmem.config.run import RunConfig  # noqa: PLC0415

    path = recipe_path(name)
    d = yaml.safe_load(path.read_text())
    if not isinstance(d, dict):
        raise ConfigError(f"recipe {name!r} ({path}) is not a YAML mapping")
    missing = [k for k in METADATA if not isinstance(d.get(k), str)]
    unknown = sorted(set(d) - set(METADATA) - set(RunConfig.sections()))
    bad = sorted(k for k in d if k not in METADATA and not isinstance(d[k], dict))
    if missing or unknown or bad:
        raise ConfigError(f"recipe {name!r} ({path}): " + "; ".join(
            part for part in (missing and f"no {' / '.join(missing)} (a string)",
                              unknown and f"unknown section(s) {', '.join(unknown)}",
                              bad and f"section(s) {', '.join(bad)} not a mapping") if part))
    return d


def sections(name: str) -> dict:
    """The recipe's RunConfig sections ({section: {field: value}}), metadata left out."""
    return {k: v for k, v in load(name).items() if k not in METADATA}


def run_config(name: str):
    """The RunConfig of the recipe: its sections over the defaults (`RunConfig.from_dict`)."""
    from jaxmem.config.run import SCHEMA_VERSION, RunConfig  # noqa: PLC0415

    return RunConfig.from_dict({"schema_version": SCHEMA_VERSION, **sections(name)})
