"""Replaying a workload: requests fed to an engine at their arrival times, on a wall clock or a step clock.

Serving is measured on arrivals: a request's time to first token counts from when it arrives. ``replay`` drives
chapter 3's ``LLMEngine`` (or chapter 4's, with a paged store), ``replay_static`` the static batches of chapter 3's
first try, from the same ``Request``s (``arrival_s``: seconds after the start of the workload).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import numpy as np

from ..ch03_batching import static_batching
from ..ch03_batching.engine import LLMEngine, RequestOutput
from ..errors import InvalidInputError, is_integer, is_real
from ..ch03_batching.sequence import FinishReason, Request, SequenceMetrics
from ..loading.weights import GPT2Model


def check_arrivals(requests) -> None:
    """Every request's ``arrival_s`` a finite number >= 0, or an ``InvalidInputError`` naming the first that is not.
    The replays (``replay``, ``replay_static``) refuse the whole call: they cannot place a
    request in time without it."""
    for r in requests:
        a = getattr(r, "arrival_s", None)
        if not is_real(a) or a < 0:
            raise InvalidInputError(f"request {getattr(r, 'request_id', '?')!r}: arrival_s must be a finite number "
                                    f">= 0, got {a!r}")


def replay(engine: LLMEngine, requests: Iterable[Request], clock: str = "wall",
           time_scale: float = 1.0) -> list[RequestOutput]:
    """Feed ``requests`` to ``engine`` as they arrive and run until all finish; results in arrival order.

    ``clock="wall"``: a request is added once ``time.perf_counter()`` has passed its ``arrival_s * time_scale``
    (the engine idles by sleeping when nothing is running); its metrics count from that arrival time.
    ``clock="steps"``: ``arrival_s`` is read as a step number — deterministic, for tests.
    """
    if clock not in ("wall", "steps"):
        raise InvalidInputError(f"clock must be 'wall' or 'steps', got {clock!r}")
    if not is_real(time_scale) or time_scale < 0:
        raise InvalidInputError(f"time_scale must be a finite number >= 0, got {time_scale!r}")
    requests = list(requests)
    engine._check_new(requests)
    check_arrivals(requests)
    for r in requests:
        if not is_real(r.arrival_s * time_scale):
            raise InvalidInputError(f"request {r.request_id!r}: arrival_s x time_scale = {r.arrival_s * time_scale!r}, "
                                    f"past any clock")
    queue = sorted(requests, key=lambda r: r.arrival_s)
    ids, i, t0, tick = [], 0, engine.clock(), 0
    while i < len(queue) or engine.has_unfinished():
        now = tick if clock == "steps" else engine.clock() - t0
        while i < len(queue) and queue[i].arrival_s * time_scale <= now:
            arrival = None if clock == "steps" else t0 + queue[i].arrival_s * time_scale
            ids.append(engine.add_request(queue[i], arrival_time=arrival))
            i += 1
        if engine.has_unfinished():
            engine.step()
        elif i < len(queue) and clock == "wall":  # idle until the next arrival
            time.sleep(max(0.0, t0 + queue[i].arrival_s * time_scale - engine.clock()))
        elif i < len(queue):  # on the step clock, skip the idle steps at once
            tick = max(tick, math.ceil(queue[i].arrival_s * time_scale) - 1)
        tick += 1
    return [RequestOutput.from_sequence(engine.sequences[j]) for j in ids]


def arrival_batches(requests, batch_size: int, clock: str = "wall", t0: float | None = None):
    """Yield static batches: wait for the next arrival, then take up to ``batch_size`` requests that have arrived.

    ``clock="wall"`` honours ``arrival_s`` (sleeping until it), counted from ``t0`` (default: now);
    ``clock="offline"`` treats all as arrived at once.
    """
    queue = sorted(requests, key=lambda r: r.arrival_s)
    t0, i = time.perf_counter() if t0 is None else t0, 0
    while i < len(queue):
        now = time.perf_counter() - t0 if clock == "wall" else float("inf")  # "offline": all arrived
        if queue[i].arrival_s > now:
            time.sleep(queue[i].arrival_s - now)
            now = queue[i].arrival_s
        batch = []
        while i < len(queue) and len(batch) < batch_size and queue[i].arrival_s <= now:
            batch.append(queue[i])
            i += 1
        yield batch


def replay_static(model: GPT2Model, requests, batch_size: int = 32, clock: str = "wall", pad_id: int = 0):
    """Serve ``requests`` (``sequence.Request``) with static batches: take up to ``batch_size`` arrived requests,
    run the batch to its end, repeat. Returns (RequestOutput list in arrival order, list of batch records). The KV
    memory for the largest possible batch is taken once, before the clock starts, as the engine takes its store.

    ``clock="wall"`` honours ``arrival_s``; ``clock="offline"`` treats every request as arrived at the start.
    """
    if clock not in ("wall", "offline"):
        raise InvalidInputError(f"clock must be 'wall' or 'offline', got {clock!r}")
    if not is_integer(batch_size, 1):
        raise InvalidInputError(f"batch_size must be a positive integer, got {batch_size!r}")
    requests = list(requests)
    check_arrivals(requests)  # as the engine's replay: a time that is not one refuses the whole call
    requests.sort(key=lambda r: r.arrival_s)
    errors = {id(r): e for r in requests if (e := static_batching._check_request(model, r)) is not None}  # each fails alone
    valid = [r for r in requests if id(r) not in errors]
    kv_buffer = None
    if valid:
        columns = max(len(r.prompt_token_ids) for r in valid) + max(r.max_new_tokens for r in valid)
        kv_buffer = static_batching.static_kv_buffer(model.config, min(batch_size, len(valid)), columns)  # before the clock starts
    t0, results, batches = time.perf_counter(), {}, []
    for r in requests:
        if id(r) in errors:
            m = SequenceMetrics(arrival_time=t0 + r.arrival_s, token_times=[], finished_time=t0 + r.arrival_s)
            prompt = list(r.prompt_token_ids) if isinstance(r.prompt_token_ids, (list, tuple, np.ndarray)) else []
            results[id(r)] = RequestOutput(r.request_id, prompt, [], FinishReason.ERROR,
                                           f"request {r.request_id!r}: {errors[id(r)]}", m)
    for batch in arrival_batches(valid, batch_size, clock, t0):
        start = time.perf_counter()
        out = static_batching.static_generate(model, [r.prompt_token_ids for r in batch], [r.max_new_tokens for r in batch],
                              [r.sampling_params for r in batch], stop_at_eos=[r.stop_at_eos for r in batch],
                              stop_token_ids=[r.stop_token_id for r in batch], pad_id=pad_id, kv_buffer=kv_buffer)
        batches.append({"start_time": start, "step_times": out.step_times, "active_rows": out.active_rows,
                        "batch_size": len(batch), "padded_prompt_len": out.padded_prompt_len,
                        "request_ids": [r.request_id for r in batch]})
        for row, r in enumerate(batch):
            n = len(out.output_token_ids[row])
            m = SequenceMetrics(arrival_time=t0 + r.arrival_s, first_scheduled_time=start,
                                token_times=out.step_times[:n], finished_time=out.step_times[n - 1] if n else start)
            results[id(r)] = RequestOutput(r.request_id, list(r.prompt_token_ids), out.output_token_ids[row],
                                           out.finish_reasons[row], None, m)
    return [results[id(r)] for r in requests], batches


def serve_one_by_one(model: GPT2Model, requests: list[Request], stream) -> tuple[list[RequestOutput], float]:
    """Serve ``requests`` one at a time with ``stream`` (chapter 1's or 2's ``generate_stream``), offline, in
    order; each output's metrics count from its own start. -> (outputs, seconds)."""
    outputs, t0 = [], time.perf_counter()
    for r in requests:
        start = time.perf_counter()
        times, tokens = [], []
        for token in stream(model, r.prompt_token_ids, r.max_new_tokens, stop_at_eos=r.stop_at_eos):
            tokens.append(token)
            times.append(time.perf_counter())
        m = SequenceMetrics(arrival_time=start, first_scheduled_time=start, token_times=times,
                            finished_time=times[-1] if times else start)
        outputs.append(RequestOutput(r.request_id, list(r.prompt_token_ids), tokens, FinishReason.LENGTH, None, m))
    return outputs, time.perf_counter() - t0
