"""Chapter 10: speculative decoding for one sequence, over chapter 2's KV cache.

At batch 1 a decode step reads every weight to produce one token. A pass over k + 1 positions reads the same
weights once, and costs little more (chapter 3's ragged step: the rows share each weight read). So: let a cheap
drafter guess k tokens, feed the last token and the k guesses to the target in **one** pass, and keep the guesses
the target agrees with (``acceptance``), plus one token of the target's own. The KV cache then holds the K/V of
rejected guesses too: rolling back is setting the cache's length to the tokens kept.

``generate`` has chapter 1's signature and, greedy, chapter 1's tokens; sampling, tokens with the target's
distribution (not the same tokens for a seed: the random numbers are used differently). The loop
(``speculative_stream``) talks to the target through a ``CacheRunner``: ``prefill``, ``score`` and ``truncate``;
the first two go through chapter 2's functions, which find the forward of the model's architecture: chapter 9's
model runs too.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..ch01_forward.generation import check_generation, positions_needed
from ..ch01_forward.sampling import Sampler, SamplingParams
from ..ch02_kv_cache.kv_cache import cached_forward, prefill
from ..loading.weights import GPT2Model
from .acceptance import SpecStats, accept
from .drafters import DraftRequest, PromptLookupDrafter, check_k


class CacheRunner:
    """The target model behind chapter 2's cache: what the speculative loop needs from a model."""

    def __init__(self, model: GPT2Model):
        self.model, self.cache = model, None

    def prefill(self, token_ids, capacity: int):  # [T] -> logits of the next token [V]
        logits, self.cache = prefill(self.model, token_ids, capacity=capacity, last_only=True)
        return logits[0]

    def score(self, token_ids):  # [T] -> logits [T, V], one pass; the tokens' K/V join the cache
        """Feed ``token_ids`` at positions ``length ..`` in one pass; the next-token logits of every row."""
        forward = cached_forward(self.model)  # chapter 2's forward for the model's architecture (9's: Llama)
        return forward(self.model, token_ids, self.cache)  # [T, V]: every row, each weight read once

    @property
    def length(self) -> int:
        return self.cache.length

    def truncate(self, length: int) -> None:
        """KV rollback: positions ``length ..`` are forgotten (and written over by the next pass)."""
        assert 0 <= length <= self.cache.length
        self.cache.length = length


def speculative_stream(runner, sampler: Sampler, ids: list[int], max_new_tokens: int, eos, drafter, k: int,
                       stats: SpecStats) -> Iterator[int]:
    """The loop: the first token from the prefill, then rounds of draft, verify in one pass, accept, roll back."""
    new = [sampler(runner.prefill(ids, capacity=positions_needed(len(ids), max_new_tokens)))]
    key = object()  # this sequence, for a drafter that keeps state per sequence
    emitted = 0
    try:
        while True:
            for token in new:
                ids.append(token)
                emitted += 1
                yield token
                if token == eos or emitted == max_new_tokens:
                    return
            n = min(k, max_new_tokens - emitted - 1)  # room: the cache holds positions_needed(...) tokens
            proposal = drafter.propose([DraftRequest(key, list(ids), n, sampler.params, sampler.rng)])[0]
            start = runner.length  # = len(ids) - 1: the last token is not in the cache yet
            logits = runner.score([ids[-1], *proposal.tokens])  # [1 + drafts, V]: one pass of the target
            new = accept(proposal.tokens, proposal.probs, logits, sampler)  # 1 .. drafts + 1 tokens
            runner.truncate(start + len(new))  # keep the last token and the accepted drafts
            if proposal.tokens:
                stats.record(len(proposal.tokens), len(new) - 1, len(new))
    finally:
        drafter.retain(())


def generate_stream(model: GPT2Model, token_ids, max_new_tokens: int, temperature: float = 0.0,
                    top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                    stop_at_eos: bool = True, drafter=None, k: int = 4,
                    stats: SpecStats | None = None) -> Iterator[int]:
    """Chapter 1's ``generate_stream`` with speculative decoding: ``drafter`` (default: prompt lookup) proposes up
    to ``k`` tokens per pass; ``stats`` (a ``SpecStats``), if given, counts what it did."""
    sampler = Sampler(SamplingParams(temperature, top_k, top_p, seed))
    ids = check_generation(model, token_ids, max_new_tokens, stop_at_eos)
    k = check_k(k)
    drafter = PromptLookupDrafter() if drafter is None else drafter
    if max_new_tokens == 0:
        return
    eos = model.config.eos_token_id if stop_at_eos else None
    yield from speculative_stream(CacheRunner(model), sampler, ids, max_new_tokens, eos, drafter, k,
                                  SpecStats() if stats is None else stats)


def generate(model: GPT2Model, token_ids, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stop_at_eos: bool = True, drafter=None, k: int = 4, stats: SpecStats | None = None) -> list[int]:
    """The new token ids, as chapter 1's ``generate`` returns them (greedy: the same ones)."""
    return list(generate_stream(model, token_ids, max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos,
                                drafter, k, stats))
