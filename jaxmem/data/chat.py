"""Chat templates, rendered exactly as transformers' `tokenizer.apply_chat_template` renders them.

    template = find_chat_template(tokenizer_path, explicit_file)   # ChatTemplate or None
    text = template.render(messages, add_generation_prompt=False)
    text, spans = template.render_with_generation_spans(messages)  # {% generation %} blocks

Where the template comes from, first found wins: `--chat-template FILE` (the Jinja text), the
checkpoint's `chat_template.jinja` beside its tokenizer.json (transformers 5 saves it there),
`tokenizer_config.json`'s `chat_template` (a string, or a list of {name, template}: "default").
The special tokens the template sees (bos_token, eos_token, ...) are tokenizer_config.json's,
as transformers passes `tokenizer.special_tokens_map`.

The environment is transformers' (5.23, utils/chat_template_utils.py): jinja2's
`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with `loopcontrols` and the
`{% generation %}` extension, `tojson` as `json.dumps(ensure_ascii=False, ...)`, and the globals
`raise_exception`, `strftime_now`, `dict` and `namespace`. jinja2 is the `chat` extra; it is
imported only when a template is rendered. Tested token for token against transformers in
tests/test_chat.py.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from jaxmem.data.errors import DataError
from jaxmem.data.special_tokens import TOKENIZER_CONFIG, TokenizerFiles, read_json

TEMPLATE_FILE = "chat_template.jinja"
HOW_TO_GIVE_ONE = (f"give one with --chat-template FILE, or put {TEMPLATE_FILE} (or a "
                   f"chat_template in {TOKENIZER_CONFIG}) beside the tokenizer.json")


@functools.lru_cache(maxsize=8)
def _compile(text: str):
    """The compiled template in transformers' environment (cached by its text)."""
    try:
        import jinja2  # noqa: PLC0415 (optional: the `chat` extra)
        import jinja2.ext  # noqa: PLC0415
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415
    except ImportError:
        raise DataError("chat templates need jinja2 (pip install 'jaxmem[chat]')") from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_generation_tracker(jinja2), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _namespace(jinja2)
    try:
        return env.from_string(text)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise DataError(f"chat template: syntax error line {e.lineno}: {e.message}") from None


def _generation_tracker(jinja2):
    """The `{% generation %}` extension class (jinja2 is imported only when a template is)."""

    class GenerationTracker(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: records the character span of the block's
        output while a render is tracked (transformers' AssistantTracker)."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(track_generation=self.track)
            self._blocks = self._spans = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_support"), [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _support(self, context, caller):
            rv = caller()
            if self._blocks is not None:
                start = len("".join(self._blocks))
                self._spans.append((start, start + len(rv)))
            return rv

        def track(self, blocks, spans):
            self._blocks, self._spans = blocks, spans

    return GenerationTracker


def _namespace(jinja2):
    """The template's `namespace`: as transformers', no underscore attributes (a way out of the
    sandbox)."""

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")

    return Namespace


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters; transformers overrides it with json.dumps
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _TemplateDict:
    # as transformers: `dict(...)` and `dict.fromkeys(...)`, not the type itself
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template, where it came from, and the special tokens it is rendered with."""

    text: str
    source: str
    special_tokens: dict = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def has_generation_markers(self) -> bool:
        import re  # noqa: PLC0415
        return re.search(r"\{%-?\s*generation\s*-?%\}", self.text) is not None

    def _kwargs(self, messages, add_generation_prompt: bool) -> dict:
        # transformers drops None-valued keys of each message and passes tools/documents as None
        msgs = [{k: v for k, v in m.items() if v is not None} for m in messages]
        return dict(self.special_tokens, messages=msgs, tools=None, documents=None,
                    add_generation_prompt=add_generation_prompt)

    def render(self, messages, add_generation_prompt: bool = False) -> str:
        """The conversation as text (DataError with the template's own message on failure)."""
        template = _compile(self.text)
        try:
            return template.render(**self._kwargs(messages, add_generation_prompt))
        except Exception as e:  # TemplateError from raise_exception, UndefinedError, TypeError ...
            raise DataError(f"chat template {self.source} failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None

    def render_with_generation_spans(self, messages) -> tuple[str, list[tuple[int, int]]]:
        """(text, [(start, end) character span of each {% generation %} block's output])."""
        template = _compile(self.text)
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        template.environment.track_generation(blocks, spans)
        try:
            for block in template.generate(**self._kwargs(messages, False)):
                blocks.append(block)
        except Exception as e:
            raise DataError(f"chat template {self.source} failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        finally:
            template.environment.track_generation(None, None)
        return "".join(blocks), spans


def special_tokens(directory) -> dict:
    """{bos_token: "<|begin_of_text|>", ...}: the names the tokenizer files of `directory` give
    (tokenizer_config.json, and the legacy special_tokens_map.json as transformers merges it:
    jaxmem.data.special_tokens), as transformers passes them to a template."""
    return {k: v for k, v in TokenizerFiles.read(directory).tokens.items() if v is not None}


def _config_template(path: Path):
    value = read_json(path).get("chat_template")
    if isinstance(value, list):  # named templates: transformers picks "default"
        value = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}.get("default")
    return value if isinstance(value, str) and value.strip() else None


def find_chat_template(tokenizer_path=None, explicit=None) -> ChatTemplate | None:
    """The run's chat template (see the module docstring), or None when there is none."""
    directory = Path(tokenizer_path).parent if tokenizer_path else None
    specials = special_tokens(directory) if directory is not None else {}
    if explicit is not None:
        path = Path(explicit)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise DataError(f"--chat-template {path}: cannot read ({e.strerror or e})") from None
        if not text.strip():
            raise DataError(f"--chat-template {path}: the file is empty")
        return ChatTemplate(text, str(path), specials)
    if directory is None:
        return None
    jinja = directory / TEMPLATE_FILE
    if jinja.is_file():
        return ChatTemplate(jinja.read_text(encoding="utf-8"), str(jinja), specials)
    config = directory / TOKENIZER_CONFIG
    if config.is_file() and (text := _config_template(config)) is not None:
        return ChatTemplate(text, f"{config} (chat_template)", specials)
    return None


def with_tokenizer_specials(template: ChatTemplate | None, tokenizer) -> ChatTemplate | None:
    """`template` with the tokenizer's special-token names filled in where the tokenizer files
    named none (a bare tokenizer.json, or --bos-token and the like); the files' names win."""
    names = getattr(tokenizer, "special_names", None)
    if template is None or not names:
        return template
    filled = {k: v for k, v in names.items() if k not in template.special_tokens}
    return dataclasses.replace(template, special_tokens={**filled, **template.special_tokens})


class ChatPromptTokenizer:
    """A tokenizer whose `encode_prompt(text)` is the chat template applied to one user turn with
    the generation prompt added (`jaxmem.generate --chat`), and whose `decode` of ids that start
    with that prompt gives the reply alone (the rendered template is not the user's text);
    everything else is the tokenizer's."""

    def __init__(self, tokenizer, template: ChatTemplate):
        self._tok, self.template = tokenizer, template
        self._prompt: list[int] = []

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode_prompt(self, text: str) -> list[int]:
        rendered = self.template.render([{"role": "user", "content": text or ""}],
                                        add_generation_prompt=True)
        self._prompt = list(self._tok.encode(rendered))  # the template writes BOS itself
        return list(self._prompt)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        n = len(self._prompt)
        return self._tok.decode(ids[n:] if n and ids[:n] == self._prompt else ids)
