"""Chapter 8's routing policies: where a router sends a request among replicas of a server, each with its own
prefix cache (chapter 5). Plain Python, no HTTP: ``serving/router.py`` puts them behind ``python -m gpt2_core
route``, and ``bench/router.py`` replays workloads through them to predict hit rates.

* ``round_robin``: the live replicas in turn. Even load, but a conversation's next turn lands on any replica, whose
  cache may never have seen its history.
* ``prefix_affinity``: cache-aware, in the spirit of SGLang's router. The router remembers, per replica, chained
  hashes of the prompt blocks it sent there (LRU, bounded) and sends a request to the live replica holding the
  longest prefix of it. A prefix that several conversations share (a system prompt) is soon cached on every
  replica, so it is no reason to prefer one: when no replica matches beyond it, or when matches tie, the least
  loaded replica (fewest requests in flight through the router) gets the request; and so does it when the best
  match is overloaded compared with the least loaded (the balance thresholds).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from ..errors import InvalidInputError

BLOCK_TOKENS = 16  # a block of token ids: the replicas' prefix cache cuts prompts so (chapter 5's block_size)
BLOCK_CHARS = 64  # a block of a text prompt: the router does not tokenize, so it cuts fixed runs of characters
MAX_BLOCKS = 65_536  # block hashes remembered per replica (least recently sent forgotten first): ~1M tokens
# A replica is overloaded when it has more than BALANCE_ABS requests in flight above the least loaded AND more
# than BALANCE_REL times as many (SGLang's balance_abs/rel_threshold, 32 and 1.0001 there, for GPU batches of
# hundreds; a CPU replica here runs batches of at most 32).
BALANCE_ABS, BALANCE_REL = 4, 1.5
POLICIES = ("prefix_affinity", "round_robin")


def _block_bytes(piece) -> bytes:
    return piece.encode("utf-8", "surrogatepass") if isinstance(piece, str) else b",".join(b"%d" % t for t in piece)


def block_hashes(prompt, block_tokens: int = BLOCK_TOKENS, block_chars: int = BLOCK_CHARS) -> list[bytes]:
    """Chained hashes of the prompt's full blocks: hash i stands for blocks 0..i, as chapter 5's prefix cache keys
    its blocks. Token ids are cut in blocks of ``block_tokens``, text in blocks of ``block_chars`` characters.
    Anything else (a malformed prompt, which the replica will refuse): no blocks."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # the OpenAI client sends ["text"] or [[ids]] for one prompt
    if isinstance(prompt, str):
        size = block_chars
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        size = block_tokens
    else:
        return []
    out, h = [], b""
    for start in range(0, len(prompt) - size + 1, size):
        h = hashlib.blake2b(h + _block_bytes(prompt[start:start + size]), digest_size=16).digest()
        out.append(h)
    return out


class RoundRobin:
    """The live replicas in turn."""

    name = "round_robin"

    def __init__(self, num_replicas: int):
        self.num_replicas, self.next = num_replicas, 0

    def choose(self, hashes: list[bytes], loads: dict[int, int]) -> int:
        for k in range(self.num_replicas):
            r = (self.next + k) % self.num_replicas
            if r in loads:
                self.next = r + 1
                return r
        raise ValueError("no live replica to choose from")

    def forget(self, replica: int) -> None:
        pass


class PrefixAffinity:
    """Cache-aware: the live replica that was sent the longest prefix of the prompt, unless that prefix is shared
    with other conversations (then, or on a tie, the least loaded), or the replica is overloaded."""

    name = "prefix_affinity"

    def __init__(self, num_replicas: int, balance_abs: int = BALANCE_ABS, balance_rel: float = BALANCE_REL,
                 max_blocks: int = MAX_BLOCKS):
        self.blocks = [OrderedDict() for _ in range(num_replicas)]  # per replica: hashes sent there, LRU order
        self.successors: OrderedDict = OrderedDict()  # hash -> up to 2 hashes seen right after it (any replica)
        self.balance_abs, self.balance_rel, self.max_blocks = balance_abs, balance_rel, max_blocks

    def matched(self, replica: int, hashes: list[bytes]) -> int:
        """How many of the prompt's first blocks were sent to ``replica`` (and are still remembered)."""
        seen, n = self.blocks[replica], 0
        while n < len(hashes) and hashes[n] in seen:
            n += 1
        return n

    def shared(self, hashes: list[bytes]) -> int:
        """How many of the prompt's first blocks other prompts went on from differently: a prefix common to
        several conversations (a system prompt), which every replica will soon hold."""
        return max((i + 1 for i, h in enumerate(hashes) if len(self.successors.get(h, ())) > 1), default=0)

    def overloaded(self, load: int, least_load: int) -> bool:
        return load - least_load > self.balance_abs and load > self.balance_rel * least_load

    def choose(self, hashes: list[bytes], loads: dict[int, int]) -> int:
        """The replica for a prompt (its ``block_hashes``); ``loads``: live replica -> requests in flight. Ties
        go to the least loaded, then to the replica remembering fewer blocks (SGLang's smallest tree)."""
        least = min(loads, key=lambda r: (loads[r], len(self.blocks[r]), r))
        matched = {r: self.matched(r, hashes) for r in loads}
        best = max(loads, key=lambda r: (matched[r], -loads[r], -len(self.blocks[r]), -r))
        beyond_shared = matched[best] > max(self.shared(hashes), matched[least])
        choice = best if beyond_shared and not self.overloaded(loads[best], loads[least]) else least
        self.record(choice, hashes)
        return choice

    def record(self, replica: int, hashes: list[bytes]) -> None:
        seen = self.blocks[replica]
        for h in reversed(hashes):  # a prefix is touched after its extensions: the extensions are forgotten first
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_blocks:
            seen.popitem(last=False)
        for h, after in zip(hashes, hashes[1:]):
            following = self.successors.setdefault(h, set())
            if len(following) < 2:
                following.add(after)
            self.successors.move_to_end(h)
        while len(self.successors) > self.max_blocks * len(self.blocks):
            self.successors.popitem(last=False)

    def forget(self, replica: int) -> None:
        """A replica that died lost its cache: nothing is remembered for it."""
        self.blocks[replica].clear()


def make_policy(name: str, num_replicas: int, **args):
    if name == "round_robin":
        return RoundRobin(num_replicas)
    if name == "prefix_affinity":
        return PrefixAffinity(num_replicas, **args)
    raise InvalidInputError(f"unknown routing policy {name!r}; available: {', '.join(POLICIES)}")
