"""Data sources and corpus loading (the `--data` flag), and the pipeline this package implements.

The pipeline, top to bottom:

    load_tokenizer(path | None)              -> ByteTokenizer (default) or the checkpoint's HFTokenizer
    load_corpus(data | None, tok, vocab)     -> (train_tokens, eval_tokens, stats)
    Batcher(train_tokens, B, T, seed).batch_at(position)  -> {"inputs", "targets", "mask"}
    eval_batches(eval_tokens, B, T, max_batches)           -> [batch, ...]

A batch is a dict of int32 numpy arrays [B, T] (see `jaxmem.train.loss`): `inputs`, `targets` and
`mask` (1 for a real target, 0 for padding).

Sources (`data`, the `--data` flag): a file, a directory (read recursively, files sorted by
path, hidden files and directories skipped), or a glob pattern (`**` allowed); several of these
may be joined with commas. Each file is one of:

  * text (any other suffix): read as UTF-8; bytes that are not valid UTF-8 are decoded with
    errors='replace' and counted in `stats["invalid_utf8_replacements"]` (one per replaced
    run, Python's rule), never an error. A text file is one document: BOS + tokens + EOS.
  * `*.bin`: raw token ids, native byte order, uint16; a name ending in `.u32.bin` is uint32.
    The file is taken verbatim as a token stream (no BOS/EOS added: pre-tokenized files keep
    their own document separators).
  * `*.npy`: a 1-D integer array, loaded with `np.load(path, mmap_mode='r',
    allow_pickle=False)` (no pickle, ever) and also taken verbatim.

`data=None` is the built-in corpus: the `*.py` files directly in the Python standard library
directory, in name order, capped at `default_corpus_bytes`. It needs no download and loads in
well under a second, but it differs slightly between Python versions, so `stats` records the
Python version, its size in bytes and the sha256 of the token stream.

Batches are a pure function of (tokens, seed, batch_size, seq_len, position): the stream is cut
into windows of T + 1 tokens with stride T (window j starts at token j*T; the last window is
right-padded with PAD when the stream does not fill it), each epoch visits every window once in
the order of a permutation drawn from `np.random.Generator(np.random.PCG64([seed, epoch]))`, and
batch `position` holds samples position*B ... position*B + B - 1 of that endless sequence.
Resuming from a saved position therefore yields exactly the batches an uninterrupted run sees.
"""

from __future__ import annotations

import glob
import math
import hashlib
import os
import sys
import sysconfig
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jaxmem.data.checks import BINARY_SHARE, binary_share, dedupe_files
from jaxmem.data.errors import DataError
from jaxmem.data.examples import PackedData, load_examples
from jaxmem.data.formats import PREFERENCE_FLAG, is_example_file
from jaxmem.data.preference import PreferencePairs, load_preferences
from jaxmem.data.stream_memo import keep, memo_key, recall

DEFAULT_CORPUS_BYTES = 8_000_000
DEFAULT_EVAL_FRACTION = 0.05
_REPLACEMENT = "\ufffd"
_GLOB_CHARS = set("*?[")


# ----------------------------------------------------------------------------- sources


def resolve_sources(data: str) -> list[Path]:
    """The files named by `data`: a file, a directory (recursive, sorted, hidden entries
    skipped), a glob, or a comma-separated list of these. Raises DataError naming what matched
    nothing."""
    if not data or not str(data).strip():
        raise DataError("--data is empty")
    parts = [str(data)] if os.path.exists(data) else [p.strip() for p in str(data).split(",")]
    files: list[Path] = []
    for part in parts:
        if not part:
            continue
        p = Path(part)
        if p.is_dir():
            found = sorted(
                f for f in p.rglob("*")
                if f.is_file() and not any(s.startswith(".") for s in f.relative_to(p).parts))
            if not found:
                raise DataError(f"data directory has no files: {p}")
            files.extend(found)
        elif p.exists():
            files.append(p)
        elif _GLOB_CHARS & set(part):
            found = sorted(Path(f) for f in glob.glob(part, recursive=True) if os.path.isfile(f))
            if not found:
                raise DataError(f"data glob matched no files: {part}")
            files.extend(found)
        else:
            raise DataError(f"data file not found: {part}")
    return files


def _read_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror or e}") from None
    if not raw:
        raise DataError(f"data file is empty: {path}")
    return raw


