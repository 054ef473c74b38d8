"""A chat's messages -> the prompt text an instruct model was trained on, with the model's own Jinja2 template.

An instruct model ships its chat format as a Jinja2 template (``chat_template`` in ``tokenizer_config.json``, or
``chat_template.jinja`` beside it, or ``tokenizer.chat_template`` in a GGUF file). Rendering it runs code that came
with the model, so, as transformers does, it runs in Jinja2's immutable sandbox: no attribute access to Python
internals, no mutation of the messages. The environment is transformers' own (``trim_blocks``, ``lstrip_blocks``,
``{% break %}``/``{% continue %}``, ``{% generation %}`` blocks, its ``tojson``, ``raise_exception`` and
``strftime_now``), so a template renders here exactly as ``tokenizer.apply_chat_template(..., tokenize=False)``
renders it. The template sees ``messages``, ``add_generation_prompt``, ``tools`` and ``documents`` (None here) and
the special tokens (``bos_token``, ``eos_token``, ...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache

from ..errors import InvalidInputError

ROLES = ("system", "user", "assistant", "tool")


class TemplateError(InvalidInputError):
    """The template refused the conversation, or is not a valid template (a client's 400, not a server fault)."""


def utf8_text(text: str, where: str) -> str:
    """``text`` if it can be encoded as UTF-8 (JSON can carry a lone surrogate such as \\ud800, which cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInputError(f"{where}.content is not valid text: it holds a lone UTF-16 surrogate") from None
    return text


def message_text(content, where: str) -> str:
    """A message's content as text: a string, or OpenAI's list of ``{"type": "text", "text": ...}`` parts, joined
    with newlines as vLLM joins them for a template that expects text."""
    if isinstance(content, str):
        return utf8_text(content, where)
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)) and content and all(
            isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return utf8_text("\n".join(p["text"] for p in content), where)
    raise InvalidInputError(f"{where}.content must be a string or a list of {{\"type\": \"text\", \"text\": ...}} "
                            f"parts (this model reads text only)")


def check_messages(messages) -> list[dict]:
    """``messages`` as a list of ``{"role", "content"}`` dicts with string content, or a clear error."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise InvalidInputError("messages must be a non-empty list of {role, content} objects")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidInputError(f"messages[{i}] must be an object with role and content")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidInputError(f"messages[{i}].role must be one of {', '.join(ROLES)} (got {role!r})")
        checked.append({"role": role, "content": message_text(message.get("content"), f"messages[{i}]")})
    return checked


def _raise_exception(message):
    raise TemplateError(f"the chat template refused the conversation: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' ``tojson``: no HTML escaping (Jinja's own escapes ``<``), and json.dumps' options."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


def _generation_extension():
    """``{% generation %}...{% endgeneration %}``, which marks the assistant's part for training masks: rendered
    as its body (transformers' ``AssistantTracker`` when it is not tracking)."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return Generation


@lru_cache(maxsize=8)
def compile_template(template: str):
    """The template compiled once in an immutable sandbox, in transformers' environment."""
    from jinja2 import TemplateSyntaxError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_extension(), loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except TemplateSyntaxError as e:
        raise TemplateError(f"the model's chat template is not valid Jinja2: {e}") from None


def apply_chat_template(template: str | None, messages, *, add_generation_prompt: bool = True,
                        bos_token: str = "", eos_token: str = "", **special_tokens) -> str:
    """Render ``messages`` with the model's ``template``; a model without one gets a clear error.
    ``special_tokens`` (``unk_token``, ``pad_token``, ...) reach the template as transformers passes them."""
    if not template:
        raise TemplateError("this model has no chat template (chat_template in its tokenizer_config.json); "
                            "send a plain prompt to /v1/completions instead")
    import jinja2

    compiled, messages = compile_template(template), check_messages(messages)
    try:
        return compiled.render(messages=messages, tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                               eos_token=eos_token, **special_tokens)
    except TemplateError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, ArithmeticError, LookupError, RecursionError) as e:
        raise TemplateError(f"the chat template failed on this conversation: {type(e).__name__}: {e}") from None
