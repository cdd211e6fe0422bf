"""Example rows: `.jsonl`, `.json` (a list of rows) and `.parquet` files, and the kind of each row.

    is_example_file(path)            True for .jsonl / .json / .parquet
    read_rows(path, data_field)      -> [Row(kind, value, where), ...], one kind per file

A row's kind is read from its fields (a field whose value is null counts as absent, as
transformers drops None-valued keys):

    text                       {"text": "..."}                      plain text, trained whole
    messages                   {"messages": [{"role", "content"}]}  roles system / user / assistant
    pair                       {"prompt": ..., "completion": ...}   each a string or a message list
    preference                 {"prompt": ..., "chosen": ..., "rejected": ...}, or without the
                               prompt (TRL's implicit prompt): all strings or all message lists;
                               read for --objective dpo / orpo / simpo (jaxmem.data.preference)

`data_field="NAME"` reads every row as text from the string field NAME instead. A row of another
shape, a malformed JSON line, a missing or mistyped field, an unknown role, an empty chosen or
rejected answer, or a file that mixes kinds raises DataError naming the file, the line (`.jsonl`)
or row (`.json`, `.parquet`, 1-based) and the fields found. `read_rows(..., preference=True)`
wants preference rows and refuses any other kind; without it a preference row is refused with
the flag that trains on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jaxmem.data.errors import DataError

EXAMPLE_SUFFIXES = (".jsonl", ".json", ".parquet")
ROLES = ("system", "user", "assistant")
KIND_FIELDS = {"text": "text", "messages": "messages", "pair": "prompt + completion",
               "preference": "chosen + rejected"}
PREFERENCE_FLAG = "--objective dpo|orpo|simpo"


@dataclass(frozen=True)
class Row:
    """One example: kind "text" (value: str), "messages" (value: list of {role, content}),
    "pair" (value: (prompt, completion), each a str or a message list) or "preference" (value:
    (prompt or None, chosen, rejected), all str or all message lists); `where` is 'FILE line N'
    or 'FILE row N', for messages."""

    kind: str
    value: object
    where: str


def is_example_file(path) -> bool:
    return Path(path).suffix.lower() in EXAMPLE_SUFFIXES


def _records(path: Path):
    """(location, record) of each row in the file; DataError on unreadable input."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # noqa: PLC0415 (optional: the `parquet` extra)
        except ImportError:
            raise DataError(f"{path}: reading .parquet files needs pyarrow (pip install "
                            f"'jaxmem[parquet]')") from None
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError ...
            raise DataError(f"{path}: unreadable parquet file ({str(e).splitlines()[0]})") from None
        yield from ((f"{path} row {i + 1}", r) for i, r in enumerate(rows))
        return
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror or e}") from None
    if not text.strip():
        raise DataError(f"data file is empty: {path}")
    if suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {e.lineno}: invalid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(rows, list):
            raise DataError(f"{path}: a .json data file must hold a list of rows, got "
                            f"{type(rows).__name__}")
        yield from ((f"{path} row {i + 1}", r) for i, r in enumerate(rows))
        return
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue  # blank lines (a trailing newline) are not rows
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {n}: invalid JSON ({e.msg}, column {e.colno})") from None
        yield f"{path} line {n}", record


def _fields(record: dict) -> str:
    found = [str(k) for k, v in record.items() if v is not None]
    return ", ".join(found) if found else "none"


