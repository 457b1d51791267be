"""AsyncEngine: the asyncio shell around EngineCore.

One event loop owns the engine: the scheduler, the KV cache manager and
every request live on it, without locks. The engine-loop task repeats

    schedule (loop) ─► execute (step thread) ─► update (loop) ─► deliver outputs

and while a step executes in the single worker thread the loop keeps
serving: ``generate`` validates and queues new requests at once (the
scheduler's waiting queue, bounded by ``scheduler.max_waiting_requests``, is
the input queue), ``abort`` frees a request's blocks at once (the runner
never touches scheduler or KV state, so this is safe mid-step; the step's
output for it is dropped), and consumers receive the previous step's deltas.

A consumer that stops iterating, or is cancelled, aborts its request (the
generator's ``finally``). A step that raises fails the requests it
scheduled (finish_reason "error") and the engine keeps serving; after
``MAX_CONSECUTIVE_STEP_FAILURES`` failed steps in a row the model is taken
to be broken and the engine dies. A dead or closed engine raises
``EngineDeadError`` to every pending and future caller. ``aclose()`` is
idempotent: it lets an in-flight step finish, aborts every live request (its
stream ends with finish_reason "abort"), then refuses new work.

States: running ─► closing ─► closed, or running ─► dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import structlog

from kvstrata.config import EngineConfig
from kvstrata.enginecore.builder import build_engine_core
from kvstrata.enginecore.engine_core import EngineCore, ModelRunnerLike
from kvstrata.errors import EngineDeadError, RequestError
from kvstrata.enginecore.request import EngineRequest
from kvstrata.types import EngineStats, RequestOutput, SamplingParams

log = structlog.get_logger(__name__)

# Receives a request's outputs in order, then possibly an EngineDeadError.
# Called on the loop, synchronously, once per output: it must not block.
OutputSink = Callable[[RequestOutput | BaseException], None]

MAX_CONSECUTIVE_STEP_FAILURES = 3
# How long the loop waits for new input when requests are live but nothing
# could be computed (KV loads or saves in flight) before it polls again.
_IDLE_POLL_S = 0.002


class AsyncEngine:
    """Owns: the EngineCore (used from the loop; its runner also from the
    step thread), one output sink per live request, the single-thread step
    executor, and the engine-loop task."""

    def __init__(self, core: EngineCore, executor: ThreadPoolExecutor) -> None:
        self._core = core
        self._executor = executor
        self._sinks: dict[str, OutputSink] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        self._closed = False
        self._dead: EngineDeadError | None = None
        self._connector: Any = None  # a KV connector this engine opened (and closes)
        self._publisher: Any = None  # KV events publisher, when cache.kv_events_endpoint is set

    @classmethod
    async def start(
        cls, config: EngineConfig, *, runner: ModelRunnerLike | None = None, connector: Any = None
    ) -> AsyncEngine:
        """Build the engine off the loop (model loading blocks) and start its loop.

        ``runner`` replaces the runner the config names (tests, benchmarks).
        ``connector`` replaces the KV connector ``config.kv_transfer`` names;
        a connector the engine opens itself (on this loop: its store belongs
        to it) is closed by ``aclose``.
        """
        config.validate()
        owned = None
        if connector is None and config.kv_transfer is not None:
            from kvstrata.connector import KVConnectorFactory

            connector = owned = await KVConnectorFactory().open(config.kv_transfer)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstrata-step")
        loop = asyncio.get_running_loop()
        build = partial(build_engine_core, config, runner, connector)
        try:
            core = await loop.run_in_executor(executor, build)
        except BaseException:
            executor.shutdown(wait=False)
            if owned is not None:
                await owned.aclose()
            raise
        engine = cls(core, executor)
        engine._connector = owned
        if config.cache.kv_events_endpoint is not None:
            from kvstrata.ipc.kv_publisher import ZmqEventPublisher

            engine._publisher = ZmqEventPublisher(config.cache.kv_events_endpoint)
        engine._task = loop.create_task(engine._run(), name="kvstrata-engine-loop")
        log.info("engine_started", executor=config.executor)
        return engine

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def core(self) -> EngineCore:
        return self._core

    # -- the public API ---------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's deltas; the last one has ``finished=True``.

        Bad input raises RequestError before anything is queued; a full
        waiting queue raises EngineOverloadedError.
        """
        stream: asyncio.Queue = asyncio.Queue()
        sink = stream.put_nowait
        rid = self.submit(prompt, params, sink, request_id=request_id, priority=priority,
                          cache_salt=cache_salt, lora_name=lora_name)
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished and self._sinks.get(rid) is sink:
                self._abort_now(rid)

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None,
        sink: OutputSink,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> str:
        """Queue a request whose outputs go to ``sink``; return its id.

        The callback form of ``generate`` for transports that batch a step's
        outputs themselves (the ZMQ engine server): every output of one step
        reaches its sink within the same loop iteration, with no task per
        request. Raises like ``generate`` before anything is queued.
        """
        self._check_alive()
        rid = uuid.uuid4().hex if request_id is None else request_id
        req = EngineRequest(
            request_id=rid, prompt_token_ids=self._tokenize(prompt),
            sampling_params=SamplingParams() if params is None else params,
            priority=priority, cache_salt=cache_salt, lora_name=lora_name,
        )
        self._core.add_request(req)
        self._sinks[rid] = sink
        self._wakeup.set()
        return rid

    async def abort(self, request_id: str) -> None:
        """Abort a live request now; a no-op for unknown or finished ids."""
        if self._dead is None and not self._closed:
            self._abort_now(request_id)

    async def stats(self) -> EngineStats:
        self._check_alive()
        return self._core.stats()

    async def reset_prefix_cache(self) -> bool:
        self._check_alive()
        return self._core.reset_prefix_cache()

    async def flush_kv(self, timeout_s: float = 60.0) -> None:
        """Wait until every KV transfer started so far is done: loads landed,
        finished requests' saves taken (their blocks freed), and every queued
        write reached every tier of the connector's store."""
        self._check_alive()
        s = self._core.scheduler
        async with asyncio.timeout(timeout_s):
            while s.has_pending_transfers():
                self._wakeup.set()
                await asyncio.sleep(0.002)
            connector = self._core.kv_connector
            if connector is not None:
                await connector.flush()

    async def aclose(self) -> None:
        """Finish the in-flight step, abort every live request, stop. Idempotent."""
        if self._closed:
            return
        self._closing = True
        self._wakeup.set()
        task = self._task
        try:
            if task is not None and not task.done():
                await asyncio.shield(task)
        finally:
            if not self._closed:
                self._closed = True
                self._shutdown()
                await self._close_kv()

    async def _close_kv(self) -> None:
        connector, self._connector = self._connector, None
        publisher, self._publisher = self._publisher, None
        try:
            if connector is not None:
                await connector.aclose()
        finally:
            if publisher is not None:
                await asyncio.to_thread(publisher.close)

    # -- internals --------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead), cause=self._dead.cause)
        if self._closing:
            raise EngineDeadError("engine is closed")

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt", "must not be empty")
            tokenizer = self._core.tokenizer
            if tokenizer is None:
                raise RequestError("prompt", "this engine has no tokenizer; pass token ids")
            return tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return list(prompt)
        raise RequestError("prompt", f"must be a str or a list of token ids, got {type(prompt).__name__}")

    def _abort_now(self, request_id: str) -> None:
        self._deliver(self._core.abort_requests([request_id]))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        sinks = self._sinks
        for out in outputs:
            sink = sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del sinks[out.request_id]
            sink(out)

    async def _run(self) -> None:
        core = self._core
        loop = asyncio.get_running_loop()
        try:
            while not self._closing:
                if not core.has_work():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                so = core.schedule()
                if not core.should_execute(so):
                    await self._idle_wait()
                    continue
                try:
                    out = await loop.run_in_executor(self._executor, core.execute, so)
                except Exception as exc:
                    self._deliver(core.fail_step(so, exc))
                    if core.consecutive_failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
                        raise EngineDeadError(
                            f"{core.consecutive_failed_steps} model steps failed in a row", cause=exc
                        ) from exc
                    continue
                self._deliver(core.update(so, out))
                if self._publisher is not None:
                    self._publish_events()
                if not so.total_num_scheduled_tokens:
                    await self._idle_wait()  # polled for KV transfers only: do not spin
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a broken model or an engine bug: fail everyone fast
            self._die(exc)
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt, SystemExit: fail fast, then let them through

    def _publish_events(self) -> None:
        from kvstrata.kv.events import KVEventBatch

        events = self._core.take_kv_events()
        if events:
            self._publisher.publish(KVEventBatch(ts=time.time(), events=events))

    async def _idle_wait(self) -> None:
        self._wakeup.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_IDLE_POLL_S):
                await self._wakeup.wait()

    def _die(self, exc: BaseException) -> None:
        dead = exc if isinstance(exc, EngineDeadError) else EngineDeadError("engine loop failed", cause=exc)
        self._dead = dead
        log.error("engine_dead", error=str(dead), exc_info=exc)
        self._end_sinks(dead)
        with contextlib.suppress(Exception):  # free blocks if the core still can
            self._core.abort_requests(list(self._core.scheduler.requests))

    def _end_sinks(self, dead: EngineDeadError) -> None:
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink(EngineDeadError(str(dead), cause=dead.cause))

    def _shutdown(self) -> None:
        if self._dead is None:
            self._deliver(self._core.abort_requests(list(self._core.scheduler.requests)))
            self._dead = EngineDeadError("engine is closed")
        self._end_sinks(self._dead)
        self._executor.shutdown(wait=False)
        log.info("engine_closed")


def run(main: Coroutine[Any, Any, Any]) -> Any:
    """Run ``main`` to completion on uvloop when it is installed, else asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
