"""TRL 1.16's steps from a preference row to token ids (jaxmem.data.preference's module docstring
says which, with TRL's file and line for each): the implicit prompt (`extract_prompt`), chat
rendering that continues a final message, and `Tokenize`, the DPO or CPO / ORPO style."""

from __future__ import annotations

from itertools import takewhile

from jaxmem.data.chat import HOW_TO_GIVE_ONE
from jaxmem.data.errors import DataError

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' render_jinja_template's


def extract_prompt(chosen, rejected):
    """(prompt, chosen, rejected): TRL's `extract_prompt` (data_utils.py:548-632), step for step,
    for strings or message lists that are not empty."""
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # remove space before the prompt
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def common(a, b) -> int:
    """Length of the common prefix of two sequences (TRL's common_prefix_length)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _render_continuing(template, messages, where: str) -> str:
    """The conversation with its last message left open, as transformers renders it for
    `continue_final_message=True` (utils/chat_template_utils.py: a tag after the last content,
    the rendering cut where the tag is)."""
    if "content" not in template.text:
        raise DataError(f"{where}: the chat template {template.source} reads no message content, "
                        f"so the prompt's last (assistant) message cannot be continued")
    final = messages[-1]["content"]
    tagged = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_TAG}]
    text = template.render(tagged)
    if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise DataError(f"{where}: the chat template {template.source} does not render the "
                        f"prompt's last (assistant) message, so it cannot be continued")
    at = text.rindex(_CONTINUE_TAG.strip())
    if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()


class Tokenize:
    """One row's (prompt parts, completions) as TRL tokenizes it in `style`."""

    def __init__(self, tokenizer, template, style: str):
        self.tok, self.template, self.style = tokenizer, template, style
        names = getattr(tokenizer, "special_names", None)
        # DPO appends the EOS token's *text* to standard answers; a byte tokenizer has none, so
        # its EOS id follows the answer's bytes instead (the same sequence).
        self.eos_text = names.get("eos_token") if names is not None else None

    def _ids(self, text: str) -> list[int]:
        return [int(i) for i in self.tok.encode(text)]

    def _ids_with_specials(self, text: str) -> list[int]:
        """transformers' `tokenizer(text)`: with what the tokenizer adds (its post-processor)."""
        return [int(i) for i in self.tok.encode_prompt(text)]

    def _render(self, messages, where: str, **kw) -> str:
        if self.template is None:
            raise DataError(f"{where}: chat rows need a chat template and none was found; "
                            f"{HOW_TO_GIVE_ONE}")
        return self.template.render(messages, **kw)

    def __call__(self, value, where: str):
        """((chosen prompt part, chosen completion), (rejected ...)) as lists of ids."""
        prompt, chosen, rejected = value
        if prompt is None:
            prompt, chosen, rejected = extract_prompt(chosen, rejected)
            if isinstance(chosen, list) and not prompt:
                raise DataError(f"{where}: 'chosen' and 'rejected' share no first message, so "
                                f"there is no prompt (give a 'prompt' field)")
        if self.tok.eos_id is None:
            raise DataError(f"{where}: the tokenizer has no EOS token, which preference answers "
                            f"end with")
        return (self._dpo if self.style == "dpo" else self._cpo)(prompt, chosen, rejected, where)

    def _dpo(self, prompt, chosen, rejected, where):
        if isinstance(chosen, str):
            full = []
            for answer in (chosen, rejected):
                if self.eos_text is None:
                    full.append(self._ids_with_specials(prompt + answer) + [int(self.tok.eos_id)])
                else:
                    if not answer.endswith(self.eos_text):
                        answer = answer + self.eos_text
                    full.append(self._ids_with_specials(prompt + answer))
            p = self._ids_with_specials(prompt)
        else:
            p = self._ids(self._render(prompt, where, add_generation_prompt=True))
            full = [self._ids(self._render(prompt + answer, where))
                    for answer in (chosen, rejected)]
        n = min(common(p, full[0]), common(p, full[1]))
        return (p[:n], full[0][n:]), (p[:n], full[1][n:])

    def _cpo_texts(self, prompt, chosen, rejected, where):
        """maybe_apply_chat_template (data_utils.py:167-300) for a message row."""
        last = prompt[-1]["role"]
        if last == "user":
            p = self._render(prompt, where, add_generation_prompt=True)
        elif last == "assistant":
            if self.template is None:
                self._render(prompt, where)  # the DataError for no template
            p = _render_continuing(self.template, prompt, where)
        else:
            raise DataError(f"{where}: the prompt's last message has role {last!r}; TRL wants a "
                            f"user or assistant message there")
        pc = self._render(prompt + chosen, where)
        pr = self._render(prompt + rejected, where)
        p = "".join(x for x, _ in takewhile(lambda x: x[0] == x[1], zip(p, pc)))
        p = "".join(x for x, _ in takewhile(lambda x: x[0] == x[1], zip(p, pr)))
        return p, pc[len(p):], pr[len(p):]

    def _cpo(self, prompt, chosen, rejected, where):
        if not isinstance(chosen, str):
            prompt, chosen, rejected = self._cpo_texts(prompt, chosen, rejected, where)
        p = self._ids(prompt)
        sides = []
        for answer in (chosen, rejected):  # build_tokenized_answer (cpo_trainer.py:427-474)
            full = self._ids(prompt + answer)
            if len(full) < len(p):
                raise DataError(f"{where}: the prompt has more tokens alone than with its answer "
                                f"(TRL: 'Prompt input ids and answer input ids should have the "
                                f"same length')")
            start = len(p) if full[:len(p)] == p else len(p) - 1
            sides.append([full[:start], full[start:]])
        (pc, _), (pr, _) = sides
        if sum(a != b for a, b in zip(pc, pr)) > 1 or abs(len(pc) - len(pr)) > 1:
            raise DataError(f"{where}: the chosen and rejected sequences' prompt tokens differ by "
                            f"more than their last token (TRL refuses such a row)")
        bos, eos = self.tok.bos_id, int(self.tok.eos_id)
        for side in sides:  # add_bos_token_if_needed / add_eos_token_if_needed
            if bos is not None and (not side[0] or side[0][0] != bos):
                side[0] = [int(bos)] + side[0]
            if not side[1] or side[1][-1] != eos:
                side[1] = side[1] + [eos]
        return tuple(sides)
