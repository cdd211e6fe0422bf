"""One example row -> its token ids and which of them are trained (the loss mask).

    ids, trained = encode_row(row, tokenizer, template, train_on)   # int32 [n], bool [n]

`trained[i]` says whether token i is a training target (the batch's mask for the prediction of
token i from tokens < i; token 0 is never a target). With `train_on="assistant"`:

  * messages: the assistant turns, as the template renders them. Where the template marks them
    with `{% generation %}` blocks, those spans (transformers' `return_assistant_tokens_mask`);
    otherwise (Llama 3's templates have no markers) the spans are found as TRL does without
    them: for assistant message i, the text rendered for messages[:i] with the generation
    prompt is a prefix of the text rendered for messages[:i + 1]; the difference is the turn.
    For Llama 3 that is the content and its `<|eot_id|>`; the header that opens the turn is
    part of the generation prompt, so it is not trained.
  * prompt + completion: the completion (and, for text pairs, the EOS after it; a text pair's
    prompt starts with BOS where the tokenizer adds one, as a text row does). A message-list
    prompt is rendered with the generation prompt; the completion (a string becomes one
    assistant message) is the difference to the whole conversation's rendering.
  * text: every token.

`train_on="all"` trains every token. The rendered conversation is tokenized in one piece, without
special tokens added (the template writes BOS), exactly as `apply_chat_template(tokenize=True)`;
a token is trained when its characters overlap a trained span.
"""

from __future__ import annotations

import numpy as np

from jaxmem.data.chat import HOW_TO_GIVE_ONE
from jaxmem.data.errors import DataError


def _prefix_span(template, before: str, through: str, where: str) -> tuple[int, int]:
    """The span of `through` after its prefix `before` (both renderings of one conversation)."""
    if not through.startswith(before):
        raise DataError(f"{where}: the chat template {template.source} does not render a "
                        f"conversation's prefix as a prefix of the whole (cannot find the "
                        f"assistant turn's tokens; use a template with {{% generation %}} "
                        f"blocks, or --train-on all)")
    return len(before), len(through)


def assistant_spans(template, messages, where: str) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, character spans of the assistant turns)."""
    if template.has_generation_markers:
        return template.render_with_generation_spans(messages)
    text = template.render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True) if i else ""
        through = template.render(messages[:i + 1])
        span = _prefix_span(template, before, through, where)
        _prefix_span(template, through, text, where)  # and that turn is where it is in the whole
        spans.append(span)
    return text, spans


def _as_messages(value, role: str) -> list[dict]:
    return [{"role": role, "content": value}] if isinstance(value, str) else list(value)


def _mark(offsets: np.ndarray, spans) -> np.ndarray:
    """bool [n]: token i's character range [start, end) overlaps a span."""
    trained = np.zeros(len(offsets), bool)
    if len(offsets) == 0:
        return trained
    start, end = offsets[:, 0], np.maximum(offsets[:, 1], offsets[:, 0] + 1)
    for s, e in spans:
        trained |= (start < e) & (end > s)
    return trained


def _encode_text(tokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    ids, offsets = tokenizer.encode_offsets(text)
    return np.asarray(ids, np.int32), np.asarray(offsets, np.int64).reshape(-1, 2)


def encode_row(row, tokenizer, template, train_on: str = "assistant"):
    """(ids int32 [n], trained bool [n]) of one Row (see the module docstring)."""
    train_all = train_on == "all"
    before, after = tokenizer.document_ids()  # BOS where the tokenizer adds one; EOS
    if row.kind == "text":
        ids = np.concatenate([before, tokenizer.encode_array(row.value), after]).astype(np.int32)
        return ids, np.ones(ids.size, bool)
    if row.kind == "pair" and isinstance(row.value[0], str) and isinstance(row.value[1], str):
        prompt = np.concatenate([before, tokenizer.encode_array(row.value[0])])
        completion = np.concatenate([tokenizer.encode_array(row.value[1]), after])
        ids = np.concatenate([prompt, completion]).astype(np.int32)
        trained = np.concatenate([np.full(prompt.size, train_all), np.ones(completion.size, bool)])
        return ids, trained
    if template is None:
        raise DataError(f"{row.where}: chat rows need a chat template and none was found; "
                        f"{HOW_TO_GIVE_ONE}")
    if row.kind == "messages":
        text, spans = assistant_spans(template, row.value, row.where)
    else:  # a pair with a message list on either side
        prompt = _as_messages(row.value[0], "user")
        conversation = prompt + _as_messages(row.value[1], "assistant")
        text = template.render(conversation)
        spans = [_prefix_span(template, template.render(prompt, add_generation_prompt=True),
                              text, row.where)]
    ids, offsets = _encode_text(tokenizer, text)
    trained = np.ones(ids.size, bool) if train_all else _mark(offsets, spans)
    return ids, trained