def decode_utf8(raw: bytes) -> tuple[str, int]:
    """(text, number of U+FFFD replacements made for invalid UTF-8)."""
    text = raw.decode("utf-8", errors="replace")
    # Each replacement inserts one U+FFFD; genuine U+FFFD characters are exactly the valid
    # EF BF BD sequences in the input, so the difference counts the replacements exactly.
    return text, text.count(_REPLACEMENT) - raw.count(_REPLACEMENT.encode("utf-8"))


def load_token_file(path, vocab_size: int) -> np.ndarray:
    """The token ids of a `.bin` / `.u32.bin` / `.npy` file as a (memory-mapped) 1-D array.

    Raises DataError naming the file when it is missing, empty, malformed, or holds an id
    outside [0, vocab_size).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"token file not found: {path}")
    try:
        size = path.stat().st_size
        if size == 0:
            raise DataError(f"token file is empty: {path}")
        if path.suffix == ".npy":
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        else:
            dtype = np.dtype(np.uint32 if path.name.endswith(".u32.bin") else np.uint16)
            if size % dtype.itemsize:
                raise DataError(f"token file {path} has {size} bytes, not a multiple of "
                                f"{dtype.itemsize} ({dtype.name})")
            arr = np.memmap(path, dtype=dtype, mode="r")
    except DataError:
        raise
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read token file {path}: {str(e).splitlines()[0]}") from None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"token file {path} must hold a 1-D integer array, got "
                        f"{arr.dtype} with shape {arr.shape}")
    if arr.size == 0:
        raise DataError(f"token file is empty: {path}")
    lo, hi = int(arr.min()), int(arr.max())
    if hi >= vocab_size:
        raise DataError(f"token file {path} has token id {hi} >= vocab size {vocab_size}")
    if lo < 0:
        raise DataError(f"token file {path} has negative token id {lo}")
    return arr


def _is_token_file(path: Path) -> bool:
    return path.suffix in (".bin", ".npy")


def default_corpus_files(max_bytes: int = DEFAULT_CORPUS_BYTES) -> list[Path]:
    """The built-in corpus: stdlib `*.py` files (top level only) in name order, as many as fit
    in `max_bytes` (stops at the first file that would overflow it)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for f in sorted(p for p in stdlib.glob("*.py") if p.is_file()):
        size = f.stat().st_size
        if total + size > max_bytes:
            break
        files.append(f)
        total += size
    if not files:
        raise DataError(f"no *.py files within {max_bytes} bytes in the stdlib directory {stdlib}")
    return files


# ----------------------------------------------------------------------------- corpus


