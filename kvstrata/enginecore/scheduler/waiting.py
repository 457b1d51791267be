"""Admission of waiting requests (step 2 of Scheduler.schedule).

For a request with nothing computed (new, or preempted and recomputed):
device prefix hit from ``get_computed_blocks``, then the connector's
external hit, then ``allocate_slots`` for the hit plus the first chunk. A
request the connector cannot answer for yet, or one still loading its KV
asynchronously, is skipped and keeps its place at the front. Blocks that
receive external KV are allocated uncached (see ``sched/transfers``). The first
request that does not fit in the pool ends the pass (strict policy order).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstrata.enginecore.request import Request, RequestStatus
from kvstrata.enginecore.scheduler.transfers import remote_kvs_ready

if TYPE_CHECKING:
    from kvstrata.enginecore.scheduler import Scheduler

_WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS


def schedule_waiting(
    s: Scheduler, budget: int, new_reqs: list[Request], num_scheduled: dict[str, int]
) -> int:
    """Admit waiting requests into ``new_reqs``; returns the budget left."""
    waiting, running, kv, connector = s.waiting, s.running, s.kv, s.connector
    threshold = s.long_prefill_threshold
    chunked = s.config.enable_chunked_prefill
    counters = s.counters
    skipped: list[Request] = []
    while waiting and budget > 0 and len(running) < s.max_num_seqs:
        req = waiting.peek()
        if req.status == _WAITING_FOR_REMOTE_KVS and not remote_kvs_ready(s, req):
            skipped.append(waiting.pop())
            continue
        num_tokens = len(req.all_token_ids)
        computed_blocks, n_local, ext, load_async = None, 0, 0, False
        first_lookup = req.num_slots == 0  # holds no blocks: new or preempted
        if first_lookup:
            if s.enable_caching:
                computed_blocks, n_local = kv.get_computed_blocks(req)
            ext, load_async = connector.get_num_new_matched_tokens(req, n_local)
            if ext is None:
                skipped.append(waiting.pop())  # the connector cannot tell yet
                continue
            # At least the last token is always computed: it yields the logits.
            ext = max(0, min(ext, num_tokens - 1 - n_local))
            load_async = load_async and ext > 0
            num_computed = n_local + ext
        else:
            num_computed = req.num_computed_tokens
        if load_async:
            n = 0
        else:
            n = num_tokens - num_computed
            if 0 < threshold < n:
                n = threshold
            if not chunked and n > budget:
                break
            if n > budget:
                n = budget
        blocks = kv.allocate_slots(
            req, n,
            num_new_computed_tokens=n_local,
            new_computed_blocks=computed_blocks,
            num_external_computed_tokens=ext,
            # Loaded blocks enter the prefix cache only once their KV arrived
            # (sched/transfers): a failed load must never be hit.
            delay_cache_blocks=ext > 0,
        )
        if blocks is None:
            break  # no room even after eviction: keep policy order, stop here
        waiting.pop()
        block_ids = kv.get_block_ids(req.request_id)
        connector.update_state_after_alloc(req, block_ids, ext)
        if first_lookup:
            counters.prefix_cache_queries += num_tokens
            counters.prefix_cache_hits += n_local
            counters.external_cache_hits += ext
            req.num_external_computed_tokens = ext
        req.num_slots = len(block_ids[0]) * s.block_size
        req.num_computed_tokens = num_computed
        if load_async:
            req.status = _WAITING_FOR_REMOTE_KVS
            s.loading.add(req.request_id)
            skipped.append(req)
            continue
        if ext > 0:
            s.sync_loading.append(req)
        req.status = RequestStatus.RUNNING
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_computed
        running.append(req)
        new_reqs.append(req)
        num_scheduled[req.request_id] = n
        budget -= n
    if skipped:
        waiting.prepend_all(skipped)
    return budget
