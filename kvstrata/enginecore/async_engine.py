"""AsyncEngine: the asyncio shell around EngineCore, and the in-process
``EngineClient``.

One event loop owns the engine: the scheduler, the KV cache manager and
every request live on it, without locks. The engine-loop task repeats

    schedule (loop) ─► execute (step thread) ─► update (loop) ─► deliver outputs

and while a step executes in the single worker thread the loop keeps
serving: ``submit`` queues new requests at once (the scheduler's waiting
queue, bounded by ``scheduler.max_waiting_requests``, is the input queue),
``abort`` frees a request's blocks at once (the runner never touches
scheduler or KV state, so this is safe mid-step; the step's output for it is
dropped), and consumers receive the previous step's deltas.

Two entries: ``submit(EngineRequest, sink)`` is the engine side (token ids
in, token-id outputs to a callback; the ZMQ engine server uses it), and
``generate`` is the in-process client: it runs the input and output
processors (tokenize, check, detokenize, stop strings) in the consumer's
coroutine, never in the engine step.

The loop never polls. It sleeps on one wake-up event, set by a new request,
an abort, or the KV connector (``wakeup``, thread-safe) when a load, save,
lookup or store write completes. A bare poll (a step that only asks the
runner which KV transfers finished) runs once after a step that computed
tokens, then only after a wake-up.

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
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Protocol, TypeVar, Unpack

import structlog

from kvstrata.config import EngineConfig
from kvstrata.connector import KVConnector
from kvstrata.enginecore.builder import build_engine_core
from kvstrata.enginecore.client import GenerateOptions, generate_chat, served_model_name
from kvstrata.enginecore.engine_core import EngineCore, ModelRunnerLike
from kvstrata.enginecore.processing import InputProcessor, ModelFacts, OutputProcessor
from kvstrata.enginecore.request import EngineRequest
from kvstrata.enginecore.stepping import OverlappedSteps, PipelinedSteps, SerialSteps, Step
from kvstrata.errors import EngineDeadError
from kvstrata.kv.events import KVEventBatch
from kvstrata.kv.hashing import CacheIdentity
from kvstrata.text.tokenizer import Tokenizer
from kvstrata.types import EngineHealth, EngineLoad, EngineStats, RequestOutput, SamplingParams, SchedulerOutput

log = structlog.get_logger(__name__)

RELEASE_WAIT_S = 30.0  # aclose waits this long for the step thread to drop the runner's graphs

# Receives a request's outputs in order, then possibly an EngineDeadError.
# Called on the loop, synchronously, once per output: it must not block.
OutputSink = Callable[[RequestOutput | BaseException], None]


class _Stream:
    """One ``generate`` call's outputs, put by the engine loop: what arrived
    since the consumer last took, and the future it waits on. Lighter than
    an asyncio.Queue on the per-token path (no task-done bookkeeping, no
    future per get when items are waiting), and a consumer that fell behind
    takes everything pending in one wake-up."""

    __slots__ = ("_items", "_waiter", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._items: list[RequestOutput | BaseException] = []
        self._waiter: asyncio.Future | None = None
        self._loop = loop

    def put(self, item: RequestOutput | BaseException) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[RequestOutput | BaseException]:
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items

MAX_CONSECUTIVE_STEP_FAILURES = 3
_T = TypeVar("_T")


class KVEventSink(Protocol):
    """Where the engine hands each step's KV cache events (the ZMQ publisher
    of ``kvstrata.ipc``, built by whoever starts the engine)."""

    def publish(self, batch: KVEventBatch) -> bool:
        """Take one batch; never blocks. False when it was dropped (full)."""
        ...

    async def aclose(self) -> None: ...


class AsyncEngine:
    """Owns: the EngineCore (used from the loop; its runner also from the
    step thread), one output sink per live request, the single-thread step
    executor and the stepping strategy over it (serial or overlapped), the
    engine-loop task and its wake-up event, the input processor, and the KV
    connector and events sink it was handed to close."""

    def __init__(self, core: EngineCore, executor: ThreadPoolExecutor) -> None:
        self._core = core
        self._executor = executor
        self._loop = asyncio.get_running_loop()
        self._sinks: dict[str, OutputSink] = {}
        self._wakeup = asyncio.Event()
        self._step_waiters: list[asyncio.Future[None]] = []
        self._task: asyncio.Task | None = None
        self._closing = False
        self._closed = False
        self._dead: EngineDeadError | None = None
        # When the loop last made progress (computed a token, or had no work).
        self._progress_at = time.monotonic()
        self._stall_timeout_s = core.config.scheduler.stall_timeout_s
        # Overlap scheduling with the model step (OverlappedSteps).
        # Speculative decoding proposes drafts from committed tokens only: it
        # keeps steps serial.
        # Both switches' None: on for CUDA (the oracle is identical with them there).
        device = getattr(core.runner, "device", None)
        on_cuda = getattr(device, "type", str(device)) == "cuda"
        sched = core.config.scheduler
        wanted = on_cuda if sched.async_scheduling is None else sched.async_scheduling
        self.async_scheduling = bool(wanted) and core.proposer is None
        if wanted and not self.async_scheduling:
            log.info("async_scheduling_off", reason="speculative decoding")
        pipelined = on_cuda if sched.pipelined_steps is None else sched.pipelined_steps
        self.pipelined = self.async_scheduling and bool(pipelined) and core.can_pipeline
        strategy = PipelinedSteps if self.pipelined else OverlappedSteps if self.async_scheduling else SerialSteps
        self._steps = strategy(core, executor)
        self._connector: KVConnector | None = None  # a KV connector this engine opened (and closes)
        self._publisher: KVEventSink | None = None  # KV events, when cache.kv_events_endpoint is set
        self._facts = ModelFacts(max_model_len=core.max_model_len, vocab_size=core.vocab_size)
        self._inputs = InputProcessor(self._facts, core.tokenizer)
        if core.kv_connector is not None:
            core.kv_connector.set_wakeup(self.wakeup)

    @classmethod
    async def start(
        cls, config: EngineConfig, *, runner: ModelRunnerLike | None = None,
        connector: KVConnector | None = None, kv_events: KVEventSink | None = None,
    ) -> AsyncEngine:
        """Build the engine off the loop (model loading blocks) and start its loop.

        ``runner`` replaces the runner the config names (tests, benchmarks).
        ``connector`` replaces the KV connector ``config.kv_transfer`` names;
        a connector the engine opens itself (on this loop: its store belongs
        to it) is closed by ``aclose``. ``kv_events`` receives each step's
        KV cache events and is closed by ``aclose``; it is required when
        ``cache.kv_events_endpoint`` is set (``kvstrata.ipc.engines.open_engine``
        builds it).
        """
        config.validate()
        if kv_events is None and (config.cache.kv_events_endpoint is not None or config.cache.enable_kv_events):
            field = "kv_events_endpoint" if config.cache.kv_events_endpoint is not None else "enable_kv_events"
            raise ValueError(f"cache.{field}: start the engine with a KV events sink "
                             "(kvstrata.ipc.engines.open_engine builds the ZMQ publisher; the engine "
                             "subprocess its clients' feed)")
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
        engine._publisher = kv_events
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

    @property
    def num_overlapped_steps(self) -> int:
        """Steps scheduled while the one before them ran (async scheduling)."""
        return self._steps.num_overlapped

    # -- model facts (EngineClient) -----------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self._core.config

    @property
    def model_name(self) -> str:
        return served_model_name(self._core.config)

    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len

    def chat(self, messages: Sequence[object], params: SamplingParams | None = None,
             **kwargs: Unpack[GenerateOptions]) -> AsyncGenerator[RequestOutput, None]:
        return generate_chat(self, messages, params, **kwargs)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._core.tokenizer

    def kv_snapshot(self) -> KVEventBatch:
        """Every cache's content now (``EngineCore.kv_snapshot_events``), on
        the loop: consistent with the KV events published so far plus the
        ones the next publish carries (replaying those changes nothing)."""
        return KVEventBatch(ts=time.time(), events=self._core.kv_snapshot_events())

    @property
    def identity(self) -> CacheIdentity:
        """The cache identity every block hash of this engine is rooted in."""
        return self._core.identity

    @property
    def facts(self) -> ModelFacts:
        """What a client must know to check its requests (the handshake sends it)."""
        return self._facts

    @property
    def is_dead(self) -> bool:
        return self._dead is not None or self._closing

    async def is_healthy(self) -> bool:
        return (await self.check_health()).healthy

    async def check_health(self) -> EngineHealth:
        return self.health_now()

    def load_now(self) -> EngineLoad:
        """The work queued in the scheduler now (``EngineLoad``), for callers
        on the engine's loop (the ZMQ server's load reports to routers)."""
        self._check_alive()
        return self._core.scheduler.load()

    def health_now(self) -> EngineHealth:
        """``check_health`` for callers on the engine's loop (the ZMQ server)."""
        self._check_alive()
        n = self._core.scheduler.num_unfinished
        if n == 0:
            return EngineHealth(healthy=True, status="ok")
        since = time.monotonic() - self._progress_at
        if since > self._stall_timeout_s:
            return EngineHealth(healthy=False, status="stalled", num_unfinished=n, seconds_since_progress=since,
                                reason=f"{n} requests queued and no progress for {since:.1f} s "
                                       f"(scheduler.stall_timeout_s={self._stall_timeout_s})")
        return EngineHealth(healthy=True, status="ok", num_unfinished=n, seconds_since_progress=since)

    # -- the in-process client ----------------------------------------------
    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        session_key: str | None = None,  # for a fleet's routing (EngineClient): one engine ignores it
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's deltas; the last one has ``finished=True``.

        Bad input raises RequestError before anything is queued; a full
        waiting queue raises EngineOverloadedError.
        """
        self._check_alive()
        req = await self._inputs.process(prompt, params, request_id=request_id, priority=priority,
                                         cache_salt=cache_salt, lora_name=lora_name)
        rid = req.request_id
        outputs = OutputProcessor(self._core.tokenizer, req)
        stream = _Stream(asyncio.get_running_loop())
        sink = stream.put
        self.submit(req, sink)
        try:
            while True:
                for item in await stream.take():
                    if isinstance(item, BaseException):
                        raise item
                    out = outputs.process(item)
                    yield out
                    if out.finished:
                        return
        finally:
            # Still live in the engine: the consumer left, or a stop string ended the stream.
            if self._sinks.get(rid) is sink:
                del self._sinks[rid]
                self._abort_now(rid)

    # -- the engine side ----------------------------------------------------
    def submit(self, req: EngineRequest, sink: OutputSink) -> None:
        """Queue a checked request (``kvstrata.enginecore.processing``) whose
        token-id outputs go to ``sink``.

        For transports that batch a step's outputs themselves (the ZMQ
        engine server): every output of one step reaches its sink within the
        same loop iteration, with no task per request. Raises RequestError
        (a live duplicate id) or EngineOverloadedError before anything is queued.
        """
        self._check_alive()
        self._core.add_request(req)
        self._sinks[req.request_id] = sink
        self._wakeup.set()

    def wakeup(self) -> None:
        """Something the engine may be waiting for happened (a KV load landed,
        a save, lookup or store write finished): step again. Thread-safe;
        the KV connector calls it."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to wake
            self._loop.call_soon_threadsafe(self._wakeup.set)

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
        write reached every tier of the connector's store. Looks again after
        each engine step or wake-up, never polls."""
        self._check_alive()
        s = self._core.scheduler
        async with asyncio.timeout(timeout_s):
            while s.has_pending_transfers():
                waiter: asyncio.Future[None] = self._loop.create_future()
                self._step_waiters.append(waiter)
                await waiter
                self._check_alive()
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
                released = self._shutdown()
                try:
                    await self._close_kv()
                finally:
                    if released is not None:  # the graphs gone before close returns (a step thread stuck
                        with contextlib.suppress(Exception):  # in a dead device: not waited for long)
                            await asyncio.wait_for(asyncio.wrap_future(released), RELEASE_WAIT_S)

    async def _close_kv(self) -> None:
        connector, self._connector = self._connector, None
        publisher, self._publisher = self._publisher, None
        try:
            if connector is not None:
                await connector.aclose()
        finally:
            if publisher is not None:
                await publisher.aclose()

    # -- internals --------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead), cause=self._dead.cause)
        if self._closing:
            raise EngineDeadError("engine is closed")

    def _abort_now(self, request_id: str) -> None:
        self._deliver(self._core.abort_requests([request_id]))
        self._wakeup.set()  # freed blocks may let a waiting request in

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        sinks = self._sinks
        for out in outputs:
            sink = sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del sinks[out.request_id]
            sink(out)

    def _looked_again(self) -> None:
        """Wake whoever waits for the loop to look at the state again (flush_kv):
        it does after every step and every wake-up."""
        waiters, self._step_waiters = self._step_waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def _run(self) -> None:
        """The engine loop: take the next step (queued behind the last one, or
        scheduled now, or sleep until woken), let the stepping strategy queue
        the one after it (``OverlappedSteps``), apply its output; a step that
        raises goes to ``_recover``."""
        steps = self._steps
        polled = False  # the last step computed no token: a bare poll now waits for a wake-up
        try:
            while not self._closing or steps.queued is not None:
                step = steps.take_queued()
                if step is not None:
                    self._looked_again()
                else:
                    step = await self._next_step(polled)
                    if step is None:
                        continue  # slept until woken
                so, fut = step
                steps.after(so, more=not self._closing)
                try:
                    out = await fut
                except Exception as exc:
                    await self._recover(so, exc, steps.take_queued())
                    continue
                self._deliver(self._core.update(so, out))
                if self._publisher is not None:
                    self._publish_events()
                # Let the consumers take this step's outputs (their text work)
                # before the next step: not while a step holds the GIL.
                await asyncio.sleep(0)
                polled = not so.total_num_scheduled_tokens
                if not polled:
                    self._progress_at = time.monotonic()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a broken model or an engine bug: fail everyone fast
            self._die(exc)
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt, SystemExit: fail fast, then let them through
        finally:
            self._looked_again()

    async def _next_step(self, polled: bool) -> Step | None:
        """Schedule a step and hand it to the step thread; None after sleeping
        until woken (no work, or only a bare poll that nothing asked for)."""
        core, wake = self._core, self._wakeup
        woken = wake.is_set()
        # Cleared before looking at the state: anything that happens from
        # here on sets it again, so a sleep below cannot miss it.
        wake.clear()
        self._looked_again()
        if not core.has_work():
            await wake.wait()
            self._progress_at = time.monotonic()  # idle until now: not a stall
            return None
        so = core.schedule()
        if not core.should_execute(so) or (polled and not woken and _bare_poll(so)):
            await wake.wait()  # only a transfer completing can change anything now
            return None
        return so, self._steps.submit(so)

    async def _recover(self, so: SchedulerOutput, exc: Exception, queued: Step | None) -> None:
        """Step ``so`` raised: fail its requests. A step queued behind it may
        have read its KV: its requests that ``so`` also ran are failed already
        (their output is dropped), ones it admitted on cached KV that ``so``
        wrote are failed too, and its own failure is not counted against the
        model. After ``MAX_CONSECUTIVE_STEP_FAILURES`` in a row the engine dies."""
        core = self._core
        written = core.blocks_written_by(so) if queued is not None else set()
        self._deliver(core.fail_step(so, exc))
        if queued is not None:
            nxt, nfut = queued
            self._steps.after(nxt, more=False)
            try:
                nout = await nfut
            except Exception as nexc:
                self._deliver(core.fail_step(nxt, nexc, secondary=True))
            else:
                self._deliver(core.fail_requests(
                    core.readers_of(nxt, written),
                    f"a model step it depended on failed: {type(exc).__name__}: {exc}"))
                self._deliver(core.update(nxt, nout))
        if core.consecutive_failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineDeadError(
                f"{core.consecutive_failed_steps} model steps failed in a row", cause=exc
            ) from exc

    def _publish_events(self) -> None:
        events = self._core.take_kv_events()
        if events and self._publisher is not None:
            self._publisher.publish(KVEventBatch(ts=time.time(), events=events))

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

    def _shutdown(self) -> Future | None:
        """End every request and the step thread; returns the step thread's
        last job (the runner lets go of its graphs), or None where it could
        not be queued."""
        if self._dead is None:
            self._deliver(self._core.abort_requests(list(self._core.scheduler.requests)))
            self._dead = EngineDeadError("engine is closed")
        self._end_sinks(self._dead)
        self._looked_again()
        released = None
        with contextlib.suppress(RuntimeError):  # an executor already shut down (interpreter exit)
            released = self._executor.submit(self._core.release_device)  # after the last step
        self._executor.shutdown(wait=False)
        log.info("engine_closed")
        return released


def _bare_poll(so: SchedulerOutput) -> bool:
    """``so`` only asks the runner whether KV transfers finished: no token,
    nothing to drop, no new transfer to start."""
    return not (so.total_num_scheduled_tokens or so.finished_req_ids or so.preempted_req_ids
                or so.kv_connector_metadata is not None)


def run(main: Coroutine[Any, Any, _T]) -> _T:  # Any: the coroutine's yield and send types, as asyncio.run's
    """Run ``main`` to completion on uvloop when it is installed, else asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
