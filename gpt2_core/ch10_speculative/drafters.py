"""Chapter 10: drafters, the cheap guessers. Each proposes up to k next tokens for many sequences at once.

* ``PromptLookupDrafter`` (prompt lookup, vLLM's ``ngram`` method): find the last n tokens earlier in the prompt
  and output, and propose the tokens that followed them there. No model at all: it pays off when the output
  copies its input (editing, extraction, code), and proposes nothing on free text.
* ``DraftModelDrafter``: a smaller model of the same vocabulary drafts k tokens one at a time, batched over the
  sequences with chapter 3's ragged step over its own KV store. Here: the target itself in chapter 6's int8 or
  int4 form (it shares the tokenizer and nearly every prediction).
* ``OracleDrafter``: a synthetic drafter that knows the target's greedy continuation and is right with
  probability ``alpha``, independently: acceptance is ``alpha`` by construction, so the formula can be checked,
  and speculation timed on random weights, whose predictions no real drafter can guess.

A drafter has two methods: ``propose(requests) -> proposals`` (one ``Proposal`` per ``DraftRequest``, in order) and
``retain(keys)`` (forget every sequence but these: a drafter with state frees it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..ch01_forward.sampling import SamplingParams, sampling_probs
from ..ch03_batching.model_runner import Chunk, model_step
from ..ch04_paged.block_manager import blocks_needed
from ..ch06_quantization.quantization import quantize_model
from ..ch09_modern_model.quantized import quantize_llama  # (importing chapter 9 registers its model step)
from ..errors import CacheCapacityError, InvalidInputError, is_integer, is_real
from ..loading.llama import LlamaModel
from ..loading.weights import GPT2Model
from .acceptance import draw
from .rollback import SpeculativeKVStore


@dataclass(frozen=True)
class DraftRequest:
    """Propose up to ``k`` tokens to follow ``token_ids`` (prompt and output so far) of sequence ``key``."""

    key: object
    token_ids: list
    k: int
    params: SamplingParams = field(default_factory=SamplingParams)  # the sequence's: a draft model samples with them
    rng: np.random.Generator | None = None  # the sequence's generator (a draft model that samples draws from it)


@dataclass(frozen=True)
class Proposal:
    tokens: list  # [n <= k] proposed token ids
    probs: np.ndarray | None = None  # [n, V]: the distribution q each was drawn from; None: guesses (point masses)


def prompt_lookup(token_ids, k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the last ``n`` tokens, for the
    largest ``n`` from ``max_ngram`` down to ``min_ngram`` that occurs earlier; [] if none does."""
    ids = np.asarray(token_ids, dtype=np.int64)  # [T]
    T = len(ids)
    for n in range(min(max_ngram, T - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:T - 1], n)  # [T-n, n]: n-grams with a token after
        hits = np.flatnonzero((windows == ids[T - n:]).all(axis=1))  # where the last n tokens occurred before
        if len(hits):
            start = int(hits[-1]) + n  # the most recent occurrence: what followed it
            return ids[start:start + k].tolist()
    return []


def check_k(k) -> int:
    if not is_integer(k, 0):
        raise InvalidInputError(f"the number of speculative tokens k must be an integer >= 0, got {k!r}")
    return int(k)


