"""Chat templates: a conversation rendered to the prompt text the model was trained on.

The template is the model's own Jinja (a GGUF's ``tokenizer.chat_template``, a directory's
``tokenizer_config.json``), rendered the way transformers' ``apply_chat_template`` renders it:
in jinja2's immutable sandbox (a template is data from the model file, not code we trust),
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson``
filter, and the globals ``raise_exception`` and ``strftime_now``. The template sees
``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token`` and any extra keyword.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import jinja2

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """A conversation that cannot be rendered: no template, a malformed message, or an error
    the template raised (its own ``raise_exception``, a syntax error)."""


def _raise(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _tojson(value: Any, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template does not parse: {exc} (line {exc.lineno})"
                                ) from exc


def check_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Each message a mapping with a string ``role`` and string ``content``."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role', 'content'} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}] is a {type(m).__name__}, not a dict")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ChatTemplateError(f"messages[{i}][{key!r}] must be a string")
        out.append(dict(m))
    return out


def render_chat(template: str, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                bos_token: str | None = None, eos_token: str | None = None,
                **kwargs: Any) -> str:
    """The prompt text ``template`` makes of ``messages``."""
    import jinja2

    compiled = _compile(template)
    try:
        return compiled.render(messages=check_messages(messages),
                               add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token or "", eos_token=eos_token or "", **kwargs)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed: {exc}") from exc


class TemplateSource(Protocol):
    """What a chat template needs of a tokenizer (a Tokenizer has it)."""

    @property
    def chat_template(self) -> str | None: ...

    @property
    def bos_token(self) -> str | None: ...

    @property
    def eos_token(self) -> str | None: ...


def apply_chat_template(tokenizer: TemplateSource, messages: Sequence[Message], *,
                        chat_template: str | None = None, add_generation_prompt: bool = True,
                        **kwargs: Any) -> str:
    """``messages`` rendered with the model's template (or ``chat_template``)."""
    template = chat_template or tokenizer.chat_template
    if not template:
        raise ChatTemplateError("this model has no chat template: pass chat_template=...")
    return render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                       bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token, **kwargs)
