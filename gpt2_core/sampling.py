"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus) sampling.

Each request owns a seeded ``numpy.random.Generator`` and every sampled step draws exactly one uniform number, so
the same seed gives the same tokens whichever engine produced the logits (naive, KV cache, batched, paged).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import InvalidInputError, is_integer, is_real


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax); top_k / top_p then play no part
    top_k: int | None = None  # keep the k most likely tokens; None or 0 = all
    top_p: float | None = None  # keep the smallest set of tokens whose probability reaches p; None or 1 = all
    seed: int | None = None  # seed of this request's own random generator

    def __post_init__(self):
        t, k, p, seed = self.temperature, self.top_k, self.top_p, self.seed
        if not is_real(t) or t < 0:
            raise InvalidInputError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if k is not None and not is_integer(k, 0):
            raise InvalidInputError(f"top_k must be an integer >= 0 (0 = no limit), got {k!r}")
        if p is not None and (not is_real(p) or not 0 < p <= 1):
            raise InvalidInputError(f"top_p must be in (0, 1] (1 = no limit), got {p!r}")
        if seed is not None and not is_integer(seed, 0):
            raise InvalidInputError(f"seed must be a non-negative integer, got {seed!r}")
        # NumPy scalars (np.float32(0.75), np.int64(5)) are stored as the Python numbers of the same value
        for name, value, kind in (("temperature", t, float), ("top_k", k, int), ("top_p", p, float),
                                  ("seed", seed, int)):
            if value is not None:
                object.__setattr__(self, name, kind(value))

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


HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}  # transformers' GenerationConfig


def sampling_defaults(generation_config: dict) -> dict:
    """``generate``'s ``temperature``, ``top_k`` and ``top_p`` from HF generation settings (a model's
    ``generation_config.json``): greedy unless ``do_sample`` is true; then the settings given, and HF's defaults
    (temperature 1, top_k 50, top_p 1) for those not given or null. Checked as ``SamplingParams`` checks them."""
    do_sample = generation_config.get("do_sample")
    if not (do_sample is None or isinstance(do_sample, bool)):
        raise InvalidInputError(f"do_sample must be true or false, got {do_sample!r}")
    if not do_sample:
        return {"temperature": 0.0, "top_k": None, "top_p": None}
    given = {name: value for name, value in generation_config.items() if value is not None}  # null: not set
    chosen = {name: given.get(name, default) for name, default in HF_SAMPLING_DEFAULTS.items()}
    params = SamplingParams(**chosen)  # InvalidInputError for a value generate would refuse
    return {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p}


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