class PromptLookupDrafter:
    """Prompt lookup: n-grams of ``max_ngram`` down to ``min_ngram`` tokens matched in the sequence itself."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not (is_integer(min_ngram, 1) and is_integer(max_ngram, min_ngram)):
            raise InvalidInputError(f"prompt lookup needs integers 1 <= min_ngram <= max_ngram, got min_ngram="
                                    f"{min_ngram!r}, max_ngram={max_ngram!r}")
        self.max_ngram, self.min_ngram = int(max_ngram), int(min_ngram)

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        return [Proposal(prompt_lookup(r.token_ids, r.k, self.max_ngram, self.min_ngram)) for r in requests]

    def retain(self, keys) -> None:
        """Nothing to forget: prompt lookup keeps no state."""


def common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


class DraftModelDrafter:
    """A draft model proposes k tokens autoregressively: one ragged step over all sequences per draft token, over
    its own KV store. ``forward(model, store, chunks) -> [B, V]``: chapter 3's ``model_step`` by default (the
    ``ragged_forward`` of the model's architecture); ``store``: anything with a ``SpeculativeKVStore``'s
    methods. ``num_blocks``: the default store's blocks of ``block_size`` tokens (default: 4 full contexts)."""

    def __init__(self, draft_model: GPT2Model, num_blocks: int | None = None, block_size: int = 16,
                 forward=model_step, store=None):
        self.model, self.forward = draft_model, forward
        if store is None:
            if num_blocks is None:
                num_blocks = 4 * blocks_needed(draft_model.config.n_positions, block_size)
            store = SpeculativeKVStore(draft_model.config, num_blocks, block_size)
        self.store = store
        self.fed: dict[object, list[int]] = {}  # key -> the tokens whose K/V the draft store holds, in order

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        drafts = {r.key: ([], []) for r in requests}  # key -> (tokens, q rows)
        live = [r for r in requests if self._sync(r)]
        chunks = [Chunk(r.key, np.asarray(r.token_ids[len(self.fed[r.key]):], dtype=np.int64),
                        len(self.fed[r.key])) for r in live]
        while live:
            logits = self.forward(self.model, self.store, chunks)  # [B, V]: the next token of every live sequence
            for r, chunk, row in zip(live, chunks, logits):
                self.fed[r.key].extend(int(t) for t in chunk.token_ids)
                token, q = self._pick(row, r)
                drafts[r.key][0].append(token)
                drafts[r.key][1].append(q)
            live = [r for r in live if len(drafts[r.key][0]) < r.k]  # the k-th draft is never fed
            chunks = [Chunk(r.key, np.asarray(drafts[r.key][0][-1:], dtype=np.int64), len(self.fed[r.key]))
                      for r in live]
        return [self._proposal(*drafts[r.key], r.params) for r in requests]

    def _sync(self, r: DraftRequest) -> bool:
        """Roll the draft store of ``r.key`` back to the longest prefix it shares with ``r.token_ids`` and give it
        room for the tokens to feed and ``r.k - 1`` drafts; False (no drafts) if it has no room or no context left."""
        if r.k < 1 or len(r.token_ids) + r.k - 1 > self.model.config.n_positions:
            return False
        need = len(r.token_ids) + r.k - 1  # the tokens not yet fed, then every draft but the last
        try:
            if r.key not in self.fed:
                self.store.allocate(r.key, need)
                self.fed[r.key] = []
            else:
                keep = min(common_prefix(self.fed[r.key], r.token_ids), len(r.token_ids) - 1)
                self.store.truncate(r.key, keep)  # the drafts the target rejected, and any beyond
                del self.fed[r.key][keep:]
                self.store.ensure(r.key, need)
        except CacheCapacityError:
            return False
        return True

    @staticmethod
    def _pick(row, r: DraftRequest):
        """The draft token of a logits row: argmax if the sequence is greedy, else a draw from its q."""
        if r.params.greedy:
            return int(np.argmax(row)), None
        q = sampling_probs(row, r.params)  # [V]: the sequence's temperature, top-k and top-p, on draft logits
        return draw(q, r.rng), q

    @staticmethod
    def _proposal(tokens, qs, params) -> Proposal:
        return Proposal(tokens, None if params.greedy or not tokens else np.stack(qs))

    def retain(self, keys) -> None:
        keys = set(keys)
        for key in [k for k in self.fed if k not in keys]:
            self.store.free(key)
            del self.fed[key]


class OracleDrafter:
    """Knows each sequence's greedy continuation (``references``: full token lists, prompt included) and proposes
    each next token right with probability ``alpha``, else a wrong one, independently. For greedy decoding."""

    def __init__(self, references, alpha: float, vocab_size: int, seed: int = 0):
        if not is_real(alpha) or not 0 <= alpha <= 1:
            raise InvalidInputError(f"alpha must be a probability in [0, 1], got {alpha!r}")
        self.references = [list(map(int, r)) for r in references]
        self.alpha, self.vocab_size = float(alpha), int(vocab_size)
        self.rng = np.random.default_rng(seed)

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        return [Proposal(self._guess(r.token_ids, r.k)) for r in requests]

    def _guess(self, token_ids, k: int) -> list[int]:
        n = len(token_ids)
        ref = next((r for r in self.references if r[:n] == list(token_ids)), None)
        if ref is None:
            return []
        right = ref[n:n + k]  # what the target will choose
        wrong = [(t + 1 + int(self.rng.integers(self.vocab_size - 1))) % self.vocab_size for t in right]
        return [t if self.rng.random() < self.alpha else w for t, w in zip(right, wrong)]

    def retain(self, keys) -> None:
        """Nothing to forget."""


def make_drafter(spec: str, model: GPT2Model, num_blocks: int | None = None):
    """``(drafter, k)`` from a spec: ``ngram:K`` (prompt lookup, n-grams of 3 down to 1), ``ngram:K:N`` (of N down
    to 1), or ``draft:FORMAT:K`` (``model`` in chapter 6's ``int8`` or ``int4``, numba kernel if installed; chapter
    9's Llama through ``quantize_llama``, int4 in groups of 32)."""
    parts = str(spec).split(":")
    try:
        if parts[0] == "ngram" and len(parts) in (2, 3):
            return PromptLookupDrafter(int(parts[2]) if len(parts) == 3 else 3), check_k(int(parts[1]))
        if parts[0] == "draft" and len(parts) == 3 and parts[1] in ("int8", "int4", "fp16", "fp32"):
            draft = quantize_llama(model, parts[1], kernel="auto") if isinstance(model, LlamaModel) else \
                quantize_model(model, parts[1], kernel="auto")
            return DraftModelDrafter(draft, num_blocks), check_k(int(parts[2]))
    except ValueError as e:
        if isinstance(e, InvalidInputError):
            raise
    raise InvalidInputError(f"speculative spec must be ngram:K, ngram:K:N or draft:FORMAT:K (FORMAT int8, int4, fp16 "
                            f"or fp32), got {spec!r}")
