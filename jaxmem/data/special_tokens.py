"""A checkpoint's special tokens, read from its own files as transformers reads them.

    files = TokenizerFiles.read(directory)        # what the directory's files say
    files.tokens                                  # {"bos_token": "<bos>" | None, ...}
    files.stop_ids(eos_id)                        # the ids generation stops at
    tokenizer_json(path)                          # a tokenizer.json, or the one in a directory

The files, beside a tokenizer.json (a checkpoint directory, or a run directory that keeps
copies of them):

  * `tokenizer_config.json`: `bos_token`, `eos_token`, `pad_token`, `unk_token` (a string, an
    AddedToken dict or null: a null or absent `bos_token` means the tokenizer has no BOS, as
    Qwen's); `chat_template` (jaxmem.data.chat reads it).
  * `special_tokens_map.json`: the legacy map. transformers 5 merges it over tokenizer_config.json
    only when that file has no `added_tokens_decoder` (tokenization_utils_base, 5.24); so does
    this module.
  * `generation_config.json`: `eos_token_id` (an id or a list: Llama 3.1 Instruct stops at
    <|end_of_text|>, <|eom_id|> and <|eot_id|>), `bos_token_id`, `pad_token_id`. transformers'
    `generate` stops at its `eos_token_id`; without the file, at config.json's
    (`GenerationConfig.from_model_config`).
  * `config.json` (a Hugging Face model config: one with `model_type` or `architectures`; a run
    directory's config.json is jaxmem's own and is never read here): `bos_token_id`,
    `eos_token_id`, `pad_token_id`. Its ids name the tokenizer's tokens only where no tokenizer
    file does: transformers' tokenizer never reads config.json, and Qwen's names <|endoftext|>
    as `bos_token_id` although its tokenizer adds no BOS.

Whether a text starts with BOS is the tokenizer.json post-processor's decision, as in transformers
5 (which drops tokenizer_config.json's `add_bos_token` / `add_eos_token` when a tokenizer.json is
present: jaxmem.data.tokenizers.HFTokenizer asks the post-processor).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from jaxmem.data.errors import DataError

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP = "tokenizer_config.json", "special_tokens_map.json"
GENERATION_CONFIG, HF_CONFIG = "generation_config.json", "config.json"
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the names a chat template may read
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# A tokenizer as a run directory keeps it and an export writes it: tokenizer.json and these
TOKENIZER_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, "chat_template.jinja",
                   GENERATION_CONFIG)


def tokenizer_json(path) -> Path:
    """`path` itself, or the tokenizer.json in it when it is a directory (a checkpoint's)."""
    path = Path(path)
    return path / TOKENIZER_JSON if path.is_dir() else path


def read_json(path: Path) -> dict:
    """A JSON object file (DataError naming the file when it is unreadable or not an object)."""
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable ({str(e).splitlines()[0]})") from None
    if not isinstance(d, dict):
        raise DataError(f"{path}: expected a JSON object")
    return d


def token_text(value):
    """A special token as the files store it: a string, an AddedToken dict ({"content": ...}),
    or None (null, or anything else)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def ids_of(value) -> list[int]:
    """An `eos_token_id`-style value (an int, a list of ints, or null) as a list."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def is_hf_model_config(d: dict) -> bool:
    """A transformers model config.json (not a jaxmem run directory's config.json)."""
    return "model_type" in d or "architectures" in d


@dataclass(frozen=True)
class TokenizerFiles:
    """What a tokenizer directory's own files say about its special tokens (module docstring).

    tokens: {"bos_token": "<bos>" | None, ...} for each name the tokenizer files give (a name
        given as null maps to None: given, and absent); empty without tokenizer files.
    tokens_from: the file(s) `tokens` came from, for messages ("" when none).
    generation: generation_config.json's ids ({} without the file).
    model_ids: a Hugging Face config.json's ids ({} without one).
    """

    directory: Path
    tokens: dict = field(default_factory=dict)
    tokens_from: str = ""
    generation: dict = field(default_factory=dict)
    model_ids: dict = field(default_factory=dict)

    @classmethod
    def read(cls, directory) -> "TokenizerFiles":
        directory = Path(directory)
        tokens, sources = {}, []
        config_path, map_path = directory / TOKENIZER_CONFIG, directory / SPECIAL_TOKENS_MAP
        config = read_json(config_path) if config_path.is_file() else None
        if config is not None:
            tokens.update({k: token_text(config[k]) for k in SPECIAL_TOKENS if k in config})
            sources.append(TOKENIZER_CONFIG)
        if map_path.is_file() and (config is None or "added_tokens_decoder" not in config):
            legacy = read_json(map_path)  # merged over tokenizer_config.json, as transformers 5
            tokens.update({k: token_text(legacy[k]) for k in SPECIAL_TOKENS if k in legacy})
            sources.append(SPECIAL_TOKENS_MAP)
        gen_path, hf_path = directory / GENERATION_CONFIG, directory / HF_CONFIG
        generation = read_json(gen_path) if gen_path.is_file() else {}
        hf = read_json(hf_path) if hf_path.is_file() else {}
        hf = hf if is_hf_model_config(hf) else {}
        return cls(directory, tokens, " and ".join(sources),
                   {k: generation[k] for k in ID_KEYS if k in generation},
                   {k: hf[k] for k in ID_KEYS if k in hf})

    @property
    def has_tokenizer_files(self) -> bool:
        """tokenizer_config.json or special_tokens_map.json is there (not a bare tokenizer.json)."""
        return bool(self.tokens_from)

    def stop_ids(self, eos_id: int | None) -> tuple[int, ...]:
        """The ids `generate` stops at: generation_config.json's eos_token_id, else config.json's
        (transformers' rule), else the tokenizer's EOS."""
        for source in (self.generation, self.model_ids):
            ids = ids_of(source.get("eos_token_id"))
            if ids:
                return tuple(sorted(set(ids)))
        return () if eos_id is None else (int(eos_id),)

    def generation_ids(self) -> dict:
        """{bos_token_id, eos_token_id, pad_token_id} as transformers' GenerationConfig of the
        checkpoint holds them: generation_config.json's, else config.json's (from_model_config);
        the keys neither file has are left out."""
        out = {k: v for k, v in self.model_ids.items() if v is not None}
        if self.generation:
            out = {k: v for k, v in self.generation.items() if v is not None}
        return out
