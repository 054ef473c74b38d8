"""Chapter 10: the accept/reject step of speculative decoding, and the formula it is measured against.

A drafter proposed k tokens; the target scored k + 1 positions in one pass: row ``i`` of its logits is its
next-token distribution after the context and the first ``i`` drafts (row 0 after the context alone, row k after
all k drafts).

* **Greedy** (temperature 0): keep the longest prefix of the drafts that equals the target's argmax, then add the
  target's own argmax at the first disagreement (or after the last draft). Every token emitted is the target's
  argmax given the tokens before it: the output is plain greedy decoding's, token for token.
* **Sampling** (Leviathan et al. 2023; Chen et al. 2023): draft ``x``, drawn from the drafter's distribution
  ``q``, is kept with probability ``min(1, p(x) / q(x))``; at the first rejection a token is drawn from
  ``norm(max(0, p - q))`` instead, and the round ends. If every draft is kept, one more token is drawn from row k.
  Each token emitted then follows the target's ``p`` exactly, whatever ``q`` is. A drafter that only guesses
  (prompt lookup) proposes ``x`` for sure: ``q`` is a point mass, ``x`` is kept with probability ``p(x)``, and the
  residual is ``p`` without ``x``.

Either way a round emits between 1 and k + 1 tokens. If each draft is accepted with probability ``alpha``,
independently, a round emits ``1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)`` tokens on average.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..ch01_forward.sampling import Sampler, sampling_probs
from ..errors import InvalidInputError, is_integer, is_real


def greedy_accept(draft_tokens, target_logits) -> list[int]:  # [k], [k+1, V] -> the tokens emitted, 1 .. k+1
    """The longest prefix of ``draft_tokens`` that the target's argmax agrees with, and the target's next token."""
    targets = np.argmax(target_logits, axis=-1)  # [k+1]: the target's own choice at every position
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == targets[n]:
        n += 1
    return [int(t) for t in draft_tokens[:n]] + [int(targets[n])]


def draw(probs, rng) -> int:  # probs [V] -> one token, with exactly one uniform number (as chapter 1's Sampler)
    cdf = np.cumsum(probs)
    return int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))


def residual_distribution(p, q) -> np.ndarray:  # p, q [V] -> norm(max(0, p - q)) [V]
    """Where to draw from after a rejection: the mass the target gives a token beyond what the drafter gave it."""
    r = np.maximum(p - q, 0.0)
    total = r.sum()
    return r / total if total > 0 else p  # p == q: no draft is ever rejected; only rounding can get here


def rejection_sample(draft_tokens, draft_probs, target_probs, rng) -> list[int]:
    """The tokens one round emits (1 .. k+1): ``draft_probs`` [k, V] is the drafter's ``q`` at each draft (None:
    point masses, the drafter guessed), ``target_probs`` [k+1, V] the target's ``p`` at each position."""
    out = []
    for i, x in enumerate(draft_tokens):
        p = target_probs[i]  # [V]
        q_x = 1.0 if draft_probs is None else draft_probs[i][x]
        if rng.random() * q_x < p[x]:  # u < p(x) / q(x): kept with probability min(1, p(x) / q(x))
            out.append(int(x))
            continue
        if draft_probs is None:
            q = np.zeros_like(p)
            q[x] = 1.0  # a point mass on the guess: the residual is p without x
        else:
            q = draft_probs[i]
        out.append(draw(residual_distribution(p, q), rng))  # rejected: the round ends with a token from the rest
        return out
    out.append(draw(target_probs[len(draft_tokens)], rng))  # every draft kept: one more token, from row k
    return out


def accept(draft_tokens, draft_probs, target_logits, sampler: Sampler) -> list[int]:
    """One round's tokens for a sequence with ``sampler`` (its parameters and its random generator): greedy, or
    rejection sampling against the distributions the sampler would draw from (temperature, top-k, top-p)."""
    if len(target_logits) != len(draft_tokens) + 1:
        raise InvalidInputError(f"{len(draft_tokens)} drafts need {len(draft_tokens) + 1} rows of target logits, "
                                f"got {len(target_logits)}")
    if sampler.params.greedy:
        return greedy_accept(draft_tokens, target_logits)
    target_probs = np.stack([sampling_probs(row, sampler.params) for row in target_logits])  # [k+1, V]
    return rejection_sample(draft_tokens, draft_probs, target_probs, sampler.rng)


# ----------------------------------------------------------------------------------------------------------------
# The formula, and the counters that measure against it


def expected_tokens_per_pass(alpha, k) -> float:
    """Tokens one target pass emits when each of ``k`` drafts is accepted with probability ``alpha``,
    independently: ``(1 - alpha^(k+1)) / (1 - alpha)`` (``k + 1`` at ``alpha = 1``)."""
    if not is_real(alpha) or not 0 <= alpha <= 1:
        raise InvalidInputError(f"alpha must be a probability in [0, 1], got {alpha!r}")
    if not is_integer(k, 0):
        raise InvalidInputError(f"k must be an integer >= 0, got {k!r}")
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha, k, verify_cost=1.0, draft_cost=0.0) -> float:
    """Tokens per pass over the cost of a round, both counted in plain decode steps of the target: one verify pass
    of k + 1 positions costs ``verify_cost`` steps, each of the k draft steps ``draft_cost`` (0 for prompt lookup)."""
    for name, value in (("verify_cost", verify_cost), ("draft_cost", draft_cost)):
        if not is_real(value) or value < 0:
            raise InvalidInputError(f"{name} must be a number >= 0 (in decode steps), got {value!r}")
    return expected_tokens_per_pass(alpha, k) / (verify_cost + k * draft_cost)


@dataclass
class SpecStats:
    """What speculation did, counted as vLLM's ``spec_decode`` metrics count it."""

    num_passes: int = 0  # target passes that verified at least one draft (vLLM: num_drafts)
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # of those, kept
    num_rejections: int = 0  # passes that ended at a rejected draft (the others kept every draft)
    num_emitted_tokens: int = 0  # tokens the passes emitted: the accepted drafts and one token of the target each
    # per draft position (0: the first draft of a pass): drafts accepted there (vLLM: num_accepted_tokens_per_pos)
    accepted_per_position: list = field(default_factory=list, repr=False, compare=False)

    def record(self, num_drafts: int, num_accepted: int, num_emitted: int) -> None:
        self.num_passes += 1
        self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for position in range(num_accepted):  # the accepted drafts are a pass's first ones
            self.accepted_per_position[position] += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_rejections += num_accepted < num_drafts
        self.num_emitted_tokens += num_emitted

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed drafts (vLLM's draft acceptance rate). Drafts after a rejection count as rejected."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def alpha(self) -> float:
        """The probability that a draft is accepted, given that the drafts before it were: accepted / (accepted +
        rejections) — each pass looks at drafts until its first rejection. The ``alpha`` of the formula."""
        seen = self.num_accepted_tokens + self.num_rejections
        return self.num_accepted_tokens / seen if seen else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.num_emitted_tokens / self.num_passes if self.num_passes else 0.0

    def as_dict(self) -> dict:
        return {"num_passes": self.num_passes, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "num_rejections": self.num_rejections,
                "num_emitted_tokens": self.num_emitted_tokens, "acceptance_rate": self.acceptance_rate,
                "alpha": self.alpha, "tokens_per_pass": self.tokens_per_pass}
