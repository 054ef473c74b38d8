"""Chapter 10's counters on chapter 7's ``/metrics``, named as vLLM's ``spec_decode`` metrics with the server's
``gpt2_`` prefix. ``python -m gpt2_core serve --speculative ...`` adds them (a part of ``ServerMetrics``); a server
without speculation has none of them.

* ``gpt2_spec_decode_num_drafts_total``: target passes that verified drafts (one per sequence and step);
* ``gpt2_spec_decode_num_draft_tokens_total``: draft tokens verified;
* ``gpt2_spec_decode_num_accepted_tokens_total``: of those, the ones kept;
* ``gpt2_spec_decode_num_accepted_tokens_per_pos_total{position="i"}``: kept at draft position ``i`` of a pass
  (0: the first draft), for ``i`` from 0 to k - 1.

vLLM's readings: acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts (the
tokens a pass emits); acceptance at position ``i`` = per_pos[i] / drafts.
"""

from __future__ import annotations

from prometheus_client import Counter

from ..ch07_serving.metrics import catch_up

PREFIX = "gpt2_spec_decode_"


class SpecDecodeMetrics:
    """The counters above, on ``registry`` with ``labels`` (the server's model name), brought up to date with a
    ``SpeculativeEngine``'s ``spec_stats`` by ``update(engine)`` between steps (by the engine's thread)."""

    def __init__(self, registry, labels: dict):
        def counter(name: str, doc: str, extra=()):
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=registry)

        self.labels = dict(labels)
        self.totals = {
            "num_passes": counter("num_drafts", "Target passes that verified draft tokens (one per sequence and "
                                  "step)").labels(**labels),
            "num_draft_tokens": counter("num_draft_tokens", "Draft tokens verified").labels(**labels),
            "num_accepted_tokens": counter("num_accepted_tokens", "Draft tokens accepted").labels(**labels)}
        self.per_position = counter("num_accepted_tokens_per_pos", "Draft tokens accepted at each position of a "
                                    "pass's drafts (0: the first)", ["position"])
        self.seen = {name: 0 for name in self.totals}  # and position i -> accepted there, once k is known
        self.positions = []  # position i's counter, made when the engine first drafts that far

    def update(self, engine) -> None:
        stats = engine.spec_stats
        for name, total in self.totals.items():
            catch_up(total, self.seen, name, getattr(stats, name))
        accepted = stats.accepted_per_position
        for i in range(len(self.positions), max(engine.k, len(accepted))):  # each position shown from 0 on
            self.positions.append(self.per_position.labels(**self.labels, position=str(i)))
            self.seen[i] = 0
        for i, child in enumerate(self.positions):
            catch_up(child, self.seen, i, accepted[i] if i < len(accepted) else 0)
