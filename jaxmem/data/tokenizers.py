"""Tokenizers: byte-level (default) and Hugging Face `tokenizers` JSON files.

    load_tokenizer(path | None) -> ByteTokenizer (default) or HFTokenizer
"""

from __future__ import annotations

import os

import numpy as np

from jaxmem.config.model import BOS_TOKEN_ID, BYTE_VOCAB_SIZE, EOS_TOKEN_ID, PAD_TOKEN_ID
from jaxmem.data.errors import DataError

# ----------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; PAD, BOS, EOS follow (ids from `jaxmem.config.model`)."""

    name = "bytes"
    vocab_size = BYTE_VOCAB_SIZE
    pad_id = PAD_TOKEN_ID
    bos_id = BOS_TOKEN_ID
    eos_id = EOS_TOKEN_ID

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

    def decode(self, ids) -> str:
        """Bytes to text; special ids (>= 256) are skipped, invalid UTF-8 becomes U+FFFD."""
        arr = np.asarray(ids, dtype=np.int64).ravel()
        return arr[(arr >= 0) & (arr < 256)].astype(np.uint8).tobytes().decode("utf-8", "replace")


_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>", "<|eot_id|>")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file (`tokenizer.json`).

    `tokenizers` is an optional package, imported only here. BOS/EOS are found among the usual
    special-token names (Llama 3, Llama 2, GPT-2 ...) unless given; PAD falls back to EOS (padded
    targets are masked out, so the id only has to be valid).
    """

    name = "hf"

    def __init__(self, path, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None):
        self.path = str(path)
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
        self.bos_id = self._special(bos_token, _BOS_NAMES, "BOS")
        self.eos_id = self._special(eos_token, _EOS_NAMES, "EOS")
        try:
            self.pad_id = self._special(pad_token, _PAD_NAMES, "PAD")
        except DataError:
            if pad_token is not None:
                raise
            self.pad_id = self.eos_id

    def _special(self, given, candidates, what) -> int:
        for name in ([given] if given is not None else candidates):
            idx = self._tok.token_to_id(name)
            if idx is not None:
                return int(idx)
        tried = given if given is not None else ", ".join(candidates)
        raise DataError(f"tokenizer {self.path} has no {what} token (tried: {tried})")

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int32)

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, [(start, end) character offsets of each id in `text`]), without special tokens
        added (special tokens written in the text, such as a chat template's, are matched)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return list(enc.ids), list(enc.offsets)

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids with the special tokens the file's post-processor adds (Llama 3's
        template adds <|begin_of_text|>), or BOS + the text when it has no post-processor."""
        if self._tok.post_processor is not None:
            return list(self._tok.encode(text, add_special_tokens=True).ids)
        return [self.bos_id] + self.encode(text)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).ravel()],
                                skip_special_tokens=True)


def load_tokenizer(path=None):
    """`ByteTokenizer()` for None, else `HFTokenizer(path)`."""
    return ByteTokenizer() if path is None else HFTokenizer(path)


