"""A chat's messages -> the prompt text an instruct model was trained on, with the model's own Jinja2 template.

An instruct model ships its chat format as a Jinja2 template (``chat_template`` in ``tokenizer_config.json``, or
``tokenizer.chat_template`` in a GGUF file). Rendering it runs code that came with the model, so, as transformers
does, it runs in Jinja2's immutable sandbox: no attribute access to Python internals, no mutation of the messages.
The template sees ``messages``, ``add_generation_prompt`` and the special tokens (``bos_token``, ``eos_token``), and
may call ``raise_exception(message)`` to refuse a conversation it cannot format.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache

from ..errors import InvalidInputError

ROLES = ("system", "user", "assistant", "tool")


class TemplateError(InvalidInputError):
    """The template refused the conversation, or is not a valid template (a client's 400, not a server fault)."""


def check_messages(messages) -> list[dict]:
    """``messages`` as a list of ``{"role", "content"}`` dicts with string content, or a clear error."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise InvalidInputError("messages must be a non-empty list of {role, content} objects")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidInputError(f"messages[{i}] must be an object with role and content")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise InvalidInputError(f"messages[{i}].role must be one of {', '.join(ROLES)} (got {role!r})")
        if not isinstance(content, str):
            raise InvalidInputError(f"messages[{i}].content must be a string")
        checked.append({"role": role, "content": content})
    return checked


def _raise_exception(message):
    raise TemplateError(f"the chat template refused the conversation: {message}")


@lru_cache(maxsize=8)
def compile_template(template: str):
    """The template compiled once in an immutable sandbox (``trim_blocks``/``lstrip_blocks`` as transformers)."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(template)
    except TemplateSyntaxError as e:
        raise TemplateError(f"the model's chat template is not valid Jinja2: {e}") from None


def apply_chat_template(template: str | None, messages, *, add_generation_prompt: bool = True,
                        bos_token: str = "", eos_token: str = "") -> str:
    """Render ``messages`` with the model's ``template``; a model without one gets a clear error."""
    if not template:
        raise TemplateError("this model has no chat template (chat_template in its tokenizer_config.json); "
                            "send a plain prompt to /v1/completions instead")
    from jinja2.exceptions import SecurityError, UndefinedError

    try:
        return compile_template(template).render(messages=check_messages(messages),
                                                 add_generation_prompt=add_generation_prompt,
                                                 bos_token=bos_token, eos_token=eos_token)
    except (SecurityError, UndefinedError, TypeError) as e:
        raise TemplateError(f"the chat template failed on this conversation: {e}") from None
