"""The OpenAI completions protocol: a request body checked field by field, the text of a completion as tokens
arrive (stop strings, whole characters only), and the JSON the server answers with.

Every check names the field at fault (``BadRequest.param``), as OpenAI's errors do: a client learns what to fix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..errors import is_integer, is_real
from ..ch01_forward.generation import positions_needed
from .priority_scheduler import MAX_ABS_PRIORITY

MAX_LOGPROBS = 5  # OpenAI's limit for the completions API
MAX_STOP = 4  # stop strings per request (OpenAI's limit)
# Fields OpenAI's completions API has that this server does not implement: accepted only at their neutral value.
NEUTRAL = {"echo": (False, None), "frequency_penalty": (0, 0.0, None), "presence_penalty": (0, 0.0, None),
           "logit_bias": (None,), "suffix": (None,)}


class BadRequest(Exception):
    """A request the server refuses: HTTP ``status`` (400, 404, 429), a message, and the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


@dataclass
class CompletionRequest:
    """A checked ``/v1/completions`` body."""

    prompt_token_ids: list
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stop: list = field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = None
    priority: int = 0
    stream: bool = False
    include_usage: bool = False


def _get(body: dict, name: str, default, check, what: str):
    """``body[name]`` (``default`` when absent or null), or a ``BadRequest`` naming ``name`` and saying ``what``."""
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise BadRequest(f"{name} must be {what}, got {value!r}", name)
    return value


def parse_prompt(prompt, tokenizer, vocab_size: int) -> list[int]:
    """``prompt`` as token ids: text, a list of token ids, or a list holding one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # the OpenAI client sends ["text"] or [[ids]] for one prompt too
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(is_integer(t) for t in prompt):
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise BadRequest(f"prompt: {bad} is not a token id in [0, {vocab_size})", "prompt")
        ids = [int(t) for t in prompt]
    elif isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest(f"prompt: one prompt per request (got {len(prompt)}); send one request for each", "prompt")
    else:
        raise BadRequest("prompt must be text or a list of token ids", "prompt")
    if not ids:
        raise BadRequest("prompt must not be empty", "prompt")
    return ids


def parse_completion(body, model_name: str, tokenizer, vocab_size: int, n_ctx: int,
                     max_n: int) -> CompletionRequest:
    """A ``/v1/completions`` body checked against the served model, or a ``BadRequest`` naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise BadRequest(f"the model {model!r} does not exist; this server serves {model_name!r}", "model", 404,
                         "model_not_found")
    if "prompt" not in body:
        raise BadRequest("prompt is required", "prompt")
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] not in neutral and body[name] != {}:
            raise BadRequest(f"{name} is not supported by this server (leave it out)", name)
    integer = lambda lo, hi=None: lambda v: is_integer(v, lo, hi)  # noqa: E731
    r = CompletionRequest(parse_prompt(body["prompt"], tokenizer, vocab_size))
    r.max_tokens = _get(body, "max_tokens", 16, integer(1), "an integer >= 1")
    r.temperature = float(_get(body, "temperature", 1.0, lambda v: is_real(v) and 0 <= v <= 2, "a number in [0, 2]"))
    r.top_p = float(_get(body, "top_p", 1.0, lambda v: is_real(v) and 0 < v <= 1, "a number in (0, 1]"))
    r.top_k = _get(body, "top_k", 0, integer(-1), "an integer >= 0 (0 or -1: no limit)")
    r.n = _get(body, "n", 1, integer(1, max_n), f"an integer from 1 to {max_n}")
    best_of = body.get("best_of")
    if best_of is not None and best_of != r.n:
        raise BadRequest("best_of is not supported by this server (leave it out, or equal to n)", "best_of")
    stop = _get(body, "stop", [], lambda v: isinstance(v, str) or (
        isinstance(v, list) and len(v) <= MAX_STOP and all(isinstance(s, str) for s in v)),
        f"a string or a list of at most {MAX_STOP} strings")
    r.stop = [s for s in ([stop] if isinstance(stop, str) else stop) if s]
    r.seed = _get(body, "seed", None, integer(0, 2**63 - 1), "a non-negative integer")
    r.logprobs = _get(body, "logprobs", None, integer(0, MAX_LOGPROBS), f"an integer from 0 to {MAX_LOGPROBS}")
    r.priority = _get(body, "priority", 0, integer(-MAX_ABS_PRIORITY, MAX_ABS_PRIORITY),
                      f"an integer in [-{MAX_ABS_PRIORITY}, {MAX_ABS_PRIORITY}] (lower = more urgent)")
    r.stream = _get(body, "stream", False, lambda v: isinstance(v, bool), "true or false")
    options = _get(body, "stream_options", {}, lambda v: isinstance(v, dict), "an object")
    r.include_usage = _get(options, "include_usage", False, lambda v: isinstance(v, bool), "true or false")
    needed = positions_needed(len(r.prompt_token_ids), r.max_tokens)
    if needed > n_ctx:
        raise BadRequest(f"the prompt ({len(r.prompt_token_ids)} tokens) and max_tokens={r.max_tokens} need "
                         f"{needed} positions, more than the model's context of {n_ctx}: shorten the prompt or "
                         f"lower max_tokens", "max_tokens")
    return r


class TextStream:
    """The text of one completion as its tokens arrive: only whole characters, cut at the first stop string, and
    holding back the end of the text while it could still become a stop string."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.token_ids: list[int] = []
        self.sent = 0  # characters of the text handed out so far
        self.stopped = False  # a stop string was found: the completion ends here

    def add(self, token: int) -> str:
        """Append ``token``; return the text that may be sent now."""
        self.token_ids.append(token)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # the last token ends inside a character: wait for the rest of its bytes
            text = text.rstrip("\ufffd")
        cut = min((i for i in (text.find(s, max(self.sent - len(s), 0)) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            text = text[:cut]
        else:  # keep back the longest end of the text that begins a stop string
            held = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[:len(text) - held]
        piece, self.sent = text[self.sent:], max(self.sent, len(text))
        return piece

    def finish(self) -> str:
        """The text held back, once no token will follow (it did not become a stop string)."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        piece, self.sent = text[self.sent:], len(text)
        return piece


def token_logprobs(tokenizer, token: int, logprobs, k: int) -> tuple[str, float, dict]:
    """(the token's text, its log-probability, its ``k`` most likely alternatives {text: logprob}) from the row of
    log-probabilities it was sampled from."""
    top = _top_k(logprobs, k) if k else []
    alts = {}
    for i in top:
        alts.setdefault(tokenizer.decode([int(i)]), float(logprobs[i]))
    return tokenizer.decode([token]), float(logprobs[token]), alts


def _top_k(row, k: int) -> list[int]:
    import numpy as np

    idx = np.argpartition(-row, k - 1)[:k]
    return idx[np.argsort(-row[idx], kind="stable")].tolist()


def completion_id() -> str:
    return f"cmpl-{time.time_ns():x}"


