"""Run-config fields with their CLI metadata (`option`) and the integer check the sections share.

Its own module so that each section module (jaxmem.config.run, jaxmem.config.data) can declare
its fields without importing the others (jaxmem.config.sample too).
"""

from __future__ import annotations

from dataclasses import field

from jaxmem.errors import ConfigError


def option(default, help: str, *, flags: tuple[str, ...] | None = None, type=None, choices=None,
           metavar: str | None = None, mutable: bool = False, cli: bool = True,
           store_true: bool = False):
    """A dataclass field with its CLI metadata.

    flags: option strings (default `--field-name`); each also names the field in a schema-1
        config.json (whose keys were the train CLI's flag names). mutable: a resumed run may change it (recorded in config.json).
    cli: False for fields that are configuration but no flag (Adam's betas, for instance).
    """
    return field(default=default, metadata=dict(
        help=help, flags=flags, type=type, choices=choices, metavar=metavar, mutable=mutable,
        cli=cli, store_true=store_true))


def _positive(name: str, value, allow_none: bool = False, allow_zero: bool = False) -> None:
    if value is None and allow_none:
        return
    ok = isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ConfigError(f"{name} must be {'an integer >= 0' if allow_zero else 'a positive integer'}, "
                          f"got {value!r}")
