"""The data section of the run configuration (jaxmem.config.run.RunConfig.data): what is trained
on, how example rows (chat, prompt/completion) become packed rows, and the shape of a step's batch.

None of these fields may change on resume: they fix the token stream and the batches
(jaxmem.data.sources, jaxmem.data.packing).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxmem.config.fields import _positive, option
from jaxmem.errors import ConfigError

TRAIN_ON = ("assistant", "all")
TRUNCATE = ("split", "drop")


@dataclass(frozen=True)
class DataSection:
    """Training data and the shape of a step's batch."""

    data: str | None = option(None, "text files, a directory, a glob, token files (.bin uint16, "
                              ".u32.bin uint32, .npy), or example rows (.jsonl, .json, .parquet: "
                              "text, messages, or prompt + completion); comma-separated lists work "
                              "(default: built-in corpus)")
    eval_data: str | None = option(None, "held-out data for evaluation, in --data's forms (default: "
                                   "the last 5%% of --data, at least one window or example)",
                                   metavar="DATA")
    tokenizer: str | None = option(None, "a Hugging Face tokenizer.json, or the checkpoint directory "
                                   "holding it; it and its tokenizer_config.json, "
                                   "special_tokens_map.json, chat template and generation config "
                                   "are copied into the run directory (default: byte-level)")
    bos_token: str | None = option(None, "the tokenizer's BOS token (default: the checkpoint's, from "
                                   "tokenizer_config.json; a bare tokenizer.json's is guessed by "
                                   "name)", metavar="TOKEN")
    eos_token: str | None = option(None, "the tokenizer's EOS token, which ends each text document "
                                   "(default: the checkpoint's, as --bos-token)", metavar="TOKEN")
    pad_token: str | None = option(None, "the tokenizer's PAD token (default: the checkpoint's, else "
                                   "EOS)", metavar="TOKEN")
    data_field: str | None = option(None, "example rows: train on this string field as plain text "
                                    "(for layouts other than text / messages / prompt + completion)",
                                    metavar="NAME")
    chat_template: str | None = option(None, "a Jinja chat template file for messages rows (default: "
                                       "chat_template.jinja beside the tokenizer, else "
                                       "tokenizer_config.json's chat_template)", metavar="FILE")
    train_on: str = option("assistant", "example rows: train on the assistant turns / the "
                           "completion only (assistant), or on every token (all)",
                           choices=list(TRAIN_ON))
    no_pack: bool = option(False, "example rows: one example per row, padded (default: short "
                           "examples are packed into --seq-len rows with segment ids)",
                           store_true=True)
    truncate: str = option("split", "example rows longer than --seq-len + 1 tokens: split into "
                           "pieces, or drop them (counted in config.json's data_stats)",
                           choices=list(TRUNCATE))
    batch_size: int = option(16, "micro-batch size (sequences)", type="positive_int")
    seq_len: int = option(128, "tokens per sequence", type="positive_int")
    grad_accum: int = option(1, "micro-batches per optimizer step (global batch = batch-size x "
                             "grad-accum)", type="positive_int")
    seed: int = option(0, "init, data-order and sampling seed", type="nonneg_int")

    def __post_init__(self):
        for name in ("batch_size", "seq_len", "grad_accum"):
            _positive(f"--{name.replace('_', '-')}", getattr(self, name))
        _positive("--seed", self.seed, allow_zero=True)
        if self.train_on not in TRAIN_ON:
            raise ConfigError(f"--train-on {self.train_on!r} is not one of {', '.join(TRAIN_ON)}")
        if self.truncate not in TRUNCATE:
            raise ConfigError(f"--truncate {self.truncate!r} is not one of {', '.join(TRUNCATE)}")
        if self.data_field is not None and not str(self.data_field).strip():
            raise ConfigError("--data-field is empty")
