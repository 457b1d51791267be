"""Preemption decisions: which running request gives way, which waiting
request gives its blocks back, and the progress a preempted request loses
(recompute preemption, as vLLM v1). The Scheduler applies them: it frees
the blocks, tells the connector and requeues the request."""

from __future__ import annotations

from kvstrata.enginecore.request import Request, RequestStatus
from kvstrata.enginecore.scheduler.queues import WaitingQueue
from kvstrata.enginecore.scheduler.transfers import TransferTracker
from kvstrata.kv import KVCacheManager


def running_victim(running: list[Request]) -> Request:
    """The running request that gives way: the largest sort key (lowest
    priority under the priority policy, then latest arrival)."""
    return max(running, key=_sort_key)


def waiting_victim(waiting: WaitingQueue, kv: KVCacheManager, transfers: TransferTracker,
                   requester: Request) -> Request | None:
    """The waiting request (not ``requester``) whose blocks are taken back so
    ``requester`` can grow: one that holds blocks (its async load landed,
    or it was parked with loaded KV) and has no load in flight (the worker
    is writing those blocks), with the largest sort key. None: nothing to take."""
    victim: Request | None = None
    for w in waiting:
        if w is requester or not kv.has_request(w.request_id) or transfers.in_flight(w.request_id):
            continue
        if victim is None or w.sort_key > victim.sort_key:
            victim = w
    return victim


def lose_progress(req: Request) -> None:
    """``req`` gave its blocks back: it starts over from a new lookup."""
    req.status = RequestStatus.PREEMPTED
    req.num_computed_tokens = 0
    req.load_at = None
    req.num_preemptions += 1


def _sort_key(req: Request) -> tuple:
    return req.sort_key
