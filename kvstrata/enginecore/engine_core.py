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
never written: their hashes are evicted, including those of requests
aborted while the step ran, so no later request can hit them. The engine
keeps serving; the async shell declares it dead after several failed steps
in a row.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import structlog

from kvstrata.config import EngineConfig
from kvstrata.text.detokenizer import IncrementalDetokenizer
from kvstrata.errors import EngineOverloadedError
from kvstrata.enginecore.request import (
    FINISH_REASONS,
    EngineRequest,
    Request,
    RequestStatus,
    validate_engine_request,
)
from kvstrata.enginecore.scheduler import Scheduler
from kvstrata.types import (
    EngineStats,
    ModelRunnerOutput,
    RequestOutput,
    SchedulerOutput,
)
from kvstrata.kv import (
    CacheIdentity,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    make_block_hasher,
)
from kvstrata.connector import ConnectorSpec, KVConnectorScheduler
from kvstrata.connector.events import device_events
from kvstrata.kv.events import AnyKVCacheEvent

log = structlog.get_logger(__name__)


class ModelRunnerLike(Protocol):
    """What EngineCore needs of a model runner (ModelRunner, NullModelRunner)."""

    tokenizer: Any
    max_model_len: int
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # every id that ends generation (optional)
    model_fingerprint: str

    def kv_cache_spec(self) -> Any: ...
    def num_blocks_for_memory(self, mib: int) -> int: ...
    def initialize_kv_cache(self, num_blocks: int) -> None: ...
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class EngineCore:
    """Owns: the scheduler (through it the KV cache manager and every
    request) and the model runner. Not thread-safe: every method but
    ``execute`` belongs to the one thread (the event loop) that owns it."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunnerLike,
        *,
        connector: Any = None,
    ) -> None:
        """``connector``: a KV connector (``kvstrata.connector.KVConnector``,
        whose two sides are built here for this engine), or a scheduler side
        alone (tests), or None."""
        config.validate()
        self.config = config
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.vocab_size: int | None = getattr(runner, "vocab_size", None)
        eos = getattr(runner, "eos_token_ids", None) or (runner.eos_token_id,)
        self.eos_token_ids: tuple[int, ...] = tuple(t for t in eos if t is not None)
        cache = config.cache
        spec = runner.kv_cache_spec()
        if spec.block_size != cache.block_size:
            raise ValueError(
                f"cache.block_size ({cache.block_size}) differs from the runner's ({spec.block_size})"
            )
        num_blocks = cache.num_blocks or runner.num_blocks_for_memory(cache.kv_cache_memory_mib)
        if num_blocks < 2:
            raise ValueError(
                f"cache.kv_cache_memory_mib={cache.kv_cache_memory_mib} holds {num_blocks} blocks; need >= 2"
            )
        kv_config = KVCacheConfig(num_blocks=num_blocks, groups=[KVCacheGroupSpec(
            layer_names=list(spec.layer_names),
            spec=FullAttentionSpec(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                                   head_size=spec.head_size, dtype=spec.dtype),
        )])
        # A request alone must always fit in the pool (block 0 is the null block),
        # else it would preempt itself forever: cap the context at the pool.
        pool_tokens = (num_blocks - 1) * cache.block_size
        self.max_model_len = min(runner.max_model_len, pool_tokens)
        if self.max_model_len < runner.max_model_len:
            log.warning("max_model_len_capped_by_kv_cache", model=runner.max_model_len,
                        kv_cache_tokens=pool_tokens)
        sched = config.scheduler
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"scheduler.max_num_batched_tokens ({sched.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when chunked prefill is disabled"
            )
        self.identity = CacheIdentity(
            model_fingerprint=runner.model_fingerprint, kv_dtype=spec.dtype,
            kv_layout=cache.kv_layout, block_size=cache.block_size,
            hash_algo=cache.hash_algo, namespace=cache.cache_namespace,
        )
        hashing = cache.enable_prefix_caching or connector is not None
        self.block_hasher = (
            make_block_hasher(self.identity, random_root=cache.random_hash_root) if hashing else None
        )
        self.kv = KVCacheManager(
            kv_config, max_model_len=self.max_model_len,
            enable_caching=cache.enable_prefix_caching, log_stats=True,
            enable_events=cache.kv_events_endpoint is not None,
            metrics_sample_rate=cache.metrics_sample_rate,
        )
        runner.initialize_kv_cache(num_blocks)
        self.kv_connector = connector if hasattr(connector, "scheduler_side") else None
        if self.kv_connector is not None:
            connector = self._attach(self.kv_connector, spec)
        self.scheduler = Scheduler(
            config.scheduler, self.kv, max_model_len=self.max_model_len,
            enable_prefix_caching=cache.enable_prefix_caching, connector=connector,
        )
        self.max_waiting = config.scheduler.max_waiting_requests
        self.num_failed_steps = 0
        self.consecutive_failed_steps = 0
        # The output being executed, and blocks of requests aborted during it
        # that the step was writing (suspect if the step fails).
        self._in_flight: SchedulerOutput | None = None
        self._aborted_in_flight: list[int] = []
        log.info("engine_core_ready", num_blocks=num_blocks, block_size=cache.block_size,
                 max_model_len=self.max_model_len, prefix_caching=cache.enable_prefix_caching)

    def _attach(self, connector: Any, spec: Any) -> KVConnectorScheduler:
        """Build the connector's two sides for this engine; the worker side
        goes to the runner. Returns the scheduler side."""
        if not callable(getattr(self.runner, "set_kv_connector", None)):
            raise ValueError(f"executor {self.config.executor!r} cannot run a KV connector (kv_transfer)")
        cspec = ConnectorSpec(identity=self.identity, num_layers=len(spec.layer_names),
                              num_kv_heads=spec.num_kv_heads, head_size=spec.head_size, dtype=spec.dtype,
                              max_model_len=self.max_model_len)
        sched_side = connector.scheduler_side(cspec)
        self.runner.set_kv_connector(connector.worker_side(cspec))
        return sched_side

    @classmethod
    def from_config(cls, config: EngineConfig, *, connector: Any = None) -> EngineCore:
        """Build the runner the config names (blocking: loads the model)."""
        config.validate()
        if config.executor == "null":
            from kvstrata.worker.null_runner import NullModelRunner as runner_cls
        else:
            from kvstrata.worker.model_runner import ModelRunner as runner_cls
        return cls(config, runner_cls(config.model, config.cache, config.device), connector=connector)

    # -- requests ---------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        """Validate and queue ``req``; raises RequestError or EngineOverloadedError."""
        validate_engine_request(req, self.max_model_len, self.vocab_size)
        if len(self.scheduler.waiting) >= self.max_waiting:
            raise EngineOverloadedError(self.max_waiting)
        params = req.sampling_params
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, params.stop,
                params.include_stop_str_in_output, min_tokens=params.min_tokens,
            )
        hasher = self.block_hasher
        request = Request(
            req.request_id, req.prompt_token_ids, params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=req.arrival_time or time.monotonic(),
            priority=req.priority, cache_salt=req.cache_salt, lora_name=req.lora_name,
            block_hasher=hasher, hash_block_size=0 if hasher is None else hasher.block_size,
            detokenizer=detok,
        )
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids) -> list[RequestOutput]:
        """Abort live requests now (blocks freed at once); unknown or
        finished ids are ignored. Returns the final outputs to deliver."""
        in_flight = self._in_flight
        if in_flight is not None:
            scheduled = in_flight.num_scheduled_tokens
            reqs = self.scheduler.requests
            for rid in request_ids:
                req = reqs.get(rid)
                if rid in scheduled and req is not None and req.status == RequestStatus.RUNNING:
                    self._aborted_in_flight.extend(self._blocks_written(req, scheduled[rid]))
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
        so = self.scheduler.schedule()
        self._in_flight = so if so.num_scheduled_tokens else None
        self._aborted_in_flight = []
        return so

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the model (any thread; touches only the runner)."""
        return self.runner.execute_model(scheduler_output)

    def update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        self._in_flight = None
        self.consecutive_failed_steps = 0
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def fail_step(self, scheduler_output: SchedulerOutput, exc: BaseException) -> list[RequestOutput]:
        """The model raised on ``scheduler_output``: fail the requests it
        scheduled, uncache the blocks it was writing, keep serving the rest."""
        self._in_flight = None
        self.num_failed_steps += 1
        self.consecutive_failed_steps += 1
        s = self.scheduler
        suspect = self._aborted_in_flight
        self._aborted_in_flight = []
        failed = []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            req = s.requests.get(rid)
            if req is not None and req.status == RequestStatus.RUNNING:
                suspect.extend(self._blocks_written(req, n))
                failed.append(rid)
        if suspect:
            self.kv.evict_blocks(suspect)
        done = s.finish_requests(failed, RequestStatus.FINISHED_ERROR)
        s.fail_step(scheduler_output)
        message = f"model step failed: {type(exc).__name__}: {exc}"
        log.error("step_failed", error=message, num_failed_requests=len(done),
                  consecutive_failures=self.consecutive_failed_steps)
        return [_final_output(r, error=message) for r in done]

    def _blocks_written(self, req: Request, num_scheduled: int) -> list[int]:
        """Ids of the blocks this step writes for ``req`` (every group)."""
        first = (req.num_computed_tokens - num_scheduled) // self.kv.block_size
        return [b for group in self.kv.get_block_ids(req.request_id) for b in group[first:]]

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

    def stats(self) -> EngineStats:
        s = self.scheduler
        c = s.counters
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_usage=self.kv.usage,
            prefix_cache_queries=c.prefix_cache_queries,
            prefix_cache_hits=c.prefix_cache_hits,
            num_preemptions=c.num_preemptions,
            num_finished=c.num_finished,
            num_generated_tokens=c.num_generated_tokens,
            num_prompt_tokens=c.num_prompt_tokens,
            extra={
                "kv.num_blocks": float(self.kv.num_blocks),
                "kv.num_free_blocks": float(self.kv.num_free_blocks),
                "kv.external_hit_tokens": float(c.external_cache_hits),
                "engine.failed_steps": float(self.num_failed_steps),
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
