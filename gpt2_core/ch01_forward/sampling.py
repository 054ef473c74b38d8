"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus) sampling.

Each request owns a seeded ``numpy.random.Generator`` and every sampled step draws exactly one uniform number, so
the same seed gives the same tokens whichever engine produced the logits (naive, KV cache, batched, paged).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InvalidInputError, check_sampling


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax); top_k / top_p then play no part
    top_k: int | None = None  # keep the k most likely tokens; None or 0 = all
    top_p: float | None = None  # keep the smallest set of tokens whose probability reaches p; None or 1 = all
    seed: int | None = None  # seed of this request's own random generator

    def __post_init__(self):
        checked = check_sampling(self.temperature, self.top_k, self.top_p, self.seed)
        for name, value in zip(("temperature", "top_k", "top_p", "seed"), checked):
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution sampling draws from: softmax(logits / T), cut to top-k, then to top-p. [V] float64."""
    with np.errstate(over="ignore"):  # a vanishing temperature overflows to inf: handled below
        z = np.asarray(logits, dtype=np.float64) / params.temperature  # [V]; float64: the cut-offs are exact
    if params.top_k and params.top_k < z.size:
        kth_largest = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z < kth_largest, -np.inf, z)  # ties at the k-th value are all kept
    if not np.isfinite(z.max()):  # NaN logits, all -inf, or a temperature so small that logits / T overflow
        x = np.asarray(logits, dtype=np.float64)
        if np.isnan(x).any() or not np.isfinite(x).any():
            raise InvalidInputError("cannot sample: the logits are NaN or all -inf")
        probs = (x == x.max()).astype(np.float64)  # logits / T overflowed: the limit T -> 0, greedy
        return probs / probs.sum()
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if params.top_p is not None and params.top_p < 1:
        order = np.argsort(-probs, kind="stable")  # most likely first
        mass = np.cumsum(probs[order])
        keep = np.searchsorted(mass, params.top_p) + 1  # the first token whose running mass reaches p is kept
        probs[order[keep:]] = 0.0
        probs /= probs.sum()
    return probs


def sampling_params_of(p) -> SamplingParams:
    """``SamplingParams`` from what a request or a row was given: params, a dict of them, or None (greedy)."""
    if p is None or isinstance(p, SamplingParams):
        return p or SamplingParams()
    if not isinstance(p, dict):
        raise InvalidInputError(f"sampling_params must be a SamplingParams, a dict or None, got {type(p).__name__}")
    try:
        return SamplingParams(**p)
    except TypeError as e:  # an unknown parameter name
        raise InvalidInputError(f"bad sampling_params: {e}") from None


class Sampler:
    """Samples tokens for one sequence with its own seeded generator."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:  # logits [V] -> token id
        if self.params.greedy:
            token = int(np.argmax(logits))  # a NaN anywhere is argmax's answer; all -inf gives token 0
            if np.isnan(logits[token]) or logits[token] == -np.inf:
                raise InvalidInputError("cannot sample: the logits are NaN or all -inf")
            return token
        probs = sampling_probs(logits, self.params)
        u = self.rng.random()  # exactly one draw per step
        cdf = np.cumsum(probs)
        return int(np.searchsorted(cdf, u * cdf[-1], side="right"))  # scaled: cdf[-1] may miss 1 by rounding
