"""Preference pairs (DPO / ORPO / SimPO): rows read, rendered and tokenized as TRL 1.16 does.

    train, evals, stats = load_preferences(files, tokenizer, vocab_size, seq_len=T,
                                           eval_fraction=0.05, style="dpo")
    train.batcher(B, T, seed, pad_id).batch_at(position)   # B pairs -> [2B, T] arrays
    evals.eval_batches(B, T, max_batches, pad_id)

Rows (jaxmem.data.formats, kind "preference"; TRL's preference formats), all of one shape:

    standard       {"prompt": str, "chosen": str, "rejected": str}
    conversational {"prompt": [messages], "chosen": [messages], "rejected": [messages]}
    implicit       {"chosen": ..., "rejected": ...}: strings or message lists that share their
                   start; the prompt is TRL's `extract_prompt` (trl/data_utils.py:548-632): the
                   longest common prefix of chosen and rejected (messages, or characters, then
                   one character back when the prefix ends in a space)

`style` says whose tokenization (TRL 1.16; file:line in trl/):

  "dpo"  DPOTrainer._prepare_dataset (trainer/dpo_trainer.py:1036-1142). Standard rows: the EOS
         token's text is appended to chosen and rejected unless they end with it (:1060-1069);
         prompt, prompt + chosen and prompt + rejected are each tokenized whole by
         `tokenizer(text)`, so with what the tokenizer adds (Llama 3's BOS; nothing for Qwen)
         (data_utils.py:367-403). Conversational rows: `apply_chat_template(prompt,
         add_generation_prompt=True)` (also after an assistant message), `apply_chat_template(
         prompt + chosen)` and `(prompt + rejected)`, tokenized without special tokens (the
         template writes any BOS) (:1080-1096).
         The prompt is the first `min(common prefix(prompt, prompt + chosen), common
         prefix(prompt, prompt + rejected))` ids; the rest of each is the completion (:1104-1123):
         a prompt token that merges with the answer's first characters is trained.
  "cpo"  CPOTrainer and ORPOTrainer (experimental/cpo/cpo_trainer.py:374-392, 427-612;
         experimental/orpo/orpo_trainer.py:359-375, 409-594 is the same code, tested equal):
         `maybe_extract_prompt`, then `maybe_apply_chat_template` (data_utils.py:167-364: the
         prompt rendered with the generation prompt, or continuing its last message when that is
         an assistant's; the prompt text is the common character prefix of it and the
         renderings of prompt + chosen and prompt + rejected; each answer is the rest). Then
         on the texts, without special tokens: for each answer, the ids of prompt + answer are
         split at len(ids(prompt)), one id earlier when ids(prompt) is not their prefix (a merge;
         `build_tokenized_answer`), so the two sequences' prompt parts may differ by that id; BOS
         is put in front of each prompt part unless it starts with it, EOS after each answer
         unless it ends with it (experimental/utils.py:689-720, the checkpoint's bos / eos ids;
         none for a tokenizer without a BOS, as Qwen).

Where TRL's sequences' prompt parts differ (cpo, a merge), `prompt` holds their common prefix and
the rest of each prompt part leads its completion, counted in `untrained` (not trained).

Truncation: a row of --seq-len T holds T (input, target) pairs, so a sequence has at most
max_length = T + 1 tokens (TRL's `max_length`). In order:

  1. max_prompt_length P (jaxmem's; TRL 1.16 has no such option in any of the three configs): a
     prompt (for cpo each sequence's prompt part, after its BOS) longer than P tokens keeps its
     last P tokens, TRL's old keep_end rule for prompts (a cut prompt loses its BOS).
  2. A pair whose prompt (part) alone has max_length tokens or more is left out and counted
     (`left_out["prompt_too_long"]`): DPOTrainer drops it (dpo_trainer.py:1134-1140, keep_start);
     CPO / ORPO keep it with an empty completion and warn (cpo_trainer.py:551-561), which leaves
     no token to average over, so jaxmem drops it there too.
  3. Each sequence, prompt part + completion, keeps its first max_length tokens: DPO's collator
     (keep_start, dpo_trainer.py:153-166; keep_end is deprecated in 1.16 and not offered), CPO's
     tokenize_row cuts the completion to max_length - len(prompt part) (cpo_trainer.py:551-557):
     the same tokens. A completion cut this way loses its EOS, in TRL as here.

A pair with no completion target left in either sequence is left out as well
(`left_out["no_completion_tokens"]`). The eval split is the last `eval_fraction` of the pairs
kept (at least one, at most half, none of a single pair), as for examples.

A batch of B pairs is a dict of int32 arrays [2B, T]: row 2i is pair i's chosen sequence, row
2i + 1 its rejected one (a split of the batch axis keeps pairs together); each sequence is
prompt + completion, right-padded with PAD:

    inputs   seq[:-1]          targets  seq[1:]
    mask     1 where the target is a completion token: the tokens whose log-probs TRL sums (DPO)
             or averages (SimPO, ORPO's odds ratio, CPO's NLL), EOS included; never the prompt
    real     1 where the target is any real token, prompt or completion: the tokens ORPO's NLL
             term averages over in the chosen rows (orpo_trainer.py:796-800: labels are the input
             ids wherever the attention mask is 1, shifted, so every token after the first)

Padding (and the padding pairs that fill eval's last batch) is PAD with mask and real 0.
Training batches are a pure function of (pairs, seed, position): epoch e visits the pairs in the
order `epoch_permutation(seed, e, n_pairs)` (jaxmem.data.batches.EpochRows), so a resume sees the
batches an uninterrupted run does.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from jaxmem.data.batches import EpochRows
from jaxmem.data.chat import find_chat_template, with_tokenizer_specials
from jaxmem.data.errors import DataError
from jaxmem.data.examples import _eval_count
from jaxmem.data.formats import read_rows
from jaxmem.data.preference_trl import Tokenize, common, extract_prompt  # noqa: F401  (re-exported)

STYLES = ("dpo", "cpo")

KEYS = ("inputs", "targets", "mask", "real")


# ----------------------------------------------------------------------------- pairs


@dataclass(frozen=True)
class PreferencePairs:
    """One split: per pair, the prompt ids and the chosen / rejected completion ids (int32), as
    TRL tokenizes them (BOS / EOS where TRL puts them; truncated to the run's --seq-len).

    untrained: int32 [n, 2], how many leading ids of chosen / rejected TRL still counts as
    prompt (its label -100): 0 but where cpo-style tokenization split the two sequences'
    prompts one id apart (see the module docstring)."""

    prompt: list
    chosen: list
    rejected: list
    untrained: np.ndarray = field(default=None)

    def __post_init__(self):
        if not len(self.prompt) == len(self.chosen) == len(self.rejected):
            raise DataError(f"preference pairs: {len(self.prompt)} prompts, {len(self.chosen)} "
                            f"chosen, {len(self.rejected)} rejected")
        if self.untrained is None:
            object.__setattr__(self, "untrained", np.zeros((len(self.prompt), 2), np.int32))

    def __len__(self) -> int:
        return len(self.prompt)

    def subset(self, lo: int, hi: int) -> "PreferencePairs":
        return PreferencePairs(self.prompt[lo:hi], self.chosen[lo:hi], self.rejected[lo:hi],
                               self.untrained[lo:hi])

    def sequences(self, index: int):
        """((chosen ids, first trained position), (rejected ids, first trained position))."""
        p = self.prompt[index]
        return ((np.concatenate([p, self.chosen[index]]), p.size + int(self.untrained[index, 0])),
                (np.concatenate([p, self.rejected[index]]), p.size + int(self.untrained[index, 1])))

    def target_counts(self) -> tuple[int, int]:
        """(completion targets, prompt targets) over both sequences of every pair (padding not
        counted; a sequence of n tokens has n - 1 targets)."""
        completion = prompt = 0
        for i in range(len(self)):
            for seq, start in self.sequences(i):
                c = seq.size - max(start, 1)
                completion += c
                prompt += seq.size - 1 - c
        return completion, prompt

    def rows(self, index: int, seq_len: int, pad_id: int) -> tuple[dict, dict]:
        """The chosen and rejected rows of pair `index` ({KEYS: int32 [seq_len]})."""
        return tuple(_row(seq, start, seq_len, pad_id) for seq, start in self.sequences(index))

    def batcher(self, batch_size: int, seq_len: int, seed: int, pad_id: int) -> "PreferenceBatcher":
        return PreferenceBatcher(self, batch_size, seq_len, seed, pad_id=pad_id)

    def eval_batches(self, batch_size: int, seq_len: int, max_batches, pad_id: int) -> list[dict]:
        """The pairs in order, B per batch; the last batch filled with padding pairs."""
        if batch_size < 1 or seq_len < 1:
            raise DataError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        n_batches = math.ceil(len(self) / batch_size)
        if max_batches is not None:
            n_batches = min(n_batches, max_batches)
        empty = _row(np.zeros(0, np.int32), 0, seq_len, pad_id)
        out = []
        for b in range(n_batches):
            out.append(_stack([self.rows(i, seq_len, pad_id) if i < len(self) else (empty, empty)
                               for i in range(b * batch_size, (b + 1) * batch_size)]))
        return out


def _row(seq: np.ndarray, start: int, seq_len: int, pad_id: int) -> dict:
    """One sequence's four [seq_len] arrays; `start`: its first completion (trained) position."""
    n = seq.size
    if n > seq_len + 1:
        raise DataError(f"a preference sequence of {n} tokens does not fit --seq-len {seq_len} "
                        f"(the pairs were loaded for a longer --seq-len)")
    out = {k: np.zeros(seq_len, np.int32) for k in KEYS}
    out["inputs"][:] = pad_id
    out["targets"][:] = pad_id
    if n >= 2:
        out["inputs"][:n - 1] = seq[:-1]
        out["targets"][:n - 1] = seq[1:]
        out["real"][:n - 1] = 1
        out["mask"][max(start, 1) - 1:n - 1] = 1  # target j is token j + 1
    return out


def _stack(pairs) -> dict:
    """[(chosen row, rejected row), ...] -> {key: [2B, T]}, chosen and rejected interleaved."""
    rows = [r for pair in pairs for r in pair]
    return {k: np.stack([r[k] for r in rows]) for k in KEYS}


class PreferenceBatcher(EpochRows):
    """Training batches [2 * batch_size, seq_len] of `batch_size` pairs; `batch_at(position)` is
    pure (the class caches epoch permutations), as `jaxmem.data.batches.Batcher`."""

    def __init__(self, pairs: PreferencePairs, batch_size: int, seq_len: int, seed: int = 0, *,
                 pad_id: int):
        if batch_size < 1 or seq_len < 1:
            raise DataError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        if int(seed) < 0:
            raise DataError(f"seed must be >= 0, got {seed}")
        if not len(pairs):
            raise DataError("no training pairs: every pair was left out")
        self.pairs, self.batch_size, self.seq_len = pairs, batch_size, seq_len
        self.seed, self.pad_id = int(seed), pad_id
        self.num_windows = len(pairs)  # the name Batcher uses: pairs visited once per epoch
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def _row(self, index: int):
        return self.pairs.rows(index, self.seq_len, self.pad_id)

    @staticmethod
    def _stack(rows):
        return _stack(rows)


# ----------------------------------------------------------------------------- loading


def _cut(sides, max_length: int, max_prompt_length: int | None):
    """Truncation steps 1-3 of the module docstring: the sides cut, or the reason the pair is
    left out."""
    out = []
    for prompt, completion in sides:
        if max_prompt_length is not None and len(prompt) > max_prompt_length:
            prompt = prompt[-max_prompt_length:]
        if len(prompt) >= max_length:
            return None, "prompt_too_long"
        completion = completion[:max_length - len(prompt)]
        if len(prompt) + len(completion) - max(len(prompt), 1) <= 0:
            return None, "no_completion_tokens"
        out.append((prompt, completion))
    return out, None


def _pair(sides):
    """(prompt, chosen, rejected, untrained) of the two (prompt part, completion) sequences."""
    (pc, cc), (pr, cr) = sides
    n = common(pc, pr)
    as_ids = lambda ids: np.asarray(ids, np.int32)  # noqa: E731
    return (as_ids(pc[:n]), as_ids(pc[n:] + cc), as_ids(pr[n:] + cr),
            (len(pc) - n, len(pr) - n))


def _template_for(rows, tokenizer, chat_template: str | None):
    needs = any(isinstance(r.value[1], list) for r in rows)
    if not (needs or chat_template is not None):
        return None
    return with_tokenizer_specials(
        find_chat_template(getattr(tokenizer, "path", None), chat_template), tokenizer)


def _shape(row) -> str:
    prompt, chosen, _ = row.value
    return (f"{'conversational' if isinstance(chosen, list) else 'standard'} rows "
            f"{'with a prompt' if prompt is not None else 'without a prompt (implicit)'}")


def load_preferences(files, tokenizer, vocab_size: int, *, seq_len: int, eval_fraction: float,
                     style: str, max_prompt_length: int | None = None,
                     chat_template: str | None = None):
    """(train PreferencePairs, eval PreferencePairs, stats) of preference files (see the module
    docstring)."""
    _check_options(style, seq_len, max_prompt_length)
    rows = [row for f in files for row in read_rows(f, preference=True)]
    for row in rows[1:]:  # TRL decides a dataset's shape by its first row
        if _shape(row) != _shape(rows[0]):
            raise DataError(f"{row.where}: {_shape(row)} among {_shape(rows[0])} (since "
                            f"{rows[0].where}); give preference rows of one shape")
    template = _template_for(rows, tokenizer, chat_template)
    max_length = seq_len + 1
    pairs, left_out = _tokenized_pairs(rows, Tokenize(tokenizer, template, style), vocab_size,
                                       seq_len=seq_len, max_prompt_length=max_prompt_length)
    n_eval = _eval_count(len(pairs), eval_fraction)
    n_train = len(pairs) - n_eval
    train, evals = pairs.subset(0, n_train), pairs.subset(n_train, len(pairs))
    completion, prompt = train.target_counts()
    eval_completion, eval_prompt = evals.target_counts()
    stats = {
        "format": "preference",
        "style": style,
        "row_shape": _shape(rows[0]),
        "rows": len(rows),
        "pairs": len(pairs),
        "train_pairs": len(train),
        "eval_pairs": len(evals),
        "left_out": left_out,
        "max_length": max_length,
        "max_prompt_length": max_prompt_length,
        "completion_tokens": completion,
        "prompt_tokens": prompt,
        "eval_completion_tokens": eval_completion,
        "eval_prompt_tokens": eval_prompt,
        "train_tokens": completion + prompt,  # real targets, as a token stream's count
        "eval_tokens": eval_completion + eval_prompt,
        "tokens_sha256": _digest(pairs, style),
    }
    if template is not None:
        stats["chat_template"] = {"source": template.source, "sha256": template.sha256}
    return train, evals, stats


def _check_options(style: str, seq_len: int, max_prompt_length: int | None) -> None:
    """DataError naming the first of load_preferences' options that is out of range."""
    if style not in STYLES:
        raise DataError(f"preference style must be one of {', '.join(STYLES)}, got {style!r}")
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len!r}")
    if max_prompt_length is not None and max_prompt_length < 1:
        raise DataError(f"max_prompt_length must be >= 1, got {max_prompt_length!r}")


