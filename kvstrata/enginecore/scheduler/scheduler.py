"""The scheduler: spends a token budget on running and waiting requests each
step, drives the KV cache manager and the KV connector, and turns the model
runner's output into per-request outputs. vLLM v1's algorithm:

    schedule():
      1. RUNNING, in order: n = tokens not yet computed (1 for a decode, a
         chunk for a continuing prefill), capped by long_prefill_token_threshold
         (unless the request is alone: nobody to share the budget with) and
         the budget. The KV manager is called only when the tokens
         overflow the request's last block; if the pool is full, preempt
         (recompute) the running request with the largest sort key until it
         fits, or give up.
      2. WAITING, in policy order, unless step 1 preempted anyone and while
         running < max_num_seqs: prefix hit (device, then connector), then
         allocate_slots; the first request that does not fit stops the pass.
      3. Output the diff; then advance num_computed_tokens.
    update_from_output(): append sampled tokens, check stops, free finished
      requests (their full blocks stay in the prefix cache), emit outputs.

The scheduler does no I/O; it runs on the event loop that owns it. Its
helpers own their own state and return decisions it applies: ``admit``
(waiting.py) reserves one request's blocks and returns an Admission, the
TransferTracker (transfers.py) returns what a step's KV transfers settle,
``preemption`` picks victims, ``split_load`` answers a split tier hit's next
part, ``update.apply_sampled`` applies a step's sampled tokens.

Steps in flight (two with async scheduling: step N+1 is planned before step
N's output is applied). Each is remembered until its update or failure
(``StepsInFlight``, steps.py). A request that stops running while a step in flight still
writes its KV (finished, aborted, failed, preempted) has its blocks freed
and cached at once, and saved by the connector in a later step (steps run
in order: that step has written them by then); the step notes the blocks it
writes for it, uncached if it fails (the connector then drops the saves of
the steps queued behind it). A request whose sync load rides on a step in
flight is not scheduled again before that step's outcome is known (a failed
block rolls it back, and the runner withheld its sample).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import msgspec
import structlog

from kvstrata.config import SchedulerConfig
from kvstrata.connector.base import KVConnectorScheduler, NoOpConnectorScheduler
from kvstrata.errors import RequestError
from kvstrata.enginecore.request import FINISH_REASONS, Request, RequestStatus
from kvstrata.enginecore.scheduler.plan import StepPlan
from kvstrata.enginecore.scheduler.preemption import lose_progress, running_victim, waiting_victim
from kvstrata.enginecore.scheduler.queues import make_waiting_queue, remove_all
from kvstrata.enginecore.scheduler.split_load import split_load
from kvstrata.enginecore.scheduler.stats import SchedulerCounters
from kvstrata.enginecore.scheduler.steps import StepsInFlight
from kvstrata.enginecore.scheduler.transfers import TransferTracker
from kvstrata.enginecore.scheduler.update import apply_sampled
from kvstrata.enginecore.scheduler.waiting import Admission, Refusal, admit
from kvstrata.enginecore.spec_decode import SpecDecodeCounters
from kvstrata.kv import KVCacheManager, KVCacheBlocks
from kvstrata.types import EngineLoad, Logprobs, ModelRunnerOutput, RequestOutput, SchedulerOutput

log = structlog.get_logger(__name__)

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS


class Scheduler:
    """Owns: every live Request (``requests``), the waiting queue, the running
    list, the ids finished since the last output, the counters, and the
    TransferTracker (``transfers``: which requests wait on the worker's KV
    loads and saves). Drives the KV cache manager and the connector but owns
    neither: the KV manager alone knows which blocks a request holds.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        *,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        connector: KVConnectorScheduler | None = None,
    ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.connector = connector if connector is not None else NoOpConnectorScheduler()
        self.connector.bind_block_tables(kv_cache_manager)  # the connector reads block tables, never copies them
        self.block_size: int = kv_cache_manager.block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_prefix_caching
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.long_prefill_threshold = config.long_prefill_token_threshold
        self.policy = config.policy
        self.requests: dict[str, Request] = {}
        self.waiting = make_waiting_queue(config.policy)
        if config.policy == "cache-aware":
            w = self.waiting
            w.max_skips, w.max_wait_s = config.cache_aware_max_skips, config.cache_aware_max_wait_s
            if enable_prefix_caching:
                w.scorer = lambda r: kv_cache_manager.get_computed_blocks(r)[1]
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.transfers = TransferTracker(self.block_size, kv_cache_manager.get_block_ids)
        self.counters = SchedulerCounters()
        self.spec_counters = SpecDecodeCounters()
        # A finished request's blocks are freed at once even if a step in
        # flight still writes them (steps.py says why that is safe).
        self._in_flight = StepsInFlight()
        self._seq = itertools.count()

    # -- admission and removal --------------------------------------------
    def add_request(self, request: Request) -> None:
        rid = request.request_id
        # A finished request whose save still reads its blocks holds them under its id.
        if rid in self.requests or self.kv.has_request(rid):
            raise RequestError("request_id", f"{rid!r} is already in use by a live request")
        request.seq = next(self._seq)
        prio = request.priority if self.policy == "priority" else 0
        request.sort_key = (prio, request.arrival_time, request.seq)
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        self.waiting.add(request)
        self.counters.num_prompt_tokens += request.num_prompt_tokens
        self.connector.prefetch(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish live requests (abort, error); unknown or finished ids are skipped.

        Blocks are freed at once. The runner never touches KV manager state
        (it sees only the frozen SchedulerOutput), so this is safe even while
        a step that includes these requests is executing; its output for them
        is dropped in update_from_output.
        """
        assert status.is_finished
        done: list[Request] = []
        running_gone: list[Request] = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status > _PREEMPTED:
                continue
            if req.status == _RUNNING:
                running_gone.append(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free_request(req)
            done.append(req)
        if running_gone:
            self.running = remove_all(self.running, running_gone)
        return done

    def _free_request(self, req: Request) -> None:
        rid = req.request_id
        if self._in_flight:
            self._leave_in_flight(req)
        # A waiting or preempted request holds no blocks, unless it is parked
        # for (or done with) an async load.
        holds_blocks = self.kv.has_request(rid)
        block_ids = self.kv.get_block_ids(rid) if holds_blocks else ()
        delay, _params = self.connector.request_finished(req, block_ids)
        del self.requests[rid]
        loading = self.transfers.forget(rid)
        self.finished_req_ids.add(rid)
        self.counters.num_finished += 1
        log.debug("request_finished", request_id=rid, reason=FINISH_REASONS[req.status],
                  num_output_tokens=len(req.all_token_ids) - req.num_prompt_tokens)
        if holds_blocks:
            if not loading:  # blocks an async load is still filling are never cached
                self._cache_computed_blocks(req)
            if delay:
                self.transfers.delay_free(req)
            else:
                self.kv.free(req)

    def _cache_computed_blocks(self, req: Request) -> None:
        """Register the request's full computed blocks before they are freed
        (the decode fast path leaves a just-filled block to the next
        allocate_slots, which a finished or preempted request never makes)."""
        if self.enable_caching:
            self.kv.cache_blocks(req, req.num_computed_tokens)

    def _leave_in_flight(self, req: Request) -> None:
        """``req`` stops running (its blocks are about to be freed) while
        steps in flight may still write its KV: each notes the blocks it
        writes for ``req``, to uncache if it fails."""
        rid = req.request_id
        if self.kv.has_request(rid):
            self._in_flight.leaving(rid, self.kv.get_block_ids(rid), self.block_size)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def load(self) -> EngineLoad:
        """The work queued here now (``EngineLoad``), for routers."""
        queued = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        queued += sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in self.running)
        return EngineLoad(queued_prefill_tokens=queued, num_running=len(self.running), num_waiting=len(self.waiting))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_transfers(self) -> bool:
        """KV loads or saves not done yet: those the worker has to report
        (``transfers.has_pending()``) or the connector's own (lookups,
        writes to its tiers)."""
        return self.transfers.has_pending() or self.connector.has_pending_work()

    # -- schedule ---------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.kv.new_step_starts()
        plan = StepPlan()
        # The threshold shares the budget among competing prefills; a lone
        # request has nobody to share with and gets the whole budget.
        threshold = self.long_prefill_threshold if len(self.running) + len(self.waiting) > 1 else 0
        budget, full = self._schedule_running(self.max_num_batched_tokens, plan, threshold)
        new_reqs: list[Request] = []
        if not (plan.preempted or full) and self.waiting:
            budget = self._schedule_waiting(budget, new_reqs, plan, threshold)
        return self._make_output(new_reqs, plan, self.max_num_batched_tokens - budget)

    def _schedule_running(self, budget: int, plan: StepPlan, threshold: int) -> tuple[int, bool]:
        """Step 1: the running requests, in order, into ``plan``. Returns the
        budget left and whether one found no room (nobody new is admitted)."""
        reqs, prev_computed, new_blocks, sched_n = plan.reqs, plan.prev_computed, plan.new_blocks, plan.n
        num_scheduled = plan.num_scheduled
        running = self.running
        bs = self.block_size
        # Async scheduling: a step in flight loads into these requests' blocks;
        # they wait for its outcome (a failed block rolls them back).
        held = self.transfers.sync_in_flight()
        full = False  # a running request found no room: nobody new is admitted
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if held and req.request_id in held:
                i += 1
                continue
            nc = req.num_computed_tokens
            n = len(req.all_token_ids) + req.num_output_placeholders - nc
            ext = 0
            if req.load_at is not None:
                ext, n = split_load(req, self.connector, nc, n)
            if 0 < threshold < n:
                n = threshold
            if n > budget:
                n = budget
            if n <= 0:
                i += 1  # nothing to compute (its sampled token never came back)
                continue
            drafts = req.spec_token_ids
            if drafts:
                req.spec_token_ids = []
                # a decode with no token in flight: its drafts ride along, within the budget
                if n == 1 and budget > 1 and not req.num_output_placeholders:
                    drafts = drafts[: budget - 1]
                    plan.spec[req.request_id] = drafts
                    n += len(drafts)
            new_ids = None
            if ext or n > -nc % bs:
                # The tokens overflow the block holding the computed ones (the
                # request holds at least up to it; only the KV manager knows
                # if more): ask it, preempting while the pool is full.
                blocks, i, returned = self._allocate_running(req, n, i, plan, ext)
                budget += returned
                if blocks is None:
                    if ext and req.status == _RUNNING:
                        req.load_at = nc  # waits for the step in flight: its load is asked for again
                    full = True
                    break
                ids = blocks.get_block_ids()
                if any(ids):
                    new_ids = ids
                if ext:
                    plan.loaded_from[req.request_id] = nc
                    nc = self._start_split_load(req, ext)
            # Else the tokens fit in the last block: no KV manager call.
            # A block that fills up now is registered in the prefix cache by
            # the next allocate_slots (next step), or when the request is
            # freed or preempted.
            reqs.append(req)
            prev_computed.append(nc)
            new_blocks.append(new_ids)
            sched_n.append(n)
            num_scheduled[req.request_id] = n
            budget -= n
            i += 1
        return budget, full

    def _start_split_load(self, req: Request, ext: int) -> int:
        """``req`` got the blocks for ``ext`` loaded tokens: the connector
        fills them within the step; returns its computed tokens."""
        self.connector.update_state_after_alloc(req, self.kv.get_block_ids(req.request_id), ext)
        self.transfers.start_sync_load(req)
        req.num_computed_tokens += ext
        return req.num_computed_tokens

    def _allocate_running(self, req: Request, n: int, i: int, plan: StepPlan,
                          ext: int = 0) -> tuple[KVCacheBlocks | None, int, int]:
        """allocate_slots for running ``req`` (at index ``i``), preempting the
        running request with the largest sort key (lowest priority under the
        priority policy, then latest arrival) until it fits or ``req`` itself
        is the victim. While a step is in flight ``req`` never preempts itself:
        it waits for that step, which may free room (requests it finishes,
        loads it lands that waiting requests then give back); preempting it
        would throw that step's work away, and two requests could take turns
        at it forever. Returns (blocks or None, the index the loop continues
        from, budget given back by victims already scheduled this step)."""
        running = self.running
        returned = 0
        while True:
            blocks = (self.kv.allocate_slots(req, n, num_external_computed_tokens=ext, delay_cache_blocks=True)
                      if ext else self.kv.allocate_slots(req, n))
            if blocks is not None:
                return blocks, i, returned
            if self._reclaim_from_waiting(req):
                continue  # idle blocks of a waiting request first
            victim = running_victim(running)
            if victim is req and self._in_flight:
                return None, i, returned
            vi = running.index(victim)
            del running[vi]
            if vi < i:
                i -= 1
            if victim.request_id in plan.num_scheduled:
                returned += plan.unschedule(victim)
                # allocate_slots cached the blocks it handed out for tokens
                # this step no longer computes: they must not be hit.
                first = victim.num_computed_tokens // self.block_size
                self.kv.evict_blocks([b for g in self.kv.get_block_ids(victim.request_id) for b in g[first:]])
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is req:
                return None, i, returned

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: free the blocks (full ones stay cached),
        forget progress, back to the front of the waiting queue."""
        if self._in_flight:
            self._leave_in_flight(req)
        self._cache_computed_blocks(req)
        # The connector reads the victim's KV (offload on preemption) before
        # this step's loads and forward may reuse its blocks.
        self.connector.request_preempted(req, self.kv.get_block_ids(req.request_id))
        self.kv.free(req)
        lose_progress(req)
        req.spec_token_ids = []
        req.num_output_placeholders = 0  # what a step in flight samples for it is dropped
        self.counters.num_preemptions += 1
        self.waiting.prepend(req)
        log.info("request_preempted", request_id=req.request_id, reason="no_free_blocks",
                 num_tokens=len(req.all_token_ids))

    def _reclaim_from_waiting(self, requester: Request) -> bool:
        """Take back the blocks of one waiting request that holds some (its
        async load landed, or it was parked with loaded KV) so ``requester``
        can grow: without this, waiting requests holding most of the pool
        while needing more would wait for each other forever. The victim is
        the one with the largest sort key; its loaded blocks stay in the
        prefix cache (they hit again unless evicted first) and it starts over
        from a new lookup, keeping its place in the queue. Loads still in
        flight are never touched (the worker is writing their blocks): they
        land, then become reclaimable. False when there is nothing to take."""
        kv = self.kv
        if kv.num_requests <= len(self.running):
            return False  # only running requests hold blocks: no scan of the waiting queue
        victim = waiting_victim(self.waiting, kv, self.transfers, requester)
        if victim is None:
            return False
        if victim.status == _WAITING_FOR_REMOTE_KVS:
            self._load_landed(victim)  # landed: rolled back if it failed, cached
        else:
            self._cache_computed_blocks(victim)
        self.connector.request_preempted(victim, kv.get_block_ids(victim.request_id))
        kv.free(victim)
        lose_progress(victim)
        self.counters.num_preemptions += 1
        log.info("request_preempted", request_id=victim.request_id, reason="waiting_blocks_reclaimed",
                 requester=requester.request_id)
        return True

    def _make_output(self, new_reqs: list[Request], plan: StepPlan, total: int) -> SchedulerOutput:
        finished = list(self.finished_req_ids)
        self.finished_req_ids = set()
        out = plan.to_output(new_reqs, total, finished, self.kv.get_block_ids)
        meta = self.connector.build_connector_meta(out)
        if meta is not None:
            out = msgspec.structs.replace(out, kv_connector_metadata=meta)
        self.transfers.seal(id(out), transfers=meta is not None)
        if plan.num_scheduled:
            starts = plan.write_starts(new_reqs)  # before the counts advance
            self._in_flight.add(id(out), starts, plan.advance(new_reqs))
        return out

    # -- admission ----------------------------------------------------------
    def _schedule_waiting(self, budget: int, new_reqs: list[Request], plan: StepPlan, threshold: int) -> int:
        """Admit waiting requests in policy order into ``new_reqs``; returns
        the budget left. A request parked for an async load, or one the
        connector cannot answer for yet, is skipped and keeps its place at the
        front; the first request that does not fit ends the pass."""
        waiting, running = self.waiting, self.running
        skipped: list[Request] = []
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            req = waiting.peek()
            if req.status == _WAITING_FOR_REMOTE_KVS and not self._load_landed(req):
                skipped.append(waiting.pop())
                continue
            a = admit(req, self.kv, self.connector, budget=budget, long_prefill_threshold=threshold,
                      chunked_prefill=self.config.enable_chunked_prefill, enable_caching=self.enable_caching)
            if a is Refusal.NOT_KNOWN:
                skipped.append(waiting.pop())
                continue
            if a is Refusal.NO_FIT:
                if self._reclaim_from_waiting(req):
                    continue  # room was given back: try the head again
                break
            waiting.pop()
            if not self._apply_admission(req, a):
                skipped.append(req)  # parked until its async load lands
                continue
            new_reqs.append(req)
            plan.num_scheduled[req.request_id] = a.num_new
            if a.num_external:
                plan.loaded_from[req.request_id] = a.num_computed - a.num_external
            budget -= a.num_new
        if skipped:
            waiting.prepend_all(skipped)
        return budget

    def _apply_admission(self, req: Request, a: Admission) -> bool:
        """Set the request going; False if it is parked for an async load
        instead of running. (Hits are counted by the KV cache manager and
        the connector, each once.)"""
        req.num_computed_tokens = a.num_computed
        req.load_at = a.load_at
        if a.load_async:
            req.status = _WAITING_FOR_REMOTE_KVS
            self.transfers.start_async_load(req.request_id)
            return False
        if a.num_external:
            self.transfers.start_sync_load(req)
        req.status = _RUNNING
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = a.num_computed
        self.running.append(req)
        return True

    def _load_landed(self, req: Request) -> bool:
        """True once the worker reported ``req``'s async load done; its loaded
        blocks (up to any failed one) then enter the prefix cache."""
        landed = self.transfers.take_landed(req.request_id)
        if landed is None:
            return False
        if landed.roll_back_to is not None:
            self._roll_back(req, landed.roll_back_to, "async")
        self._cache_computed_blocks(req)
        req.status = RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING
        return True

    # -- KV transfers -------------------------------------------------------
    def _settle(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """Apply the connector results of ``so``'s step (before its sampled tokens)."""
        self.connector.update_connector_output(out)
        st = self.transfers.settle(out, id(so))
        if not st:
            return
        if st.evict:
            self.kv.evict_blocks(st.evict)
        for req, pos in st.roll_back:
            self._roll_back(req, pos, "sync")
        for req in st.cache:
            self._cache_computed_blocks(req)
        for req in st.free:
            self.kv.free(req)

    def blocks_written_by(self, scheduler_output: SchedulerOutput) -> set[int]:
        """The blocks the step of ``scheduler_output`` (in flight) writes KV
        into, for the requests it runs and for those that left meanwhile."""
        kv = self.kv

        def tables(rid: str) -> tuple[list[int], ...]:
            return kv.get_block_ids(rid) if kv.has_request(rid) else ()

        return self._in_flight.written(id(scheduler_output), tables, self.block_size)

    def fail_step(self, scheduler_output: SchedulerOutput) -> None:
        """The step of ``scheduler_output`` raised (its requests already
        failed): the connector drops its buffers, loads it did not make count
        as failed, delayed frees it cannot confirm happen now, and the runner
        is told again next step what this one should have told it. The
        blocks it wrote for requests that stopped running meanwhile (its own
        failed ones too) are uncached."""
        suspect = self._in_flight.done(id(scheduler_output))
        if suspect:
            self.kv.evict_blocks(suspect)
        sending, recving, invalid = self.connector.step_failed(scheduler_output)
        self.transfers.step_failed(id(scheduler_output))
        self._settle(scheduler_output, ModelRunnerOutput(
            req_ids=[], sampled_token_ids=[], finished_sending=list(sending),
            finished_recving=list(recving), invalid_block_ids=list(invalid)))
        self.finished_req_ids.update(scheduler_output.finished_req_ids)
        self.finished_req_ids.update(scheduler_output.preempted_req_ids)

    def _roll_back(self, req: Request, pos: int, kind: str) -> None:
        """A load into ``req``'s blocks failed from token ``pos`` on: recompute from there."""
        if pos >= req.num_computed_tokens:
            return
        log.warning("kv_load_failed_recompute", request_id=req.request_id, kind=kind,
                    recompute_from=pos, num_computed=req.num_computed_tokens)
        req.num_computed_tokens = pos
        if req.num_cached_tokens > pos:
            req.num_cached_tokens = pos

    # -- update -----------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Apply one step's sampled tokens; returns the outputs to stream."""
        self._in_flight.done(id(scheduler_output))
        self._settle(scheduler_output, runner_output)
        outputs, stopped, num_generated = apply_sampled(
            self.requests, scheduler_output, runner_output, max_model_len=self.max_model_len,
            spec_counters=self.spec_counters, finish=self._finish)
        if stopped:
            self.running = remove_all(self.running, stopped)
        self.counters.num_generated_tokens += num_generated
        return outputs

    def _finish(self, req: Request, status: RequestStatus, new_ids: list[int],
                logprobs: Logprobs | None) -> RequestOutput:
        """Stop a running request (the caller drops it from ``running``)."""
        req.status = status
        self._free_request(req)
        return RequestOutput(
            request_id=req.request_id, new_token_ids=new_ids,
            finished=True, finish_reason=FINISH_REASONS[status], stop_reason=req.stop_reason,
            logprobs=None if logprobs is None else [logprobs],
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens,
        )
