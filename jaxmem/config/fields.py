"""`option`: a dataclass field with its CLI metadata, for RunConfig's sections.

Its own module so that a section may live in a module of its own (jaxmem.config.sample) and be
re-exported from jaxmem.config.run without an import cycle.
"""

from __future__ import annotations

from dataclasses import field


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
