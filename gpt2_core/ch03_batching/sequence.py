"""Chapter 3: what a serving engine knows about one request — vLLM's vocabulary, in small dataclasses.

A ``Request`` is what a user sends: prompt ids, sampling parameters (with their own seed), a length budget, a
stop token and an arrival time. The engine wraps it in a ``Sequence`` that lives through
``WAITING -> RUNNING -> FINISHED`` (and back to ``WAITING`` if it is preempted), counts how many of its tokens
have K/V in the store (``num_computed_tokens``), collects its output tokens, and time-stamps everything needed for
the metrics users care about: time to first token, inter-token latency, end-to-end latency.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidInputError, is_integer
from ..ch01_forward.sampling import Sampler, SamplingParams, sampling_params_of


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued: not admitted yet, or preempted (its KV freed) and waiting to be recomputed
    RUNNING = "running"  # admitted: holds KV room in the store, gets a chunk in every step
    FINISHED = "finished"  # done (see FinishReason); its KV room is freed


class FinishReason(str, enum.Enum):
    STOP = "stop"  # produced its stop token (or <|endoftext|>); the stop token is part of the output
    LENGTH = "length"  # produced max_new_tokens
    ERROR = "error"  # invalid request, or its own sampling raised: it failed alone, see Sequence.error
    ABORT = "abort"  # its caller gave up on it (``LLMEngine.abort_request``; a server's client went away)


@dataclass
class Request:
    """One generation request, as a user submits it."""

    request_id: object  # any hashable, unique per engine
    prompt_token_ids: list  # [T] token ids
    max_new_tokens: int = 16
    sampling_params: SamplingParams | dict = field(default_factory=SamplingParams)  # a dict is validated on add
    stop_token_id: int | None = None  # an extra stop token, besides <|endoftext|>
    stop_at_eos: bool = True  # stop after the model's eos token (chapter 1's ``stop_at_eos``)
    arrival_s: float = 0.0  # when it arrives, seconds after the start of a workload (used by replay drivers)
    logits_processor: Callable | None = None  # optional (token_ids, logits [V]) -> logits [V], user code


@dataclass(frozen=True)
class CheckedRequest:
    """A request's fields as the engine uses them, after ``check_request``."""

    prompt_token_ids: list  # [T] Python ints
    max_new_tokens: int
    sampling_params: SamplingParams


def check_request(request: Request, model) -> CheckedRequest:
    """``request``'s prompt, budget, sampling parameters and stop settings checked against ``model``: an
    ``InvalidInputError`` naming the first field that is wrong, else the fields ready to use. The one check every
    server of requests runs (the continuous engine, static batching); whether the request fits the context and
    the KV store is the scheduler's question (``Scheduler.check_fits``)."""
    params = sampling_params_of(request.sampling_params)
    prompt = model.check_tokens(request.prompt_token_ids).tolist()
    if request.logits_processor is not None and not callable(request.logits_processor):
        raise InvalidInputError(f"logits_processor must be a function (token_ids, logits) -> logits, got "
                                f"{request.logits_processor!r}")
    if not is_integer(request.max_new_tokens, 0):
        raise InvalidInputError(f"max_new_tokens must be an integer >= 0, got {request.max_new_tokens!r}")
    if not isinstance(request.stop_at_eos, (bool, np.bool_)):  # "no" would be true
        raise InvalidInputError(f"stop_at_eos must be True or False, got {request.stop_at_eos!r}")
    s, V = request.stop_token_id, model.config.vocab_size
    if s is not None and not is_integer(s, 0, V - 1):
        raise InvalidInputError(f"stop_token_id must be a token id in [0, {V}), got {s!r}")
    return CheckedRequest(prompt, int(request.max_new_tokens), params)


@dataclass
class SequenceMetrics:
    """Wall-clock time stamps (``time.perf_counter`` seconds) of one sequence, and what they mean."""

    arrival_time: float = 0.0  # when the request arrived
    first_scheduled_time: float | None = None  # first admission into a step
    token_times: list = field(default_factory=list)  # when each output token was produced
    finished_time: float | None = None
    num_preemptions: int = 0  # times its KV was freed to make room, and recomputed later

    @property
    def time_to_first_token(self) -> float | None:
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def inter_token_latencies(self) -> list[float]:
        return np.diff(self.token_times).tolist()

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    def as_dict(self) -> dict:
        return {"time_to_first_token": self.time_to_first_token, "inter_token_latencies": self.inter_token_latencies,
                "e2e_latency": self.e2e_latency, "queue_time": self.queue_time,
                "num_preemptions": self.num_preemptions}


class Sequence:
    """The engine's state of one request: status, tokens, KV progress, sampler, metrics."""

    def __init__(self, seq_id: int, request: Request, sampling_params: SamplingParams | None = None,
                 arrival_time: float | None = None):
        self.seq_id = seq_id
        self.request = request
        self.request_id = request.request_id
        self.status = SequenceStatus.WAITING
        self.prompt_token_ids: list[int] = []  # filled in by the engine once the prompt is validated
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the store (0 again after a preemption)
        self.max_new_tokens = request.max_new_tokens
        self.sampler = Sampler(sampling_params) if sampling_params is not None else None
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.metrics = SequenceMetrics(arrival_time=time.perf_counter() if arrival_time is None else arrival_time)

    # -- tokens ---------------------------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_num_tokens(self) -> int:
        """The most tokens this sequence can ever hold: prompt + max_new_tokens."""
        return len(self.prompt_token_ids) + self.max_new_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens the next step must feed: the whole prompt (+ outputs, after a preemption) or the last token."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_uncomputed_tokens > 1 or not self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, {self.status.value}, "
                f"prompt={self.num_prompt_tokens}, out={len(self.output_token_ids)}, "
                f"computed={self.num_computed_tokens}, finish={self.finish_reason and self.finish_reason.value})")
