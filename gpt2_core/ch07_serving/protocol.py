"""The OpenAI completions protocol: a request body checked field by field, the text of a completion as tokens
arrive (stop strings, whole characters only), and the JSON the server answers with.

Every check names the field at fault (``BadRequest.param``), as OpenAI's errors do: a client learns what to fix.
Every limit is checked before the work it protects: the body's nesting before anything reads it, a prompt's length
against the context before it is tokenized, stop strings' number and length before a matcher is built.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field

from ..errors import BAD_JSON, GPT2Error, is_integer, is_real
from ..ch01_forward.generation import positions_needed
from .priority_scheduler import MAX_ABS_PRIORITY

MAX_LOGPROBS = 5  # OpenAI's limit for the completions API
MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_STOP_CHARS = 256  # characters per stop string: longer ones are refused (a completion of this model is short)
MAX_JSON_DEPTH = 16  # nesting of a request body; a completion needs 3 (a batch of token-id prompts)
SHOWN_CHARS = 80  # a value quoted in an error message is cut to this many characters
# Fields OpenAI's completions API has that this server does not implement: accepted only at their neutral value.
NEUTRAL = {"echo": (False, None), "frequency_penalty": (0, 0.0, None), "presence_penalty": (0, 0.0, None),
           "logit_bias": (None,), "suffix": (None,)}
# OpenAI's machine-readable ``error.code`` by HTTP status, unless a check gives a more precise one
# (``model_not_found``, ``context_length_exceeded``, ``invalid_json``, ...).
ERROR_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
               408: "request_timeout", 413: "request_too_large", 415: "unsupported_media_type",
               429: "rate_limit_exceeded", 500: "internal_error", 503: "service_unavailable"}


def error_type(status: int) -> str:
    """OpenAI's ``error.type`` for an HTTP status: the client's fault, too many requests, or the server's."""
    return "rate_limit_error" if status == 429 else "server_error" if status >= 500 else "invalid_request_error"


