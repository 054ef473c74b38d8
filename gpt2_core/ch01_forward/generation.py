"""Chapter 1's generation loop: run the whole sequence through the model again for every new token.

Simple and obviously correct, and slow: step n costs a forward pass over n tokens, so n steps cost O(n^2).
Chapter 2 keeps this loop's signature and removes the recomputation.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..errors import InvalidInputError, is_integer
from .model import lm_head, transformer
from .sampling import Sampler, SamplingParams
from ..loading.weights import GPT2Model


def check_generation(model: GPT2Model, token_ids, max_new_tokens, stop_at_eos=True) -> list[int]:
    """Validate a prompt, a length budget and ``stop_at_eos`` before any work; return the prompt as a list of ints."""
    ids = model.check_tokens(token_ids)
    if not is_integer(max_new_tokens, 0):
        raise InvalidInputError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not isinstance(stop_at_eos, (bool, np.bool_)):  # "no" would be true
        raise InvalidInputError(f"stop_at_eos must be True or False, got {stop_at_eos!r}")
    n_ctx, needed = model.config.n_positions, positions_needed(len(ids), max_new_tokens)
    if needed > n_ctx:
        raise InvalidInputError(f"prompt of {len(ids)} tokens + max_new_tokens={max_new_tokens} needs {needed} "
                                f"positions, more than the context n_ctx={n_ctx}")
    return ids.tolist()


def positions_needed(prompt_len: int, max_new_tokens: int) -> int:
    """Positions the model must run: the prompt and every new token but the last, which is never fed back."""
    return prompt_len + max(max_new_tokens - 1, 0)


def next_token_logits(model: GPT2Model, token_ids) -> np.ndarray:  # token_ids [T] -> logits [V]
    """Logits of the token after ``token_ids``: the full forward pass, LM head on the last position only."""
    x = transformer(model, token_ids)  # [T, E]: every position recomputed
    return lm_head(model.params, x[-1:], model.config.layer_norm_epsilon)[0]  # [V]


def generate_stream(model: GPT2Model, token_ids, max_new_tokens: int, temperature: float = 0.0,
                    top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                    stop_at_eos: bool = True) -> Iterator[int]:
    """Yield new token ids one at a time; stops after ``<|endoftext|>`` (which is yielded) or ``max_new_tokens``."""
    sample = Sampler(SamplingParams(temperature, top_k, top_p, seed))  # validates the parameters first
    ids = check_generation(model, token_ids, max_new_tokens, stop_at_eos)
    eos = model.config.eos_token_id if stop_at_eos else None
    for _ in range(max_new_tokens):
        token = sample(next_token_logits(model, ids))
        ids.append(token)
        yield token
        if token == eos:
            return


def generate(model: GPT2Model, token_ids, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stop_at_eos: bool = True) -> list[int]:
    """The new token ids (the prompt not included). ``temperature=0`` is greedy."""
    return list(generate_stream(model, token_ids, max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos))
