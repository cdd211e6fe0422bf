"""The last token stream `jaxmem.data.sources` made, kept for a process that loads the same corpus
again (a resumed run in the same process, the test suite's many runs).

    key = memo_key(files, tokenizer, vocab_size)   None: nothing to stamp (the byte tokenizer)
    recall(key)                                    (stream copy, read stats) or None
    keep(key, stream, read)                        replaces the one kept (streams <= MEMO_BYTES)

A key is the files' paths, sizes and modification times, the tokenizer file's, the tokenizer's
document prefix and suffix ids, and the vocabulary size: a file changed on disk is read again.
Only streams up to MEMO_BYTES are kept, so a large corpus is not held twice.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

MEMO_BYTES = 256 << 20
_KEPT: dict = {}  # at most one entry: {key: (stream, read)}


def _stamp(path) -> tuple:
    st = os.stat(path)
    return str(path), st.st_size, st.st_mtime_ns


def memo_key(files: list[Path], tokenizer, vocab_size: int):
    """The key of a stream, or None where the tokenizer has no file to stamp (the byte tokenizer
    is fast anyway) or a file cannot be stat'ed."""
    path = getattr(tokenizer, "path", None)
    if path is None:
        return None
    try:
        return (tuple(map(_stamp, files)), _stamp(path),
                tuple(map(tuple, tokenizer.document_ids())), int(vocab_size))
    except OSError:
        return None


def recall(key):
    """(a copy of the kept stream, its read stats) for `key`, or None."""
    if key is None or key not in _KEPT:
        return None
    stream, read = _KEPT[key]
    return stream.copy(), read


def keep(key, stream: np.ndarray, read) -> None:
    """Keep a copy of `stream` under `key` in place of the one kept (not over MEMO_BYTES)."""
    if key is not None and stream.nbytes <= MEMO_BYTES:
        _KEPT.clear()
        _KEPT[key] = (stream.copy(), read)


def forget() -> None:
    """Drop the kept stream."""
    _KEPT.clear()