class BadRequest(Exception):
    """A request the server refuses: HTTP ``status`` (400 unless said), a message, the field at fault (``param``),
    OpenAI's ``type`` (from the status unless given) and ``code`` (from the status unless given)."""

    def __init__(self, message: str, param: str | None = None, status: int | None = None, kind: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        status = status if status is not None else 500 if kind == "server_error" else 400
        self.message, self.param, self.status = message, param, status
        self.kind = kind or error_type(status)
        self.code = code or ERROR_CODES.get(status, "error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def shown(value) -> str:
    """``repr(value)`` for an error message: control characters and lone surrogates escaped, cut to
    ``SHOWN_CHARS``, so that a hostile value cannot flood a log or break the JSON of the answer."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


def parse_json(raw: bytes):
    """A request body as JSON, nested at most ``MAX_JSON_DEPTH`` deep, or a 400 saying what is wrong with it."""
    try:
        body = json.loads(raw)
    except RecursionError:  # '[' nested thousands deep: not a ValueError
        raise BadRequest(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)",
                         code="invalid_json") from None
    except BAD_JSON as e:  # JSONDecodeError, bytes that are not UTF-8, an integer of thousands of digits
        raise BadRequest(f"the request body is not valid JSON ({str(e)[:200]})", code="invalid_json") from None
    if json_depth(body, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise BadRequest(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)",
                         code="invalid_json")
    return body


def json_depth(value, limit: int) -> int:
    """How deep lists and objects nest in ``value`` (a scalar: 0), counted without recursion and only up to
    ``limit + 1``."""
    depth, level = 0, [value]
    while depth <= limit:
        containers = [v for v in level if isinstance(v, (list, dict))]
        if not containers:
            break
        depth += 1
        level = [c for v in containers for c in (v.values() if isinstance(v, dict) else v)]
    return depth


@dataclass
class CompletionRequest:
    """A checked ``/v1/completions`` body, for one prompt (a batch of prompts is one of these per prompt)."""

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
        raise BadRequest(f"{name} must be {what}, got {shown(value)}", name)
    return value


def max_prompt_chars(tokenizer, n_ctx: int) -> int | None:
    """The longest text that can fit in ``n_ctx`` tokens, or None if the tokenizer gives no such bound. Each token
    of a byte-level BPE stands for at most as many characters as its vocabulary entry has (one per byte), so a
    text of more than ``n_ctx`` times the longest entry cannot fit: it is refused without being tokenized. A
    tokenizer with an unknown token (one token for any unknown run of text) has no such bound."""
    hf = getattr(tokenizer, "hf", None)
    try:
        if hf is None or getattr(hf.model, "unk_token", None) is not None:
            return None
        return n_ctx * max(len(t) for t in hf.get_vocab(with_added_tokens=True))
    except Exception:  # not a HF tokenizer as expected: no bound, every prompt is tokenized
        return None


def _encode(text: str, tokenizer, n_ctx: int, max_chars: int | None) -> list[int]:
    if max_chars is not None and len(text) > max_chars:
        raise BadRequest(f"prompt: {len(text)} characters cannot fit in the model's context of {n_ctx} tokens "
                         f"(at most {max_chars} characters for this tokenizer)", "prompt",
                         code="context_length_exceeded")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON allows "\ud800", a lone UTF-16 surrogate: not a character, not text
        raise BadRequest(f"prompt is not valid Unicode text: {e.reason} ({shown(text[e.start:e.end])} at position "
                         f"{e.start})", "prompt") from None
    try:
        return tokenizer.encode(text)
    except GPT2Error as e:  # no tokenizer (a model of token ids only), or text it refuses
        raise BadRequest(f"prompt: {e}", "prompt") from None


def _ids(prompt: list, vocab_size: int, n_ctx: int) -> list[int]:
    if len(prompt) > n_ctx:  # before looking at each id: a long list is refused at once
        raise BadRequest(f"prompt: {len(prompt)} token ids do not fit in the model's context of {n_ctx}", "prompt",
                         code="context_length_exceeded")
    bad = next((i for i, t in enumerate(prompt) if not is_integer(t, 0, vocab_size - 1)), None)
    if bad is not None:
        raise BadRequest(f"prompt: {shown(prompt[bad])} (at index {bad}) is not a token id in [0, {vocab_size})",
                         "prompt")
    return [int(t) for t in prompt]


def parse_prompts(prompt, tokenizer, vocab_size: int, n_ctx: int, max_prompts: int,
                  max_chars: int | None = None) -> list[list[int]]:
    """``prompt`` as lists of token ids, one per prompt: text, a list of token ids, or a list of those (a batch,
    at most ``max_prompts``). Text longer than ``max_chars`` (``max_prompt_chars``) is refused untokenized."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):  # a batch (or ["text"])
        if len(prompt) > max_prompts:
            raise BadRequest(f"prompt: {len(prompt)} prompts, more than the {max_prompts} one request may have here "
                             f"(the prompts times n may not exceed the server's --max-num-seqs)", "prompt")
        if not all(isinstance(p, str) or (isinstance(p, list) and not (p and isinstance(p[0], (str, list))))
                   for p in prompt):
            raise BadRequest("prompt: a batch is a list of texts or a list of lists of token ids", "prompt")
        batch = prompt
    elif isinstance(prompt, (str, list)):
        batch = [prompt]
    else:
        raise BadRequest(f"prompt must be text, a list of token ids, or a list of those; got {shown(prompt)}",
                         "prompt")
    out = [_encode(p, tokenizer, n_ctx, max_chars) if isinstance(p, str) else _ids(p, vocab_size, n_ctx)
           for p in batch]
    if not all(out):
        raise BadRequest("prompt must not be empty", "prompt")
    return out


def parse_prompt(prompt, tokenizer, vocab_size: int) -> list[int]:
    """``prompt`` as token ids: text, a list of token ids, or a list holding one of those."""
    return parse_prompts(prompt, tokenizer, vocab_size, n_ctx=2**62, max_prompts=1)[0]


def parse_completions(body, model_name: str, tokenizer, vocab_size: int, n_ctx: int, max_n: int,
                      max_chars: int | None = None) -> list[CompletionRequest]:
    """A ``/v1/completions`` body checked against the served model, one ``CompletionRequest`` per prompt (the
    prompts of a batch times ``n`` at most ``max_n``), or a ``BadRequest`` naming the field. The cheap checks
    come first; the prompts, which may need tokenizing, last."""
    r = _parse_fields(body, model_name, max_n)
    prompts = parse_prompts(body["prompt"], tokenizer, vocab_size, n_ctx, max_n // r.n, max_chars)
    for ids in prompts:
        needed = positions_needed(len(ids), r.max_tokens)
        if needed > n_ctx:
            raise BadRequest(f"the prompt ({len(ids)} tokens) and max_tokens={r.max_tokens} need {needed} "
                             f"positions, more than the model's context of {n_ctx}: shorten the prompt or lower "
                             f"max_tokens", "max_tokens", code="context_length_exceeded")
    return [dataclasses.replace(r, prompt_token_ids=ids) for ids in prompts]


def parse_completion(body, model_name: str, tokenizer, vocab_size: int, n_ctx: int, max_n: int,
                     max_chars: int | None = None) -> CompletionRequest:
    """``parse_completions`` for a body of one prompt (a batch is refused)."""
    requests = parse_completions(body, model_name, tokenizer, vocab_size, n_ctx, max_n, max_chars)
    if len(requests) != 1:
        raise BadRequest(f"prompt: one prompt expected here, got {len(requests)}", "prompt")
    return requests[0]


def _parse_fields(body, model_name: str, max_n: int) -> CompletionRequest:
    """Every field of a completions body but the prompt (left empty), checked."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"model must be a string, got {shown(model)}", "model")
    if model is not None and model != model_name:
        raise BadRequest(f"the model {shown(model)} does not exist; this server serves {model_name!r}", "model", 404,
                         "invalid_request_error", "model_not_found")
    if "prompt" not in body:
        raise BadRequest("prompt is required", "prompt")
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] not in neutral and body[name] != {}:
            raise BadRequest(f"{name} is not supported by this server (leave it out)", name,
                             code="unsupported_parameter")
    integer = lambda lo, hi=None: lambda v: is_integer(v, lo, hi)  # noqa: E731
    r = CompletionRequest([])
    r.max_tokens = _get(body, "max_tokens", 16, integer(1), "an integer >= 1")
    r.temperature = float(_get(body, "temperature", 1.0, lambda v: is_real(v) and 0 <= v <= 2, "a number in [0, 2]"))
    r.top_p = float(_get(body, "top_p", 1.0, lambda v: is_real(v) and 0 < v <= 1, "a number in (0, 1]"))
    r.top_k = _get(body, "top_k", 0, integer(-1), "an integer >= 0 (0 or -1: no limit)")
    r.n = _get(body, "n", 1, integer(1, max_n), f"an integer from 1 to {max_n}")
    best_of = body.get("best_of")
    if best_of is not None and not (is_integer(best_of) and best_of == r.n):
        raise BadRequest("best_of is not supported by this server (leave it out, or equal to n)", "best_of")
    r.stop = _parse_stop(body)
    r.seed = _get(body, "seed", None, integer(0, 2**63 - 1), "a non-negative integer")
    r.logprobs = _get(body, "logprobs", None, integer(0, MAX_LOGPROBS), f"an integer from 0 to {MAX_LOGPROBS}")
    r.priority = _get(body, "priority", 0, integer(-MAX_ABS_PRIORITY, MAX_ABS_PRIORITY),
                      f"an integer in [-{MAX_ABS_PRIORITY}, {MAX_ABS_PRIORITY}] (lower = more urgent)")
    r.stream = _get(body, "stream", False, lambda v: isinstance(v, bool), "true or false")
    options = _get(body, "stream_options", {}, lambda v: isinstance(v, dict), "an object")
    if body.get("stream_options") is not None and not r.stream:
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
    r.include_usage = _get(options, "include_usage", False, lambda v: isinstance(v, bool), "true or false")
    return r



def _parse_stop(body: dict) -> list[str]:
    what = f"a string or a list of at most {MAX_STOP} strings"
    stop = _get(body, "stop", [], lambda v: isinstance(v, (str, list)), what)
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP or not all(isinstance(s, str) for s in stop):
        raise BadRequest(f"stop must be {what}, got {shown(stop)}", "stop")
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise BadRequest(f"stop: a stop string may have at most {MAX_STOP_CHARS} characters, got one of {longest}",
                         "stop")
    return list(dict.fromkeys(s for s in stop if s))  # empty ones and repeats dropped


class StopMatcher:
    """Finds the first stop string in a text handed over piece by piece, in time linear in the text: each stop
    string runs a Knuth-Morris-Pratt automaton whose state is the longest end of the text so far that begins the
    stop string. Each character costs O(1) amortized, whatever the stop strings' length; the state also says how
    much of the text's end must be held back, since it may still become a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.fail = [self.failure(s) for s in self.stops]
        self.state = [0] * len(self.stops)  # characters of each stop string matched by the end of the text
        self.length = 0  # characters fed so far

    @staticmethod
    def failure(s: str) -> list[int]:
        """``f[q]``: the longest proper prefix of ``s[:q + 1]`` that is also its suffix (KMP's table), O(len(s))."""
        f, k = [0] * len(s), 0
        for q in range(1, len(s)):
            while k and s[q] != s[k]:
                k = f[k - 1]
            if s[q] == s[k]:
                k += 1
            f[q] = k
        return f

    def feed(self, piece: str) -> int | None:
        """Append ``piece``; return where the first stop string found starts in the whole text, or None."""
        first = None
        for j, s in enumerate(self.stops):
            q, f = self.state[j], self.fail[j]
            for i, c in enumerate(piece):
                while q and s[q] != c:
                    q = f[q - 1]
                if s[q] == c:
                    q += 1
                if q == len(s):  # a whole match, ending at character i of the piece
                    start = self.length + i + 1 - len(s)
                    first = start if first is None else min(first, start)
                    q = f[q - 1]  # as KMP goes on (the caller stops at the first match anyway)
                    break
            self.state[j] = q
        self.length += len(piece)
        return first

    def held(self) -> int:
        """Characters at the end of the text that begin a stop string (and could still become one)."""
        return max(self.state, default=0)


class TextStream:
    """The text of one completion as its tokens arrive: only whole characters, cut at the first stop string, and
    holding back the end of the text while it could still become a stop string."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.matcher = StopMatcher(stop)
        self.token_ids: list[int] = []
        self.sent = 0  # characters of the text handed out so far
        self.stopped = False  # a stop string was found: the completion ends here

    def add(self, token: int) -> str:
        """Append ``token``; return the text that may be sent now. Only the characters new since the last token go
        through the stop strings' matcher."""
        self.token_ids.append(token)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # the last token ends inside a character: wait for the rest of its bytes
            text = text.rstrip("\ufffd")
        cut = self.matcher.feed(text[self.matcher.length:])  # the text before is settled: more bytes only add to it
        if cut is not None:
            self.stopped = True
            text = text[:cut]
        else:  # keep back the longest end of the text that begins a stop string
            text = text[:len(text) - self.matcher.held()]
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
    """(the token's text, its log-probability, its ``k`` most likely alternatives {text: logprob}, and the sampled
    token itself as vLLM gives it, so ``logprobs=0`` still shows it) from the row it was sampled from."""
    top = _top_k(logprobs, k) if k else []
    alts = {}
    for i in top:
        alts.setdefault(tokenizer.decode([int(i)]), float(logprobs[i]))
    text = tokenizer.decode([token])
    alts.setdefault(text, float(logprobs[token]))
    return text, float(logprobs[token]), alts


def _top_k(row, k: int) -> list[int]:
    import numpy as np

    idx = np.argpartition(-row, k - 1)[:k]
    return idx[np.argsort(-row[idx], kind="stable")].tolist()


def completion_id(prefix: str = "cmpl") -> str:
    return f"{prefix}-{time.time_ns():x}"
