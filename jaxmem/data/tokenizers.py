"""Tokenizers: byte-level (default) and Hugging Face checkpoints' (`tokenizer.json` and the files
beside it, followed as transformers follows them: jaxmem.data.special_tokens).

    load_tokenizer(path | None, bos_token=, eos_token=, pad_token=) -> ByteTokenizer or HFTokenizer

Both give the same attributes: vocab_size, bos_id (None: no BOS), eos_id, pad_id, prefix_ids,
stop_ids, and encode / encode_array / encode_offsets / encode_prompt / document_ids / decode.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from jaxmem.families.config import BOS_TOKEN_ID, BYTE_VOCAB_SIZE, EOS_TOKEN_ID, PAD_TOKEN_ID
from jaxmem.data.errors import DataError
from jaxmem.data.special_tokens import TokenizerFiles, ids_of, tokenizer_json

# ----------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; PAD, BOS, EOS follow (ids from `jaxmem.families.config`)."""

    name = "bytes"
    vocab_size = BYTE_VOCAB_SIZE
    pad_id = PAD_TOKEN_ID
    bos_id = BOS_TOKEN_ID
    eos_id = EOS_TOKEN_ID
    prefix_ids = [BOS_TOKEN_ID]
    stop_ids = (EOS_TOKEN_ID,)
    generation_ids = {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID}
    notes: tuple = ()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """`encode` as an int32 array, without a Python list (fast for megabytes of text)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, [(start, end) character offsets of each id in `text`]): a byte's character."""
        ids, offsets = [], []
        for i, ch in enumerate(text):
            b = ch.encode("utf-8")
            ids.extend(b)
            offsets.extend([(i, i + 1)] * len(b))
        return ids, offsets

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids: BOS, then the text (as the corpus's documents start)."""
        return [self.bos_id] + self.encode(text)

    def document_ids(self) -> tuple[list[int], list[int]]:
        """(ids before, ids after) a text document in a training stream: BOS, EOS."""
        return [self.bos_id], [self.eos_id]

    def decode(self, ids) -> str:
        """Bytes to text; special ids (>= 256) are skipped, invalid UTF-8 becomes U+FFFD."""
        arr = np.asarray(ids, dtype=np.int64).ravel()
        return arr[(arr >= 0) & (arr < 256)].astype(np.uint8).tobytes().decode("utf-8", "replace")


# Bare tokenizer.json files (no tokenizer_config.json beside them): BOS / EOS / PAD guessed among
# the usual names of *special* added tokens, the more specific names first (Gemma's vocabulary
# holds <s> and </s> as ordinary tokens: never guessed, they are not special there).
_BOS_NAMES = ("<|begin_of_text|>", "<bos>", "<s>", "[BOS]", "<|startoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "<eos>", "</s>", "[EOS]", "<|endoftext|>", "<|eot_id|>")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")
TOKEN_FLAGS = "--bos-token / --eos-token / --pad-token"
TOKEN_NAMES = ("bos_token", "eos_token", "pad_token")  # load_tokenizer's keywords, and the flags'



class HFTokenizer:
    """A Hugging Face tokenizer: `tokenizer.json` and the files beside it (a checkpoint's).

    `path` is the tokenizer.json or its directory. The special tokens follow the checkpoint
    (jaxmem.data.special_tokens): tokenizer_config.json's / special_tokens_map.json's names, else
    config.json's ids; only a bare tokenizer.json has its BOS / EOS / PAD guessed by name, said
    in `notes`. Given names (the --bos-token / --eos-token / --pad-token flags) win over both.

    bos_id: None when the checkpoint has no BOS (Qwen). eos_id: the EOS a text document ends
        with. pad_id: the PAD, else EOS (padded targets are masked out: only a valid id).
    prefix_ids: what the tokenizer puts in front of a text (its post-processor: [BOS] for Llama
        3, Mistral, Gemma; nothing for Qwen and SmolLM2); a bare file without a post-processor
        gets [BOS] (jaxmem's rule before checkpoints were followed).
    stop_ids: the ids generation stops at (generation_config.json's eos_token_id ...).
    generation_ids: the checkpoint's generation config ids, for an export's config files.

    `tokenizers` is an optional package, imported only here.
    """

    name = "hf"

    def __init__(self, path, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None):
        self.path = str(tokenizer_json(path))
        if not os.path.isfile(self.path):
            raise DataError(f"tokenizer file not found: {self.path}")
        try:
            import tokenizers  # noqa: PLC0415 (optional dependency)
        except ImportError:
            raise DataError(f"cannot load tokenizer {self.path}: the optional 'tokenizers' "
                            "package is not installed (pip install tokenizers)") from None
        try:
            self._tok = tokenizers.Tokenizer.from_file(self.path)
        except Exception as e:  # the Rust side raises plain Exception subclasses
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"invalid tokenizer file {self.path}: {first}") from None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.files = TokenizerFiles.read(Path(self.path).parent)
        self.notes: list[str] = []
        given = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token}
        names = self._names(given)
        self.bos_id = self._id(names["bos_token"], "BOS", given["bos_token"])
        self.eos_id = self._id(names["eos_token"], "EOS", given["eos_token"])
        pad = self._id(names["pad_token"], "PAD", given["pad_token"])
        self.pad_id = self.eos_id if pad is None else pad
        self.special_names = {k: v for k, v in names.items() if v is not None}
        self.prefix_ids, self.suffix_ids = self._added_by_post_processor()
        self.stop_ids = self.files.stop_ids(self.eos_id)
        self.generation_ids = self.files.generation_ids()

    def _names(self, given: dict) -> dict:
        """{bos_token, eos_token, pad_token: name or None} (see the class docstring)."""
        f = self.files
        if f.has_tokenizer_files:
            names = {k: f.tokens.get(k) for k in given}
            if names["eos_token"] is None:  # a tokenizer_config.json naming no EOS
                names["eos_token"] = self._token_of(f.generation.get("eos_token_id")
                                                    or f.model_ids.get("eos_token_id"))
        elif f.model_ids:  # tokenizer.json + a model config.json only: its ids
            names = {k: self._token_of(f.model_ids.get(k + "_id")) for k in given}
        else:
            names = {"bos_token": self._guess(_BOS_NAMES), "eos_token": self._guess(_EOS_NAMES),
                     "pad_token": self._guess(_PAD_NAMES)}
            if names["eos_token"] is None and given["eos_token"] is None:
                raise DataError(
                    f"tokenizer {self.path}: no tokenizer_config.json beside it and none of the "
                    f"usual EOS names ({', '.join(_EOS_NAMES)}) is a special token; name its "
                    f"special tokens with {TOKEN_FLAGS}, or put the checkpoint's "
                    f"tokenizer_config.json beside it")
            self.notes.append(
                f"tokenizer {self.path}: no tokenizer_config.json beside it; special tokens "
                f"guessed by name: BOS {names['bos_token']}, EOS {names['eos_token']}, PAD "
                f"{names['pad_token'] or names['eos_token']} (set them with {TOKEN_FLAGS})")
        return {k: given[k] if given[k] is not None else names[k] for k in given}

    def _token_of(self, value):
        ids = ids_of(value)
        return self._tok.id_to_token(ids[0]) if ids else None

    def _guess(self, candidates):
        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        return next((n for n in candidates if n in special), None)

    def _id(self, name, what: str, given) -> int | None:
        if name is None:
            return None
        idx = self._tok.token_to_id(name)
        if idx is not None:
            return int(idx)
        flag = f"--{what.lower()}-token"
        if given is not None:
            raise DataError(f"tokenizer {self.path}: {flag} {given!r} is not in its vocabulary")
        raise DataError(f"tokenizer {self.path}: {self.files.tokens_from or 'config.json'} names "
                        f"{what} {name!r}, which is not in its vocabulary (name the token with "
                        f"{flag})")

    def _added_by_post_processor(self) -> tuple[list[int], list[int]]:
        """(ids put before, ids put after) a text by the file's post-processor; a bare file
        without one: ([BOS], [])."""
        if self._tok.post_processor is None:
            bare = not self.files.has_tokenizer_files and not self.files.model_ids
            return ([self.bos_id] if bare and self.bos_id is not None else []), []
        body = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        for start in range(len(full) - len(body) + 1):
            if full[start:start + len(body)] == body:
                return list(full[:start]), list(full[start + len(body):])
        return [], []

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int32)

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        """`encode_array` of each text, encoded as one batch (the tokenizers library spreads a
        batch over the machine's cores; each text's ids are those it gets alone)."""
        return [np.asarray(e.ids, dtype=np.int32)
                for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, [(start, end) character offsets of each id in `text`]), without special tokens
        added (special tokens written in the text, such as a chat template's, are matched)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return list(enc.ids), list(enc.offsets)

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids as transformers' `tokenizer(text)` gives them: the text with what the
        post-processor adds (Llama 3's <|begin_of_text|>, nothing for Qwen)."""
        return self.prefix_ids + self.encode(text) + self.suffix_ids

    def document_ids(self) -> tuple[list[int], list[int]]:
        """(ids before, ids after) a text document in a training stream: the tokenizer's own
        prefix, and its suffix or else EOS (documents are separated by EOS)."""
        return self.prefix_ids, self.suffix_ids or [self.eos_id]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).ravel()],
                                skip_special_tokens=True)


def load_tokenizer(path=None, bos_token: str | None = None, eos_token: str | None = None,
                   pad_token: str | None = None):
    """`ByteTokenizer()` for None, else the checkpoint's `HFTokenizer` (a tokenizer.json, or the
    directory holding it), with any special tokens named by the caller (the CLI's flags)."""
    if path is None:
        return ByteTokenizer()
    return HFTokenizer(path, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token)


def section_tokenizer(section, path):
    """load_tokenizer(path) with the special tokens a run's data section names (--bos-token,
    --eos-token, --pad-token; None: the checkpoint's)."""
    return load_tokenizer(path, **{k: getattr(section, k, None) for k in TOKEN_NAMES})