def _messages(value, where: str, what: str) -> list[dict]:
    """The validated message list `value` (copies with None-valued keys dropped)."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {what} must be a non-empty list of {{role, content}} messages, "
                        f"got {type(value).__name__ if value != [] else 'an empty list'}")
    out = []
    for i, m in enumerate(value, 1):
        if not isinstance(m, dict):
            raise DataError(f"{where}: {what} message {i} is a {type(m).__name__}, not a "
                            f"{{role, content}} object")
        m = {k: v for k, v in m.items() if v is not None}
        for key in ("role", "content"):
            if key not in m:
                raise DataError(f"{where}: {what} message {i} has no '{key}' field (fields "
                                f"found: {_fields(m)})")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: {what} message {i} has role {m['role']!r} (expected "
                            f"{', '.join(ROLES)})")
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: {what} message {i} has {type(m['content']).__name__} "
                            f"content; only string content is supported")
        out.append(m)
    return out


def _string(record: dict, key: str, where: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{key}' is a {type(value).__name__}, not a string")
    return value


def _preference(record: dict, present: set, where: str) -> tuple:
    """(prompt or None, chosen, rejected) of a preference row, validated: both answers present,
    every value a string or a message list, all of one type, no empty answer."""
    for key in ("chosen", "rejected"):
        if key not in present:
            raise DataError(f"{where}: a preference row has no '{key}' field (fields found: "
                            f"{_fields(record)})")
    for key in ("messages", "completion"):
        if key in present:
            raise DataError(f"{where}: a preference row with a '{key}' field (fields found: "
                            f"{_fields(record)}); give prompt + chosen + rejected, or chosen + "
                            f"rejected sharing their first messages")
    keys = [k for k in ("prompt", "chosen", "rejected") if k in present]
    for key in keys:
        if not isinstance(record[key], (str, list)):
            raise DataError(f"{where}: field '{key}' is a {type(record[key]).__name__}, not a "
                            f"string or a list of {{role, content}} messages")
    conversational = isinstance(record["chosen"], list)
    for key in keys:
        if isinstance(record[key], list) != conversational:
            raise DataError(f"{where}: field '{key}' is a {type(record[key]).__name__} but "
                            f"'chosen' is a {type(record['chosen']).__name__}; a preference row "
                            f"holds strings only or message lists only")
    values = {k: _messages(record[k], where, k) if conversational else record[k] for k in keys}
    for key in ("chosen", "rejected"):
        if not conversational and values[key] == "":
            raise DataError(f"{where}: field '{key}' is an empty string (an empty answer)")
        for i, m in enumerate(values[key] if conversational else [], 1):
            if m["role"] == "assistant" and m["content"] == "":
                raise DataError(f"{where}: {key} message {i} (assistant) has empty content (an "
                                f"empty answer)")
    return values.get("prompt"), values["chosen"], values["rejected"]


def classify(record, where: str, data_field: str | None = None) -> Row:
    """The Row of one record (see the module docstring)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(record).__name__}")
    present = {k for k, v in record.items() if v is not None}
    if data_field is not None:
        if data_field not in present:
            raise DataError(f"{where}: no field '{data_field}' (--data-field; fields found: "
                            f"{_fields(record)})")
        return Row("text", _string(record, data_field, where), where)
    if "chosen" in present or "rejected" in present:
        return Row("preference", _preference(record, present, where), where)
    if "messages" in present:
        return Row("messages", _messages(record["messages"], where, "messages"), where)
    if "prompt" in present or "completion" in present:
        for key in ("prompt", "completion"):
            if key not in present:
                raise DataError(f"{where}: a prompt/completion row has no '{key}' field (fields "
                                f"found: {_fields(record)})")
        pair = tuple(record[k] if isinstance(record[k], str) else _messages(record[k], where, k)
                     for k in ("prompt", "completion"))
        return Row("pair", pair, where)
    if "text" in present:
        return Row("text", _string(record, "text", where), where)
    raise DataError(f"{where}: unknown row shape (fields found: {_fields(record)}); expected "
                    f"text, messages, or prompt + completion (--data-field NAME reads another "
                    f"text field)")


def read_rows(path, data_field: str | None = None, *, preference: bool = False) -> list[Row]:
    """The rows of one example file, all of one kind (DataError otherwise): preference rows
    when `preference`, any other kind when not."""
    path = Path(path)
    rows: list[Row] = []
    for where, record in _records(path):
        row = classify(record, where, data_field)
        if rows and row.kind != rows[0].kind:
            first = rows[0].where.rsplit(" ", 2)
            raise DataError(f"{where}: a {KIND_FIELDS[row.kind]} row in a file of "
                            f"{KIND_FIELDS[rows[0].kind]} rows (since {first[-2]} {first[-1]}); "
                            f"one kind of row per file (fields found: {_fields(record)})")
        if preference and row.kind != "preference":
            raise DataError(f"{where}: the data has no chosen / rejected answers: a "
                            f"{KIND_FIELDS[row.kind]} row (fields found: {_fields(record)}); "
                            f"preference training wants prompt + chosen + rejected rows")
        if not preference and row.kind == "preference":
            raise DataError(f"{where}: a preference row (chosen / rejected answers; fields found: "
                            f"{_fields(record)}); train on it with {PREFERENCE_FLAG}")
        rows.append(row)
    if not rows:
        raise DataError(f"data file has no rows: {path}")
    return rows
