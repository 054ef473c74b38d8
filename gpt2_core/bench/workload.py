"""Workloads for serving benchmarks: a seeded generator, a JSONL trace format, and a summary of the results.

A workload is a list of ``Request``s with arrival times. ``poisson_workload`` draws one: arrivals of a Poisson
process (exponential gaps at ``request_rate`` requests/s), prompt and output lengths from clipped log-normal
distributions (most requests short, a long tail of long ones, as in real chat traffic). ``standard_workload`` is
the named, seeded default that the batching (chapter 3) and paged (chapter 4) benchmarks share.

Trace format (JSONL, one request per line)::

    {"request_id": 0, "prompt_len": 57, "max_new_tokens": 31, "arrival_s": 0.0}
    {"request_id": 1, "prompt": "It is a truth", "max_new_tokens": 20, "arrival_s": 0.41, "temperature": 0.8, "seed": 1}

``prompt`` (text, needs a tokenizer), ``prompt_token_ids``, or ``prompt_len`` (random ids, seeded as
``poisson_workload`` seeds them, so a saved workload replays with the same prompts) give the prompt;
``temperature``, ``top_k``, ``top_p``, ``seed`` are optional sampling parameters.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import BAD_JSON, InvalidInputError, is_integer, is_real
from ..ch01_forward.sampling import SamplingParams, sampling_params_of
from ..ch03_batching.sequence import FinishReason, Request

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "seed")
MAX_PROMPT_LEN = 1_000_000  # a trace's prompt_len, at most: far past any context, and a bounded allocation


def lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float, low: int, high: int) -> list:
    """``n`` integer lengths, log-normal around ``median`` (long right tail), clipped to [low, high]."""
    x = rng.lognormal(np.log(median), sigma, size=n)
    return np.clip(np.round(x), low, high).astype(int).tolist()


def check_lengths(name: str, dist, least: int = 0) -> None:
    """``dist`` = (median, sigma, low, high) of ``lognormal_lengths``, lengths >= ``least``, or an
    ``InvalidInputError`` naming ``name``."""
    try:
        median, sigma, low, high = dist
    except (TypeError, ValueError):
        raise InvalidInputError(f"{name} must be (median, sigma, low, high), got {dist!r}") from None
    if not (is_real(median) and median > 0 and is_real(sigma) and sigma >= 0):
        raise InvalidInputError(f"{name}: the median must be > 0 and sigma >= 0, got {dist!r}")
    if not (is_integer(low, least) and is_integer(high, low)):
        raise InvalidInputError(f"{name}: low and high must be integers with {least} <= low <= high, got {dist!r}")


def random_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab_size, size=length).tolist()


def poisson_workload(num_requests: int, request_rate: float, vocab_size: int, seed: int = 0,
                     prompt_len=(64, 0.8, 16, 256), output_len=(48, 0.9, 16, 256),
                     stop_at_eos: bool = False) -> list[Request]:
    """A seeded workload. ``prompt_len`` / ``output_len`` = (median, sigma, low, high) of clipped log-normals;
    ``request_rate`` in requests/s (``float('inf')``: all arrive at t=0). Greedy, random prompt ids."""
    if not is_integer(num_requests, 1):
        raise InvalidInputError(f"num_requests must be a positive integer, got {num_requests!r}")
    if not (request_rate == float("inf") or is_real(request_rate) and request_rate > 0):
        raise InvalidInputError(f"request_rate must be > 0 requests/s (inf: all at once), got {request_rate!r}")
    if not is_integer(vocab_size, 1):
        raise InvalidInputError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    if not is_integer(seed, 0):
        raise InvalidInputError(f"seed must be an integer >= 0, got {seed!r}")
    check_lengths("prompt_len", prompt_len, least=1)  # a prompt has at least one token
    check_lengths("output_len", output_len)
    rng = np.random.default_rng(seed)
    gaps = np.zeros(num_requests) if np.isinf(request_rate) else rng.exponential(1 / request_rate, num_requests)
    arrivals = np.cumsum(gaps) - gaps[0]  # the first request arrives at t = 0
    prompts = lognormal_lengths(rng, num_requests, *prompt_len)
    outputs = lognormal_lengths(rng, num_requests, *output_len)
    return [Request(request_id=i, prompt_token_ids=random_prompt(vocab_size, p, seed * 100_003 + i),
                    max_new_tokens=o, arrival_s=round(float(a), 4), stop_at_eos=stop_at_eos)
            for i, (p, o, a) in enumerate(zip(prompts, outputs, arrivals))]


def standard_workload(num_requests: int = 48, seed: int = 0, request_rate: float = 4.0,
                      vocab_size: int = 50257) -> list[Request]:
    """The benchmarks' default: 48 requests arriving at 4/s (faster than sequential decoding can serve them),
    prompts 16-256 tokens (median 64), outputs 16-256 tokens (median 48, long tail); eos ignored so that every
    strategy generates exactly the same number of tokens."""
    return poisson_workload(num_requests, request_rate, vocab_size, seed=seed)


# ----------------------------------------------------------------------------------------------------------------
# JSONL traces


def is_trace_id(value) -> bool:
    """A ``request_id`` a trace line can hold: a JSON string or integer, never a bool."""
    return isinstance(value, (str, int)) and not isinstance(value, bool)


def save_trace(requests, path, with_token_ids: bool = False) -> None:
    """Write ``requests`` as JSONL (``prompt_len`` only, unless ``with_token_ids``). Every request is checked
    before the file is written, so that ``load_trace`` reads back exactly what was given: a request_id must be a
    str or an int and unique, the prompt non-empty (token ids integers >= 0), ``max_new_tokens`` an integer >= 0,
    ``arrival_s`` a finite number >= 0, ``stop_at_eos`` True or False, ``stop_token_id`` None or an integer >= 0,
    the sampling parameters valid ones. Nothing is rounded or converted silently."""
    lines, seen = [], set()
    for r in requests:
        request_id = r.request_id.item() if isinstance(r.request_id, np.integer) else r.request_id
        if not is_trace_id(request_id):
            raise InvalidInputError(f"save_trace: request_id must be a str or an int, got {r.request_id!r}")
        if request_id in seen:
            raise InvalidInputError(f"save_trace: request_id {request_id!r} is used twice")
        seen.add(request_id)
        where = f"save_trace: request {request_id!r}"
        try:
            prompt = list(r.prompt_token_ids)
        except TypeError:
            raise InvalidInputError(f"{where}: prompt_token_ids must be a list of token ids") from None
        if not prompt or not all(is_integer(t, 0) for t in prompt):
            raise InvalidInputError(f"{where}: the prompt must be a non-empty list of token ids (integers >= 0)")
        if not is_integer(r.max_new_tokens, 0):
            raise InvalidInputError(f"{where}: max_new_tokens must be an integer >= 0, got {r.max_new_tokens!r}")
        if not is_real(r.arrival_s) or r.arrival_s < 0:
            raise InvalidInputError(f"{where}: arrival_s must be a finite number >= 0, got {r.arrival_s!r}")
        if not isinstance(r.stop_at_eos, (bool, np.bool_)):
            raise InvalidInputError(f"{where}: stop_at_eos must be True or False, got {r.stop_at_eos!r}")
        if r.stop_token_id is not None and not is_integer(r.stop_token_id, 0):
            raise InvalidInputError(f"{where}: stop_token_id must be None or a token id, got {r.stop_token_id!r}")
        d = {"request_id": request_id}
        if with_token_ids:
            d["prompt_token_ids"] = [int(t) for t in prompt]
        else:
            d["prompt_len"] = len(prompt)
        d["max_new_tokens"] = int(r.max_new_tokens)
        d["arrival_s"] = float(r.arrival_s)
        try:  # SamplingParams checks the values and stores Python numbers, which json can write
            sp = sampling_params_of(r.sampling_params).__dict__
        except InvalidInputError as e:  # e.g. an unknown parameter name: refused, not dropped
            raise InvalidInputError(f"save_trace: request {request_id!r}: {e}") from None
        defaults = SamplingParams().__dict__
        d.update({k: sp[k] for k in SAMPLING_KEYS if k in sp and sp[k] != defaults[k]})  # seed 0 is a seed
        if r.stop_at_eos:  # load_trace's default is False
            d["stop_at_eos"] = True
        if r.stop_token_id is not None:
            d["stop_token_id"] = int(r.stop_token_id)
        lines.append(json.dumps(d))
    Path(path).write_text("\n".join(lines) + "\n")


def load_trace(path, vocab_size: int, tokenizer=None, seed: int = 0, stop_at_eos: bool = False) -> list[Request]:
    """Read a JSONL trace into ``Request``s, one per line: ``prompt`` (text, needs ``tokenizer``),
    ``prompt_token_ids`` or ``prompt_len`` (random ids, seeded); ``max_new_tokens`` (default 16); ``arrival_s``
    (seconds, default 0); optional ``request_id`` (default: the line's index, unique), ``temperature``, ``top_k``,
    ``top_p``, ``seed``, ``stop_at_eos`` (default ``stop_at_eos``) and ``stop_token_id``.

    A line that breaks the format (not JSON, no prompt, an unknown field, a count or time that is not a number of
    the right kind, a request_id used twice) is an ``InvalidInputError`` naming ``path:line``. Values the format
    allows but a model may refuse (sampling parameters, token ids, lengths past the context) are checked by the
    engine, so such a request fails alone."""
    if not is_integer(vocab_size, 1):
        raise InvalidInputError(f"load_trace: vocab_size must be a positive integer, got {vocab_size!r}")
    if not is_integer(seed, 0):
        raise InvalidInputError(f"load_trace: seed must be an integer >= 0, got {seed!r}")
    requests, seen = [], set()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidInputError(f"{path}: cannot read the trace ({type(e).__name__}: {e})") from None
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except BAD_JSON as e:  # incl. '[' nested thousands deep, a number of thousands of digits
            raise InvalidInputError(f"{path}:{n}: not valid JSON ({type(e).__name__}: {e})") from None
        if not isinstance(d, dict):
            raise InvalidInputError(f"{path}:{n}: expected a JSON object")
        unknown = sorted(set(d) - TRACE_KEYS)
        if unknown:
            raise InvalidInputError(f"{path}:{n}: unknown field(s) {', '.join(map(repr, unknown))}; a line may have "
                                    f"{', '.join(sorted(TRACE_KEYS))}")
        if "prompt" in d:
            if tokenizer is None:
                raise InvalidInputError(f"{path}:{n}: a text prompt needs a tokenizer")
            if not isinstance(d["prompt"], str):
                raise InvalidInputError(f"{path}:{n}: 'prompt' must be text, got {d['prompt']!r}")
            ids = tokenizer.encode(d["prompt"])
        elif "prompt_token_ids" in d:
            if not isinstance(d["prompt_token_ids"], list):
                raise InvalidInputError(f"{path}:{n}: 'prompt_token_ids' must be a list of token ids")
            ids = list(d["prompt_token_ids"])  # the engine checks each id, so one bad line fails alone
        elif "prompt_len" in d:
            length = _count(d, "prompt_len", path, n, 1, maximum=MAX_PROMPT_LEN)
            ids = random_prompt(vocab_size, length, seed * 100_003 + len(requests))
        else:
            raise InvalidInputError(f"{path}:{n}: needs 'prompt', 'prompt_token_ids' or 'prompt_len'")
        arrival = d.get("arrival_s", 0.0)
        if not is_real(arrival) or arrival < 0:
            raise InvalidInputError(f"{path}:{n}: 'arrival_s' must be a finite number >= 0, got {arrival!r}")
        if not isinstance(d.get("stop_at_eos", False), bool):
            raise InvalidInputError(f"{path}:{n}: 'stop_at_eos' must be true or false, got {d['stop_at_eos']!r}")
        request_id = d.get("request_id", n - 1)
        if not is_trace_id(request_id):
            raise InvalidInputError(f"{path}:{n}: 'request_id' must be a string or an integer, got {request_id!r}")
        if request_id in seen:
            raise InvalidInputError(f"{path}:{n}: request_id {request_id!r} is used by an earlier line")
        seen.add(request_id)
        sampling = {k: d[k] for k in SAMPLING_KEYS if k in d}
        requests.append(Request(request_id=request_id, prompt_token_ids=ids,
                                max_new_tokens=_count(d, "max_new_tokens", path, n, 0, default=16),
                                sampling_params=sampling or SamplingParams(), arrival_s=float(arrival),
                                stop_at_eos=d.get("stop_at_eos", stop_at_eos), stop_token_id=d.get("stop_token_id")))
    return requests


TRACE_KEYS = {"request_id", "prompt", "prompt_token_ids", "prompt_len", "max_new_tokens", "arrival_s",
              "stop_at_eos", "stop_token_id", *SAMPLING_KEYS}


def _count(d: dict, key: str, path, n: int, minimum: int, default: int | None = None,
           maximum: int | None = None) -> int:
    """``d[key]`` as an integer in [``minimum``, ``maximum``] (``default`` if absent), or an error naming the line."""
    value = d.get(key, default)
    if not is_integer(value, minimum, maximum):
        limit = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum:,}]"
        raise InvalidInputError(f"{path}:{n}: '{key}' must be an integer {limit}, got {value!r}")
    return value


# ----------------------------------------------------------------------------------------------------------------
# Summaries


def _stats(values, prefix: str) -> dict:
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return {f"mean_{prefix}": None, f"p50_{prefix}": None, f"p99_{prefix}": None}
    return {f"mean_{prefix}": float(v.mean()), f"p50_{prefix}": float(np.percentile(v, 50)),
            f"p99_{prefix}": float(np.percentile(v, 99))}


def summarize(outputs, duration_s: float | None = None) -> dict:
    """Throughput and latency of a list of ``RequestOutput``s: output tok/s; mean/p50/p99 of time to first token,
    inter-token latency (all gaps of all requests pooled) and end-to-end latency, in seconds."""
    ok = [o for o in outputs if o.finish_reason is not FinishReason.ERROR]
    tokens = sum(len(o.output_token_ids) for o in ok)
    if duration_s is None:
        starts = [o.metrics.arrival_time for o in ok]
        ends = [o.metrics.finished_time for o in ok if o.metrics.finished_time is not None]
        duration_s = (max(ends) - min(starts)) if ok and ends else 0.0
    ttft = [o.metrics.time_to_first_token for o in ok if o.metrics.time_to_first_token is not None]
    itl = [gap for o in ok for gap in o.metrics.inter_token_latencies]
    e2e = [o.metrics.e2e_latency for o in ok if o.metrics.e2e_latency is not None]
    return {"num_requests": len(outputs), "num_errors": len(outputs) - len(ok), "output_tokens": tokens,
            "duration_s": duration_s, "tokens_per_s": tokens / duration_s if duration_s else None,
            **_stats(ttft, "ttft_s"), **_stats(itl, "itl_s"), **_stats(e2e, "e2e_s"),
            "num_preemptions": sum(o.metrics.num_preemptions for o in ok)}
