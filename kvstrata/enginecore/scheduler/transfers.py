"""The scheduler's side of KV transfers: what a step's connector results do
to requests and blocks.

    sync load  (blocks filled inside the step, layer by layer): the blocks are
               allocated uncached; after the step they are cached, or, if the
               worker reports any of them invalid, the request rolls back to
               its first failed block (the runner withheld its sampled token)
               and recomputes from there
    async load (request parked in WAITING_FOR_REMOTE_KVS): admitted once the
               worker names it in ``finished_recving``; invalid blocks roll it
               back the same way before its loaded blocks are cached
    delayed free: a finished request's blocks go back to the pool once the
               worker names it in ``finished_sending``

A failed load is never wrong tokens: its blocks are evicted from the device
prefix cache and recomputed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from kvstrata.enginecore.request import Request, RequestStatus
from kvstrata.types import ModelRunnerOutput

if TYPE_CHECKING:
    from kvstrata.enginecore.scheduler import Scheduler

log = structlog.get_logger(__name__)
_RUNNING = RequestStatus.RUNNING


def settle_transfers(s: Scheduler, out: ModelRunnerOutput) -> None:
    """Apply one step's connector results (before its sampled tokens)."""
    s.connector.update_connector_output(out)
    invalid = set(out.invalid_block_ids)
    if invalid:
        s.kv.evict_blocks(sorted(invalid))
    loads, s.sync_loading = s.sync_loading, []
    for req in loads:
        if req.status is not _RUNNING:
            continue  # finished or aborted while the step ran
        pos = first_failed_token(s, req, invalid) if invalid else None
        if pos is not None:
            _roll_back(req, pos, "sync")
        elif s.enable_caching:
            s.kv.cache_blocks(req, req.num_computed_tokens)
    for rid in out.finished_recving:
        if rid not in s.loading:
            continue
        s.finished_recving.add(rid)
        req = s.requests.get(rid)
        pos = first_failed_token(s, req, invalid) if invalid and req is not None else None
        if pos is not None:
            s.recv_rollback[rid] = pos
    for rid in out.finished_sending:
        req = s.delayed_free.pop(rid, None)
        if req is not None:
            s.kv.free(req)


def fail_transfers(s: Scheduler, scheduler_output) -> None:
    """The step raised: the connector drops its buffers; loads it did not
    make are treated as failed, delayed frees it cannot confirm happen now."""
    sending, recving, invalid = s.connector.step_failed(scheduler_output)
    s.sync_loading = []
    settle_transfers(s, ModelRunnerOutput(req_ids=[], sampled_token_ids=[], finished_sending=list(sending),
                                          finished_recving=list(recving), invalid_block_ids=list(invalid)))


def remote_kvs_ready(s: Scheduler, req: Request) -> bool:
    """True once the worker reported the request's async load as done; its
    loaded blocks (up to any failed one) then enter the prefix cache."""
    rid = req.request_id
    if rid not in s.finished_recving:
        return False
    s.finished_recving.discard(rid)
    s.loading.discard(rid)
    pos = s.recv_rollback.pop(rid, None)
    if pos is not None:
        _roll_back(req, pos, "async")
    if s.enable_caching:
        s.kv.cache_blocks(req, req.num_computed_tokens)
    req.status = RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING
    return True


def first_failed_token(s: Scheduler, req: Request, invalid: set[int]) -> int | None:
    """Token position of the request's first block in ``invalid``, or None."""
    for i, b in enumerate(s.kv.get_block_ids(req.request_id)[0]):
        if b in invalid:
            return i * s.block_size
    return None


def _roll_back(req: Request, pos: int, kind: str) -> None:
    if pos >= req.num_computed_tokens:
        return
    log.warning("kv_load_failed_recompute", request_id=req.request_id, kind=kind,
                recompute_from=pos, num_computed=req.num_computed_tokens)
    req.num_computed_tokens = pos
    if req.num_cached_tokens > pos:
        req.num_cached_tokens = pos