def load_corpus(data: str | None, tokenizer, vocab_size: int, *,
                eval_fraction: float = DEFAULT_EVAL_FRACTION, seq_len: int = 512,
                default_corpus_bytes: int = DEFAULT_CORPUS_BYTES, **example_options):
    """(train_tokens, eval_tokens, stats): int32 1-D arrays and a JSON-able dict.

    Documents are concatenated in file order. Eval is the tail of the stream: the last
    `eval_fraction` of it, at least one window (seq_len + 1 tokens) but never more than half
    the stream; `eval_fraction=0` gives an empty eval split.

    Example files (.jsonl / .json / .parquet) give `PackedData` splits instead of token arrays
    (jaxmem.data.examples; `example_options`: data_field, chat_template, train_on, truncate,
    pack); they cannot be mixed with text or token files. With `preference="dpo"` or `"cpo"`
    (TRL's DPOTrainer's or CPO / ORPOTrainer's tokenization) they are preference rows and give
    `PreferencePairs` splits (jaxmem.data.preference; options chat_template, max_prompt_length;
    train_on, truncate and pack do not apply to pairs). Batches of any: `train_batcher`,
    `split_eval_batches`.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}")
    eval_data = example_options.pop("eval_data", None)
    if eval_data is not None:  # --eval-data: all of --data trains, all of eval_data evaluates
        return _load_with_eval_data(data, eval_data, tokenizer, vocab_size, seq_len=seq_len,
                                    default_corpus_bytes=default_corpus_bytes, **example_options)
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len!r}")
    if tokenizer.vocab_size > vocab_size:
        raise DataError(f"tokenizer {getattr(tokenizer, 'path', tokenizer.name)} has "
                        f"{tokenizer.vocab_size} ids but the model vocab size is {vocab_size}")
    files = default_corpus_files(default_corpus_bytes) if data is None else resolve_sources(data)
    files, duplicates = dedupe_files(files)  # a file reached through a symlink is read once
    if any(is_example_file(f) for f in files):
        return _load_example_files(data, files, duplicates, tokenizer, vocab_size, seq_len=seq_len,
                                   eval_fraction=eval_fraction, **example_options)
    if example_options.get("data_field") is not None:
        raise DataError(f"--data-field {example_options['data_field']} needs example rows "
                        f"(.jsonl, .json, .parquet); {files[0]} is not one")
    if example_options.get("preference") is not None:
        raise DataError(f"preference training ({PREFERENCE_FLAG}) needs prompt + chosen + "
                        f"rejected rows (.jsonl, .json, .parquet); {files[0]} is not one")
    stream, read = _token_stream(files, tokenizer, vocab_size)
    n = stream.size
    if n < 2:
        raise DataError(f"corpus {data!r} has {n} token(s); at least 2 are needed")
    n_eval = 0
    if eval_fraction > 0:
        n_eval = min(max(math.ceil(eval_fraction * n), seq_len + 1), n // 2)
    train, evals = stream[:n - n_eval], stream[n - n_eval:]
    stats = {"source": "default:stdlib" if data is None else str(data), "files": len(files),
             **read.counts(n, evals.size), "duplicate_files_skipped": duplicates[:20],
             "tokens_sha256": hashlib.sha256(stream.tobytes()).hexdigest(),
             "tokenizer": getattr(tokenizer, "path", tokenizer.name),
             "vocab_size": int(vocab_size)}
    if data is None:
        stats["python_version"] = ".".join(map(str, sys.version_info[:3]))
        stats["stdlib_dir"] = str(files[0].parent)
        stats["default_corpus_bytes"] = int(default_corpus_bytes)
    return train, evals, stats


def _load_with_eval_data(data, eval_data, tokenizer, vocab_size: int, **options):
    """`--eval-data`: all of `data` trains, all of `eval_data` evaluates; the stats are the train
    data's, with the held-out data's counts and one sha256 over both."""
    kw = dict(eval_fraction=0.0, **options)
    train, _, stats = load_corpus(data, tokenizer, vocab_size, **kw)
    evals, _, ev = load_corpus(eval_data, tokenizer, vocab_size, **kw)
    digest = hashlib.sha256((stats["tokens_sha256"] + ev["tokens_sha256"]).encode())
    held_out = {"eval_source": str(eval_data), "eval_tokens": ev["train_tokens"],
                "tokens_sha256": digest.hexdigest()}
    if ev.get("format") == "examples":
        held_out.update(eval_examples=ev["train_examples"], eval_rows=ev["train_rows"],
                        eval_trained_tokens=ev["trained_tokens"],
                        eval_masked_tokens=ev["masked_tokens"])
    if ev.get("format") == "preference":
        held_out.update(eval_pairs=ev["train_pairs"], eval_rows=ev["rows"],
                        eval_completion_tokens=ev["completion_tokens"],
                        eval_prompt_tokens=ev["prompt_tokens"])
    return train, evals, {**stats, **held_out}


def _load_example_files(data, files: list[Path], duplicates, tokenizer, vocab_size: int,
                        **options):
    """Example rows (jaxmem.data.examples.load_examples): `PackedData` splits and their stats, or
    with `preference` set, preference rows (jaxmem.data.preference.load_preferences):
    `PreferencePairs` splits; refused when `files` mixes them with text or token files."""
    examples = [f for f in files if is_example_file(f)]
    others = [f for f in files if not is_example_file(f)]
    if others:
        raise DataError(f"--data mixes example rows ({examples[0]}) with text or token files "
                        f"({others[0]}); give one kind")
    preference = options.pop("preference", None)
    max_prompt_length = options.pop("max_prompt_length", None)
    if preference is not None:
        if options.get("data_field") is not None:
            raise DataError(f"--data-field {options['data_field']} reads text rows; preference "
                            f"training ({PREFERENCE_FLAG}) reads prompt + chosen + rejected rows")
        train, evals, stats = load_preferences(
            files, tokenizer, vocab_size, seq_len=options["seq_len"],
            eval_fraction=options["eval_fraction"], style=preference,
            max_prompt_length=max_prompt_length, chat_template=options.get("chat_template"))
    elif max_prompt_length is not None:
        raise DataError(f"a max prompt length ({max_prompt_length}) applies to preference rows "
                        f"({PREFERENCE_FLAG}) only")
    else:
        train, evals, stats = load_examples(files, tokenizer, vocab_size, **options)
    return train, evals, {"source": str(data), "files": len(files), **stats,
                          "duplicate_files_skipped": duplicates[:20],
                          "tokenizer": getattr(tokenizer, "path", tokenizer.name),
                          "vocab_size": int(vocab_size)}


class _Read(NamedTuple):
    """What reading the text and token files found, for the stats."""

    documents: int
    bytes: int
    bad: int  # invalid UTF-8 sequences replaced
    bad_files: list[str]
    binary_looking: dict[str, float]

    def counts(self, n_tokens: int, n_eval: int) -> dict:
        """The stats' counts, in their order, for a stream of `n_tokens` with `n_eval` held out."""
        return {"documents": self.documents, "bytes": self.bytes, "tokens": int(n_tokens),
                "train_tokens": int(n_tokens - n_eval), "eval_tokens": int(n_eval),
                "invalid_utf8_replacements": self.bad,
                "files_with_invalid_utf8": self.bad_files[:20],
                "binary_looking_files": dict(list(self.binary_looking.items())[:20])}


