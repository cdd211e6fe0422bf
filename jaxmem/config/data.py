"""The data section of the run configuration (jaxmem.config.run.RunConfig.data): what is trained
on and the shape of a step's batch."""

from __future__ import annotations

from dataclasses import dataclass

from jaxmem.config.fields import _positive, option


@dataclass(frozen=True)
class DataSection:
    """Training data and the shape of a step's batch."""

    data: str | None = option(None, "text files, a directory, a glob, or token files (.bin uint16, "
                              ".u32.bin uint32, .npy); comma-separated lists work (default: "
                              "built-in corpus)")
    tokenizer: str | None = option(None, "a Hugging Face `tokenizers` JSON file, copied into the run "
                                   "directory (default: byte-level)")
    batch_size: int = option(16, "micro-batch size (sequences)", type="positive_int")
    seq_len: int = option(128, "tokens per sequence", type="positive_int")
    grad_accum: int = option(1, "micro-batches per optimizer step (global batch = batch-size x "
                             "grad-accum)", type="positive_int")
    seed: int = option(0, "init, data-order and sampling seed", type="nonneg_int")

    def __post_init__(self):
        for name in ("batch_size", "seq_len", "grad_accum"):
            _positive(f"--{name.replace('_', '-')}", getattr(self, name))
        _positive("--seed", self.seed, allow_zero=True)
