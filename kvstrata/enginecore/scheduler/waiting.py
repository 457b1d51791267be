"""Admission of one waiting request (step 2 of Scheduler.schedule).

For a request that holds no blocks (new, or preempted and recomputed): the
device prefix hit from ``get_computed_blocks``, then the connector's external
hit, then ``allocate_slots`` for the hit plus the first chunk. A request whose
async load landed already holds its blocks and resumes from its computed
tokens. Blocks that receive external KV are allocated uncached (see
``transfers``): a failed load must never be hit.

``admit`` reserves the blocks and returns an ``Admission``, or says why not;
it changes neither the request nor the queue: the Scheduler applies the
decision (status, counters, running list, transfer tracking).
"""

from __future__ import annotations

import enum

from kvstrata.connector.base import KVConnectorScheduler
from kvstrata.enginecore.request import Request
from kvstrata.kv import KVCacheManager


class Admission:
    """A waiting request that got its blocks: ``num_computed`` tokens count
    as computed (``num_local`` from the device prefix cache, ``num_external``
    through the connector), ``num_new`` are computed this step (0 while an
    async load fills the external ones)."""

    __slots__ = ("num_computed", "num_new", "num_local", "num_external", "load_async", "load_at")

    def __init__(self, num_computed: int, num_new: int, num_local: int, num_external: int,
                 load_async: bool, load_at: int | None = None) -> None:
        self.num_computed = num_computed
        self.num_new = num_new
        self.num_local = num_local
        self.num_external = num_external
        self.load_async = load_async
        self.load_at = load_at  # compute up to here, then ask the connector again (its load_point)


class Refusal(enum.Enum):
    """Why ``admit`` reserved nothing."""

    NOT_KNOWN = "the connector cannot tell the hit yet: skip it, it keeps its place"
    NO_FIT = "no room in the budget (chunked prefill off) or the pool: end the pass (policy order)"


def admit(
    req: Request,
    kv: KVCacheManager,
    connector: KVConnectorScheduler,
    *,
    budget: int,
    long_prefill_threshold: int,
    chunked_prefill: bool,
    enable_caching: bool,
) -> Admission | Refusal:
    """Look up ``req``'s hits, size its first chunk and reserve its blocks.

    Returns the Admission (blocks allocated, the connector told) or a
    Refusal (nothing changed).
    """
    num_tokens = len(req.all_token_ids)
    computed_blocks, n_local, ext, load_async = None, 0, 0, False
    first_lookup = not kv.has_request(req.request_id)
    if first_lookup:
        if enable_caching:
            computed_blocks, n_local = kv.get_computed_blocks(req)
        ext, load_async = connector.get_num_new_matched_tokens(req, n_local)
        if ext is None:
            return Refusal.NOT_KNOWN
        # At least the last token is always computed: it yields the logits.
        ext = max(0, min(ext, num_tokens - 1 - n_local))
        load_async = load_async and ext > 0
        num_computed = n_local + ext
        # Nothing to load now: the connector may load the back while the front is computed.
        load_at = connector.load_point(req) if ext == 0 else None
    else:
        num_computed = req.num_computed_tokens
        load_at = req.load_at
    if load_async:
        n = 0
    else:
        n = num_tokens - num_computed
        if load_at is not None and num_computed < load_at:
            n = min(n, load_at - num_computed)
        if 0 < long_prefill_threshold < n:
            n = long_prefill_threshold
        if n > budget:
            if not chunked_prefill:
                return Refusal.NO_FIT
            n = budget
    blocks = kv.allocate_slots(
        req, n,
        num_new_computed_tokens=n_local,
        new_computed_blocks=computed_blocks,
        num_external_computed_tokens=ext,
        # Loaded blocks enter the prefix cache only once their KV arrived.
        delay_cache_blocks=ext > 0,
    )
    if blocks is None:
        return Refusal.NO_FIT  # no room even after eviction
    connector.update_state_after_alloc(req, kv.get_block_ids(req.request_id), ext)
    return Admission(num_computed, n, n_local, ext, load_async, load_at)
