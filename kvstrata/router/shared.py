"""Prefixes that many different prompts continue: a shared system prompt,
a popular document. The kv policy counts them as cached on every replica.

Why: kv credits a cached prefix by the prefill it saves (and ``affinity``
times more). For a conversation's own history that is right (its next turn
belongs where its history is; caching it twice wastes cache). For a prefix
that every new conversation starts with it is not: the replica that cached
it first wins every new conversation against any load a few running
requests weigh (measured: a 208-token system prompt took all 36 requests
of ``tools/bench_fleet.py --conversations 12`` to one of two engines),
though caching it on the others costs one prefill each. So once
``min_fanout`` different continuations of a cached prefix have been
dispatched, the prefix is *shared*: placement treats it as held everywhere
(the replicas that lack it prefill it once) and the rest of the prompt,
and the load, decide.

How a branch is seen: a request whose chain continues past the longest
prefix some replica holds (``Decision.cached_blocks``, device credits of
requests in flight included) is one more continuation of that prefix; the
count is kept at the prefix's last block. A conversation's next turn
continues its own last prompt once, so a history never becomes shared;
the ``min_fanout``-th new conversation after the system prompt's first
makes the system prompt shared. Bounded: the oldest counts and shared
blocks are forgotten first (``max_blocks`` of each).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice, takewhile

from kvstrata.kv.types import BlockHash


class SharedPrefixes:
    """Owns: the fan-out count per branch block (how many continuations of
    the prefix ending there were dispatched) and the set of shared blocks
    (every block of a prefix that reached ``min_fanout``), each an
    insertion-ordered dict, oldest first. Single-threaded (the router's)."""

    __slots__ = ("min_fanout", "max_blocks", "_fanout", "_shared")

    def __init__(self, min_fanout: int, max_blocks: int = 1 << 16) -> None:
        if min_fanout < 1:
            raise ValueError(f"min_fanout must be >= 1, got {min_fanout!r}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks!r}")
        self.min_fanout = min_fanout
        self.max_blocks = max_blocks
        self._fanout: dict[BlockHash, int] = {}
        self._shared: dict[BlockHash, None] = {}

    def __len__(self) -> int:
        """Shared blocks known."""
        return len(self._shared)

    def depth(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``hashes`` are shared (a shared block's
        ancestors are shared, so the walk stops at the first that is not)."""
        shared = self._shared
        if not shared:
            return 0
        return len(list(takewhile(shared.__contains__, hashes)))

    def note_branch(self, hashes: Sequence[BlockHash], cached_blocks: int) -> bool:
        """A request with chain ``hashes`` was dispatched and its first
        ``cached_blocks`` blocks were cached somewhere: when the chain goes
        on past them, that prefix has one more continuation. True when this
        made it shared."""
        if not 0 < cached_blocks < len(hashes):
            return False
        end = hashes[cached_blocks - 1]
        if end in self._shared:
            return False
        fanout = self._fanout
        n = fanout.pop(end, 0) + 1  # re-inserted below: the newest
        if n < self.min_fanout:
            fanout[end] = n
            _trim(fanout, self.max_blocks)
            return False
        shared = self._shared
        for h in hashes[:cached_blocks]:
            shared.pop(h, None)
            shared[h] = None
        _trim(shared, self.max_blocks)
        return True


def _trim(d: dict, limit: int) -> None:
    """Drop ``d``'s oldest entries beyond ``limit`` (a tenth more at once, so
    trimming is rare)."""
    if len(d) <= limit:
        return
    for k in list(islice(d, len(d) - limit + limit // 10)):
        del d[k]
