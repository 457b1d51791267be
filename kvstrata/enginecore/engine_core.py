"""EngineCore: the synchronous heart of the engine, a scheduler (which owns
the requests and drives the KV cache manager) and a model runner.

One step is three calls, so that an async shell can run the middle one off
its event loop while the loop keeps accepting requests:

    so  = core.schedule()          # loop thread: plan (no I/O)
    out = core.execute(so)         # worker thread: the model; touches only the runner
    res = core.update(so, out)     # loop thread: tokens, stops, frees, outputs

``step()`` does all three in one thread. ``add_request``/``abort_requests``
may run between (or, on the loop thread, during) ``execute``: the runner
sees only the frozen SchedulerOutput, never the scheduler's state.

A step that raises fails the requests it scheduled (finish_reason "error").
The blocks that step was computing may already be registered in the prefix
cache (allocate_slots caches blocks as it hands them out) with KV that was
never written: their hashes are evicted, including those of requests that
stopped running while the step ran (aborted, finished, preempted: the
scheduler notes them), so no later request can hit them. The engine keeps
serving; the async shell declares it dead after several failed steps in a
row.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import msgspec
import structlog

from kvstrata.config import EngineConfig
from kvstrata.errors import EngineOverloadedError, RequestError
from kvstrata.enginecore.request import (
    FINISH_REASONS,
    EngineRequest,
    Request,
    RequestStatus,
)
from kvstrata.enginecore.scheduler import Scheduler
from kvstrata.enginecore.spec_decode import Proposer, make_proposer
from kvstrata.types import (
    EngineStats,
    ModelRunnerOutput,
    RequestOutput,
    SchedulerOutput,
)
from kvstrata.kv import BlockHasher, CacheIdentity, KVCacheSpec
from kvstrata.connector import KVConnector
from kvstrata.connector.events import device_events
from kvstrata.text.tokenizer import Tokenizer
from kvstrata.kv.events import AnyKVCacheEvent

log = structlog.get_logger(__name__)


class ModelRunnerLike(Protocol):
    """What the engine needs of a model runner (ModelRunner, NullModelRunner).

    ``kv_cache_spec()`` describes the model's KV per layer, by layer name,
    with ``kvstrata.kv``'s specs; the builder groups equal specs into KV
    cache groups and sizes the pool from their page sizes. A runner that can
    move KV through a connector also has ``set_kv_connector(worker_side)``.
    """

    tokenizer: Tokenizer | None
    max_model_len: int
    vocab_size: int | None
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # every id that ends generation
    model_fingerprint: str
    can_blend: bool  # CacheBlend runs here (a Llama-family model under a connector that blends)

    def kv_cache_spec(self) -> Mapping[str, KVCacheSpec]: ...
    def initialize_kv_cache(self, num_blocks: int) -> None: ...
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


@runtime_checkable
class PipelinedRunner(Protocol):
    """A runner that can launch a step before reading back the one before
    (``kvstrata.worker.pending_step``): ``launch`` never raises; ``collect``
    returns (or raises) the outputs in launch order; a launch that ran the
    whole step returns its output too (else None)."""

    def launch(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None: ...
    def collect(self) -> ModelRunnerOutput: ...


class EngineCore:
    """Owns: the scheduler (through it the KV cache manager and every
    request) and the model runner. Not thread-safe: every method but
    ``execute`` belongs to the one thread (the event loop) that owns it."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunnerLike,
        scheduler: Scheduler,
        *,
        identity: CacheIdentity,
        block_hasher: BlockHasher | None,
        kv_connector: KVConnector | None = None,
    ) -> None:
        """Takes its parts; ``kvstrata.enginecore.builder.build_engine_core``
        assembles them. ``kv_connector``: the connector whose two sides the
        scheduler and the runner hold, or None."""
        self.config = config
        self.runner = runner
        # the runner as a PipelinedRunner, checked once (a runtime Protocol check costs microseconds)
        self._pipelined = runner if isinstance(runner, PipelinedRunner) else None
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.identity = identity
        self.block_hasher = block_hasher
        self.kv_connector = kv_connector
        self.max_model_len = scheduler.max_model_len
        self.tokenizer = runner.tokenizer
        self.vocab_size: int | None = runner.vocab_size
        eos = runner.eos_token_ids or (runner.eos_token_id,)
        self.eos_token_ids: tuple[int, ...] = tuple(t for t in eos if t is not None)
        self.max_waiting = config.scheduler.max_waiting_requests
        self.proposer: Proposer | None = make_proposer(config.speculative, self.max_model_len)
        self.num_failed_steps = 0
        self.consecutive_failed_steps = 0
        # Prompts whose hash chain came with the request (and was used / not).
        self.num_given_chains = 0
        self.num_given_chains_refused = 0
        log.info("engine_core_ready", num_blocks=self.kv.num_blocks, block_size=self.kv.block_size,
                 num_kv_cache_groups=len(self.kv.config.groups), max_model_len=self.max_model_len,
                 prefix_caching=self.kv.enable_caching)

    def release_device(self) -> None:
        """The engine closed: the runner lets go of what it can free at once
        (its decode graphs). The step thread's last job."""
        release = getattr(self.runner, "release_graphs", None)
        if release is not None:
            release()

    # -- requests ---------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        """Queue ``req``, a request its client already checked
        (``kvstrata.enginecore.processing``): ids only, no text. Raises
        EngineOverloadedError (the waiting queue is full) or RequestError
        (the id is live)."""
        if len(self.scheduler.waiting) >= self.max_waiting:
            raise EngineOverloadedError(self.max_waiting)
        salt = req.cache_salt
        blend = req.sampling_params.blend
        if blend is not None:
            if not self.runner.can_blend:
                raise RequestError("blend", "this engine cannot blend: CacheBlend needs the offload connector "
                                            "(kv_transfer) and a Llama-family model")
            # Blended KV differs from a prefill's: its blocks are hit only by the same blend.
            salt = f"{salt or ''}\x00blend:{msgspec.json.encode(blend).decode()}"
        hasher = self.block_hasher
        request = Request(
            req.request_id, req.prompt_token_ids, req.sampling_params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=req.arrival_time or time.monotonic(),
            priority=req.priority, cache_salt=salt, lora_name=req.lora_name,
            block_hasher=hasher, hash_block_size=0 if hasher is None else hasher.block_size,
            block_hashes=self._given_chain(req, blend is not None),
        )
        self.scheduler.add_request(request)

    def _given_chain(self, req: EngineRequest, blended: bool) -> list[bytes] | None:
        """``req.block_hashes`` when this engine can use it as the prompt's
        chain (a fleet router hashed the prompt with this engine's identity):
        one hash per full block, each of the hasher's digest size, and a
        chain no one else could have computed is never taken (a random hash
        root; a blend, whose salt the engine adds). Else None: hash here."""
        given = req.block_hashes
        if given is None:
            return None
        hasher = self.block_hasher
        usable = (
            hasher is not None and not hasher.random_root and not blended
            and len(given) == len(req.prompt_token_ids) // hasher.block_size
            and all(len(h) == hasher.hash_fn.digest_size for h in given)
        )
        if usable:
            self.num_given_chains += 1
            return given
        self.num_given_chains_refused += 1
        return None

    def abort_requests(self, request_ids) -> list[RequestOutput]:
        """Abort live requests now (blocks freed at once); unknown or
        finished ids are ignored. Returns the final outputs to deliver.
        The blocks a step in flight writes for them are uncached if it fails."""
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [_final_output(r) for r in done]

    def has_work(self) -> bool:
        """Anything to schedule, finished ids the runner has not been told, or
        KV transfers to hear about."""
        s = self.scheduler
        return s.has_unfinished_requests() or bool(s.finished_req_ids) or s.has_pending_transfers()

    def should_execute(self, so: SchedulerOutput) -> bool:
        """Whether ``so`` is worth a runner call: tokens to compute, state to
        drop, or KV transfers whose completion the runner reports."""
        return bool(so.total_num_scheduled_tokens or so.finished_req_ids or so.preempted_req_ids
                    or so.kv_connector_metadata is not None or self.scheduler.transfers.has_pending())

    # -- one step ---------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan the next step; it is in flight until update() or fail_step()."""
        return self.scheduler.schedule()

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the model (any thread; touches only the runner)."""
        return self.runner.execute_model(scheduler_output)

    @property
    def can_pipeline(self) -> bool:
        return self._pipelined is not None

    def launch(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Launch a step (the step thread; a ``PipelinedRunner``); never raises.
        Returns the step's output when the launch ran it whole (``collect``
        returns it again, in turn), else None."""
        assert self._pipelined is not None
        return self._pipelined.launch(scheduler_output)

    def collect(self) -> ModelRunnerOutput:
        """The oldest launched step's output (the step thread)."""
        assert self._pipelined is not None
        return self._pipelined.collect()

    def update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        self.consecutive_failed_steps = 0
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.proposer is not None:
            self._propose()
        return outputs

    def _propose(self) -> None:
        """Drafts for the next step of every decoding request (one whose
        tokens are all computed but the last sampled one)."""
        decoding = [r for r in self.scheduler.running if r.num_computed_tokens == len(r.all_token_ids) - 1]
        if not decoding:
            return
        by_id = self.scheduler.requests
        for rid, drafts in self.proposer.propose(decoding).items():  # type: ignore[union-attr]
            req = by_id.get(rid)
            if req is not None:
                req.spec_token_ids = drafts

    def fail_step(self, scheduler_output: SchedulerOutput, exc: BaseException, *,
                  secondary: bool = False) -> list[RequestOutput]:
        """The model raised on ``scheduler_output``: fail the requests it
        scheduled, uncache the blocks it was writing, keep serving the rest.
        ``secondary``: it was queued behind a failed step and failed because
        of it (async scheduling): not counted as a failure of the model."""
        if not secondary:
            self.num_failed_steps += 1
            self.consecutive_failed_steps += 1
        s = self.scheduler
        failed = [rid for rid in scheduler_output.num_scheduled_tokens
                  if (req := s.requests.get(rid)) is not None and req.status == RequestStatus.RUNNING]
        done = s.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        s.fail_step(scheduler_output)  # uncaches what it wrote for them, and for those gone meanwhile
        message = f"model step failed: {type(exc).__name__}: {exc}"
        log.error("step_failed", error=message, num_failed_requests=len(done),
                  consecutive_failures=self.consecutive_failed_steps)
        return [_final_output(r, error=message) for r in done]

    def blocks_written_by(self, scheduler_output: SchedulerOutput) -> set[int]:
        """The blocks a step in flight writes KV into (asked before failing it)."""
        return self.scheduler.blocks_written_by(scheduler_output)

    @staticmethod
    def readers_of(scheduler_output: SchedulerOutput, blocks: set[int]) -> list[str]:
        """The requests ``scheduler_output`` admits on cached KV (a prefix hit,
        or a resumed request's) held in one of ``blocks``: when the step that
        wrote those blocks fails, their KV is garbage. (A fresh block of such
        a request is in ``blocks`` only if a request that left freed it while
        that step ran: such a request is counted as a reader too.)"""
        return [d.req_id for d in scheduler_output.scheduled_new_reqs
                if d.num_computed_tokens and any(b in blocks for group in d.block_ids for b in group)]

    def fail_requests(self, request_ids: list[str], message: str) -> list[RequestOutput]:
        """End live requests with an error (their blocks freed and uncached)."""
        if not request_ids:
            return []
        reqs = self.scheduler.requests
        suspect = [b for rid in request_ids if (r := reqs.get(rid)) is not None and self.kv.has_request(rid)
                   for g in self.kv.get_block_ids(rid) for b in g]
        if suspect:
            self.kv.evict_blocks(suspect)
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ERROR)
        return [_final_output(r, error=message) for r in done]

    def step(self) -> list[RequestOutput]:
        """schedule + execute + update in the calling thread."""
        so = self.schedule()
        if not self.should_execute(so):
            return []
        try:
            out = self.execute(so)
        except Exception as exc:
            return self.fail_step(so, exc)
        return self.update(so, out)

    # -- utilities ----------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash of the device cache; False (and nothing
        changed) while any block is in use. The connector's tiers keep theirs."""
        return self.kv.reset_prefix_cache()

    def take_kv_events(self) -> list[AnyKVCacheEvent]:
        """This step's cache events: the device pool's (medium GPU), then the
        connector's tiers' (CPU, DISK, REMOTE)."""
        return device_events(self.kv.take_events()) + self.scheduler.connector.take_events()

    def kv_snapshot_events(self) -> list[AnyKVCacheEvent]:
        """Every cache's content now, as BlockStored events with their media
        (device GPU, then the connector's tiers when it can tell: an optional
        ``snapshot_events()`` on the connector's scheduler side)."""
        tiers = getattr(self.scheduler.connector, "snapshot_events", None)
        return device_events(self.kv.snapshot_events()) + (tiers() if tiers is not None else [])

    def stats(self) -> EngineStats:
        """Counters since start. The prefix-cache counts are the KV cache
        manager's (the one count); resumptions of preempted requests are in
        the totals and split out in ``extra``."""
        s = self.scheduler
        c = s.counters
        kv = self.kv
        p = kv.prefix_cache_totals()
        assert p is not None  # the builder turns log_stats on
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_usage=kv.usage,
            prefix_cache_queries=p.queries + p.preempted_queries,
            prefix_cache_hits=p.hits + p.preempted_hits,
            num_preemptions=c.num_preemptions,
            num_finished=c.num_finished,
            num_generated_tokens=c.num_generated_tokens,
            num_prompt_tokens=c.num_prompt_tokens,
            block_residency=kv.block_residency(),
            extra={
                **(s.spec_counters.as_extra() if self.proposer is not None else {}),
                **({"scheduler.cache_aware.max_skips_observed": float(s.waiting.max_skips_seen)}
                   if hasattr(s.waiting, "max_skips_seen") else {}),
                "kv.num_blocks": float(kv.num_blocks),
                "kv.num_free_blocks": float(kv.num_free_blocks),
                "kv.prefix_cache.requests": float(p.requests),
                "kv.prefix_cache.preempted_requests": float(p.preempted_requests),
                "kv.prefix_cache.preempted_queries": float(p.preempted_queries),
                "kv.prefix_cache.preempted_hits": float(p.preempted_hits),
                "kv.prefix_cache.resets": float(p.resets),
                # the connector's per-tier books summed: each tier hit counted once
                "kv.external_hit_tokens": float(s.connector.hit_tokens()),
                "engine.failed_steps": float(self.num_failed_steps),
                "engine.given_chains": float(self.num_given_chains),
                "engine.given_chains_refused": float(self.num_given_chains_refused),
                **s.connector.stats(),
            },
        )


def _final_output(req: Request, error: str | None = None) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id, finished=True,
        finish_reason=FINISH_REASONS[req.status], stop_reason=req.stop_reason,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=max(req.num_cached_tokens, 0), error=error,
    )