BATCH_BYTES = 16 << 20  # text encoded per call of a tokenizer's batch encoder, at most


def _token_stream(files: list[Path], tokenizer, vocab_size: int) -> tuple[np.ndarray, _Read]:
    """One int32 stream of every file in order: a text file as the tokenizer's document prefix
    (BOS where the checkpoint's tokenizer adds one), its tokens, EOS; a token file as it is.
    Text is encoded in batches of up to BATCH_BYTES (a tokenizer's `encode_arrays`, which HF
    tokenizers run on every core; the ids are those of encoding each file alone). The same
    corpus loaded again in one process is taken from `jaxmem.data.stream_memo`."""
    key = memo_key(files, tokenizer, vocab_size)
    if (kept := recall(key)) is not None:
        return kept
    pieces: list = []
    before, after = (np.asarray(x, np.int32) for x in tokenizer.document_ids())
    n_bytes = n_docs = n_bad = 0
    bad_files: list[str] = []
    binary_looking: dict[str, float] = {}
    batch: list = []  # (index into pieces, file, text) waiting to be encoded
    batch_bytes = 0  # their UTF-8 bytes

    def encode_batch():
        if not batch:
            return
        texts = [t for _, _, t in batch]
        many = getattr(tokenizer, "encode_arrays", None)
        for (at, f, _), ids in zip(batch, many(texts) if many else map(tokenizer.encode_array,
                                                                            texts)):
            if ids.size and int(ids.max()) >= vocab_size:
                raise DataError(f"tokenizing {f} gave token id {int(ids.max())} >= vocab size "
                                f"{vocab_size}")
            pieces[at] = ids
        batch.clear()

    for f in files:
        if _is_token_file(f):
            arr = load_token_file(f, vocab_size)
            n_bytes += arr.nbytes
            pieces.append(np.asarray(arr, dtype=np.int32))
            continue
        raw = _read_bytes(f)
        text, bad = decode_utf8(raw)
        if bad:
            n_bad += bad
            bad_files.append(str(f))
            if binary_share(len(raw), bad) > BINARY_SHARE:
                binary_looking[str(f)] = round(binary_share(len(raw), bad), 4)
        n_bytes += len(raw)
        n_docs += 1
        pieces.extend([before, None, after])
        batch.append((len(pieces) - 2, f, text))
        batch_bytes += len(raw)
        if batch_bytes >= BATCH_BYTES:
            encode_batch()
            batch_bytes = 0
    encode_batch()
    stream = np.concatenate(pieces).astype(np.int32, copy=False)
    read = _Read(n_docs, n_bytes, n_bad, bad_files, binary_looking)
    keep(key, stream, read)
    return stream, read


def train_batcher(train, batch_size: int, seq_len: int, seed: int, *, pad_id: int):
    """The training batches of a split from `load_corpus`: `Batcher` over a token stream,
    `PackedBatcher` over packed examples, `PreferenceBatcher` over preference pairs ([2B, T]:
    B pairs); all have `batch_at(position)`."""
    from jaxmem.data.batches import Batcher  # noqa: PLC0415

    if isinstance(train, (PackedData, PreferencePairs)):
        return train.batcher(batch_size, seq_len, seed, pad_id)
    return Batcher(train, batch_size, seq_len, seed, pad_id=pad_id)


def split_eval_batches(evals, batch_size: int, seq_len: int, max_batches=None, *, pad_id: int):
    """The eval batches of a split from `load_corpus` (`eval_batches` for a token stream)."""
    from jaxmem.data.batches import eval_batches  # noqa: PLC0415

    if isinstance(evals, (PackedData, PreferencePairs)):
        return evals.eval_batches(batch_size, seq_len, max_batches, pad_id)
    return eval_batches(evals, batch_size, seq_len, max_batches, pad_id=pad_id)
