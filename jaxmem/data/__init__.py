"""Tokenizers, sources and the built-in corpus, packed resumable batches.

    load_tokenizer(path | None)              -> ByteTokenizer (default) or the checkpoint's HFTokenizer
    load_corpus(data | None, tok, vocab)     -> (train_tokens, eval_tokens, stats)
    Batcher(train_tokens, B, T, seed, pad_id=tok.pad_id).batch_at(position) -> batch dict
    eval_batches(eval_tokens, B, T, max_batches, pad_id=tok.pad_id)          -> [batch, ...]

Example rows (.jsonl / .json / .parquet: text, chat messages, prompt + completion) load as
packed examples with loss masks (jaxmem.data.formats, chat, masks, packing, examples);
preference rows (prompt, chosen, rejected) load as pairs tokenized as TRL does
(jaxmem.data.preference; `load_corpus(..., preference="dpo" | "cpo")`);
`train_batcher` / `split_eval_batches` give the batches of any kind of split.
"""

from jaxmem.data.batches import Batcher, batch_at, epoch_permutation, eval_batches, num_windows, window
from jaxmem.data.chat import ChatTemplate, find_chat_template
from jaxmem.data.errors import DataError
from jaxmem.data.examples import PackedData
from jaxmem.data.preference import PreferencePairs, load_preferences
from jaxmem.data.sources import (DEFAULT_CORPUS_BYTES, DEFAULT_EVAL_FRACTION, decode_utf8,
                                 default_corpus_files, load_corpus, load_token_file,
                                 resolve_sources, split_eval_batches, train_batcher)
from jaxmem.data.tokenizers import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["Batcher", "ByteTokenizer", "ChatTemplate", "PackedData", "PreferencePairs",
           "find_chat_template", "load_preferences",
           "split_eval_batches", "train_batcher", "DEFAULT_CORPUS_BYTES", "DEFAULT_EVAL_FRACTION", "DataError",
           "HFTokenizer", "batch_at", "decode_utf8", "default_corpus_files", "epoch_permutation",
           "eval_batches", "load_corpus", "load_token_file", "load_tokenizer", "num_windows",
           "resolve_sources", "window"]