def _tokenized_pairs(rows, tokenize, vocab_size: int, *, seq_len: int,
                     max_prompt_length: int | None):
    """(PreferencePairs of the rows that survive truncation to seq_len + 1 tokens, the count of
    rows left out per reason); DataError on an id outside the vocabulary or when none survive."""
    kept, left_out, first_left_out = [], {"prompt_too_long": 0, "no_completion_tokens": 0}, None
    for row in rows:
        sides, why = _cut(tokenize(row.value, row.where), seq_len + 1, max_prompt_length)
        if why is not None:
            left_out[why] += 1
            first_left_out = first_left_out or (row.where, why)
            continue
        pair = _pair(sides)
        ids = np.concatenate(pair[:3])
        if ids.size and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
            bad = int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())
            raise DataError(f"{row.where}: token id {bad} is outside the model's vocabulary of "
                            f"{vocab_size}")
        kept.append(pair)
    if not kept:
        where, why = first_left_out
        reason = {"prompt_too_long": f"the prompt alone has --seq-len {seq_len} + 1 tokens or "
                                     f"more (raise --seq-len, or set a max prompt length)",
                  "no_completion_tokens": "no completion token left"}[why]
        raise DataError(f"{where}: no preference pairs left after truncating {len(rows)} row(s) "
                        f"({reason}; {', '.join(f'{v} {k}' for k, v in left_out.items() if v)})")
    pairs = PreferencePairs([k[0] for k in kept], [k[1] for k in kept], [k[2] for k in kept],
                            np.asarray([k[3] for k in kept], np.int32).reshape(-1, 2))
    return pairs, left_out


def _digest(pairs, style: str) -> str:
    """sha256 hex of the style and every pair's parts (their sizes, untrained counts and ids)."""
    digest = hashlib.sha256(style.encode())
    for i in range(len(pairs)):
        parts = (pairs.prompt[i], pairs.chosen[i], pairs.rejected[i])
        sizes = [p.size for p in parts] + list(pairs.untrained[i])
        digest.update(np.asarray(sizes, np.int64).tobytes())
        for p in parts:
            digest.update(p.tobytes())
    return digest.hexdigest()
