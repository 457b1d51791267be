"""FleetClient: one ``EngineClient`` over N engine replicas, routed by
``kvstrata.router`` (KV-cache-aware by default).

    fleet = await FleetClient.start([Replica("engine-0", "local", local_connector(config)), ...])
    async for out in fleet.generate("Hello", SamplingParams(max_tokens=8)): ...

Per request, on the server's loop: tokenize and check once, for every
replica (the replicas share one model: the first replica up sets the
fleet's cache identity, and a replica whose identity differs is refused),
``Router.choose`` over the prompt's lazily hashed chain (``Router.chain``:
only as many blocks as some live replica still holds), finish the chain
after the decision, apply the decision (the router's credit and load, the
replica's in-flight request), and stream from that replica. The finished
chain goes with the request (``EngineRequest.block_hashes``), so the engine
does not hash the prompt again (one hash pass per request; never with a
blend, whose salt only the engine adds). The router's index is fed by
every replica's KV events, which arrive over the replica's own engine
socket (``MPEngineClient.subscribe_kv_events``): each batch is numbered, so
a gap is seen and replayed from the engine's ring (or, when the ring no
longer holds it, rebuilt from a snapshot of the engine's caches,
``kv_snapshot``, then followed from there); a replica that restarted has a
new epoch, and its old blocks are dropped from the index before any of its
new ones count. A replica's load, for the router, is its engine's last
``LoadReport`` (the work every router sent there) plus this fleet's
requests the engine had not taken in yet (``Replica.load``).

State: each ``Replica`` is the one writer of its own state (connection,
liveness, in-flight requests); the fleet calls its methods and pushes what
they report changed to the router, whose live set is only a copy.

Failures: a replica whose engine dies (process exit, disconnect, EngineDead)
is marked down at once when a request or its client sees it
(``MPEngineClient.on_dead``; the supervisor's look every
``check_interval_s`` is a safety net): no request is routed to it after
that, and bringing it back starts at once. A request that had not
streamed anything when its replica died is sent again to another replica
(at most ``max_attempts`` replicas); one that had streamed tokens ends with
``EngineDeadError`` naming the replica (its tokens cannot be taken back).
Local replicas are restarted and remote ones reconnected (every
``retry_interval_s``); a replica that answers with garbage (protocol
errors, another model) is kept out, with the reason logged and shown in
``fleet_status``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TYPE_CHECKING, Self, Unpack

import msgspec
import structlog

from kvstrata.config import EngineConfig
from kvstrata.enginecore.client import GenerateOptions, generate_chat
from kvstrata.enginecore.processing import InputProcessor
from kvstrata.errors import EngineDeadError
from kvstrata.fleet.feed import FeedCounters, KVFeed
from kvstrata.fleet.replica import Replica
from kvstrata.fleet.stats import FleetStats, fleet_totals
from kvstrata.ipc import protocol as P
from kvstrata.ipc.mp_client import MPEngineClient
from kvstrata.kv.hashing import CacheIdentity
from kvstrata.router import NoLiveReplicaError, ReplicaLoad, Router, RouterConfig
from kvstrata.text.prompts import Prompt
from kvstrata.text.tokenizer import Tokenizer
from kvstrata.types import EngineHealth, EngineStats, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from kvstrata.fleet.registry import EngineDirectory, EngineRecord

log = structlog.get_logger(__name__)

_CONNECT_ERRORS = (EngineDeadError, OSError, RuntimeError, ValueError, TimeoutError)


class FleetCounters(msgspec.Struct, kw_only=True):
    routed: dict[str, int] = msgspec.field(default_factory=dict)
    retries: int = 0
    failed_mid_stream: int = 0
    replica_deaths: int = 0
    replica_restarts: int = 0
    feed: FeedCounters = msgspec.field(default_factory=FeedCounters)  # written by the KVFeed


def _percentiles_us(ns: Sequence[int]) -> dict[str, float] | None:
    if not ns:
        return None
    s = sorted(ns)
    return {"p50": round(s[len(s) // 2] / 1e3, 1), "p99": round(s[min(len(s) - 1, int(0.99 * len(s)))] / 1e3, 1)}


class FleetClient:
    """Owns: the replicas (each the one writer of its own state), the router
    (index, loads, and a copy of the replicas' liveness pushed at each
    change), the input processor, the tasks bringing replicas back, the
    supervisor, the router's feed (``KVFeed``), the counters and the time
    hashing took after each decision."""


    def __init__(self, replicas: Sequence[Replica], router_config: RouterConfig | None = None, *,
                 check_interval_s: float = 0.25, retry_interval_s: float = 1.0, max_attempts: int = 3) -> None:
        names = [r.name for r in replicas]
        if not names:
            raise ValueError("a fleet needs at least one replica")
        if len(set(names)) != len(names):
            raise ValueError(f"replica names must be unique, got {names}")
        self._loop = asyncio.get_running_loop()
        self.replicas = {r.name: r for r in replicas}
        self._router_config = router_config or RouterConfig()
        if len(replicas) > self._router_config.max_replicas:
            raise ValueError(f"{len(replicas)} replicas exceed router max_replicas={self._router_config.max_replicas}")
        self.router: Router | None = None  # built from the first replica's cache identity
        self._identity: CacheIdentity | None = None
        self._inputs: InputProcessor | None = None
        self._config: EngineConfig | None = None
        self.check_interval_s = check_interval_s
        self.retry_interval_s = retry_interval_s
        self.max_attempts = max_attempts
        self.counters = FleetCounters(routed={n: 0 for n in names})
        self._feed: KVFeed | None = None  # with the router
        self._finish_ns: deque[int] = deque(maxlen=4096)  # hashing the rest of a chain, after its decision
        self._bringing_back: dict[str, asyncio.Task[None]] = {}
        self._supervisor: asyncio.Task[None] | None = None
        self._follower: asyncio.Task[None] | None = None
        self._directory: EngineDirectory | None = None  # a registry being followed (closed with the fleet)
        self._closed = False

    # --- construction -----------------------------------------------------------

    @classmethod
    async def start(cls, replicas: Sequence[Replica], router_config: RouterConfig | None = None, *,
                    grace_s: float = 2.0, **kwargs: float) -> FleetClient:
        """Connect to (or start) every replica at once. Returns when every
        replica is live or has failed once (a connection still being checked
        counts as neither), or ``grace_s`` after the first one came up (the others keep trying in the background: an
        unreachable address does not hold the server back). Raises
        EngineDeadError naming each failure when every replica failed."""
        fleet = cls(replicas, router_config, **kwargs)
        for replica in fleet.replicas.values():
            fleet._bring_back_soon(replica)
        try:
            first_up = None
            while True:
                reps = fleet.replicas.values()
                tried = all(r.live or (r.num_attempts > 0 and r.client is None) for r in reps)
                if any(r.live for r in reps):
                    first_up = first_up or time.monotonic()
                    if tried or time.monotonic() - first_up >= grace_s:
                        break
                elif tried and all(r.num_attempts > 0 and r.client is None for r in reps):
                    reasons = "; ".join(f"{r.name}: {r.last_error}" for r in reps)
                    raise EngineDeadError(f"no engine replica could be reached ({reasons})")
                await asyncio.sleep(0.02)
        except BaseException:
            await fleet.aclose()
            raise
        fleet._supervisor = fleet._loop.create_task(fleet._supervise(), name="kvstrata-fleet-supervisor")
        log.info("fleet_started", replicas=[r.name for r in fleet.replicas.values() if r.live],
                 policy=fleet._router_config.policy,
                 waiting_for=[r.name for r in fleet.replicas.values() if not r.live])
        return fleet

    def _check_fits(self, client: MPEngineClient) -> None:
        """ValueError unless the replica's engine serves this fleet's model
        (the first one sets it, and builds the router)."""
        info = client.info
        assert info is not None
        identity = msgspec.convert(info.cache_identity, CacheIdentity)
        if not info.kv_events:
            raise ValueError("it runs without cache.enable_kv_events (the router could not see its cache)")
        if self._identity is None:
            self._identity = identity
            self.router = Router(identity, self._router_config)
            self._feed = KVFeed(self.router, self.replicas, self._push_load, self.counters.feed)
            for replica in self.replicas.values():
                self.router.reset_replica(replica.name, epoch=0)
                self._push_live(replica)
            self._inputs = InputProcessor(client.facts, client.tokenizer)
            self._config = client.config
        elif identity != self._identity:
            raise ValueError(f"its cache identity {identity} differs from the fleet's {self._identity} "
                             "(another model, block size, dtype or hash): its blocks could never be shared")
        elif client.facts.vocab_size != self._inputs.facts.vocab_size:  # type: ignore[union-attr]
            raise ValueError("its vocabulary differs from the fleet's")

    async def _attach(self, replica: Replica) -> bool:
        """A replica's connection is up: check it serves our model, register
        its epoch with the router, subscribe to its KV events, then mark it
        live. False (and the replica closed) when it does not fit this fleet."""
        client = replica.client
        assert client is not None and client.info is not None
        try:
            self._check_fits(client)
        except (ValueError, msgspec.ValidationError) as e:
            log.error("fleet_replica_refused", replica=replica.name, address=replica.address, reason=str(e))
            refused = replica.drop(f"refused: {e}")
            if refused is not None:
                await refused.aclose()
            return False
        router = self.router
        assert router is not None
        if router.index.epoch(replica.name) != replica.epoch:
            router.reset_replica(replica.name, replica.epoch)  # a new engine: its old blocks are gone
            self._push_live(replica)  # reset_replica made it live there; it is not, yet
        router.set_load(replica.name, ReplicaLoad())
        await self._feed.subscribe(replica)
        if replica.mark_live():
            self._push_live(replica)
        client.on_dead(lambda reason: self._lost(replica, reason, client))  # pushed: no request needs to see it
        log.info("fleet_replica_up", replica=replica.name, address=replica.address, epoch=replica.epoch,
                 pid=client.info.pid)
        return True

    # --- the EngineClient API ---------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        assert self._config is not None
        return self._config

    @property
    def model_name(self) -> str:
        from kvstrata.enginecore.client import served_model_name

        return served_model_name(self.config)

    @property
    def max_model_len(self) -> int:
        assert self._inputs is not None
        return self._inputs.facts.max_model_len

    @property
    def tokenizer(self) -> Tokenizer | None:
        assert self._inputs is not None
        return self._inputs.tokenizer

    @property
    def is_dead(self) -> bool:
        """Only when closed: a fleet with every replica down keeps trying to
        bring them back (requests meanwhile get EngineDeadError)."""
        return self._closed

    @property
    def _decision_ns(self) -> deque[int]:
        """Each routing decision's whole time (``Router.decision_ns``: the
        lazy walk's hashing included), for the tools."""
        return self.router.decision_ns if self.router is not None else deque()

    def chat(self, messages: Sequence[object], params: SamplingParams | None = None,
             **kwargs: Unpack[GenerateOptions]) -> AsyncGenerator[RequestOutput, None]:
        return generate_chat(self, messages, params, **kwargs)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *,
                       request_id: str | None = None, priority: int = 0, cache_salt: str | None = None,
                       lora_name: str | None = None,
                       session_key: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        if self._closed:
            raise EngineDeadError("fleet client is closed")
        assert self._inputs is not None and self.router is not None
        req = await self._inputs.process(prompt, params, request_id=request_id or uuid.uuid4().hex,
                                         priority=priority, cache_salt=cache_salt, lora_name=lora_name)
        rid, ids, router = req.request_id, req.prompt_token_ids, self.router
        chain = router.chain(ids, lora_name=lora_name, cache_salt=cache_salt, session=session_key)
        sent = None  # the request as sent: with the finished chain, unless it blends
        tried: list[str] = []
        last_error: EngineDeadError | None = None
        while len(tried) < self.max_attempts:
            try:
                decision = router.choose(chain, session_key, num_tokens=len(ids))
            except NoLiveReplicaError as e:
                raise EngineDeadError(f"no live engine replica: {e}"
                                      + (f"; last failure: {last_error}" if last_error else "")) from None
            replica = self.replicas[decision.replica]
            assert replica.live, decision  # the router's live set is the replicas', pushed
            lost = replica.connection_lost()
            if lost is not None:  # seen dead, its push (on_dead) not run yet: not a try
                self._lost(replica, lost)
                continue
            if sent is None:
                t0 = time.perf_counter_ns()
                hashes = chain.finish()
                self._finish_ns.append(time.perf_counter_ns() - t0)
                sent = req if req.sampling_params.blend is not None else msgspec.structs.replace(
                    req, block_hashes=hashes)
            tried.append(replica.name)
            router.note_dispatched(decision, len(ids), chain, key=rid)  # credited while in flight
            replica.dispatched(rid, len(ids) - decision.hit_tokens)
            self.counters.routed[replica.name] += 1
            streamed = False
            client = replica.client
            assert client is not None
            agen = client.generate_request(sent)
            try:
                async for out in agen:
                    if replica.prefill_started(rid):
                        self._push_load(replica)
                    streamed = True
                    yield out
                return
            except EngineDeadError as e:
                last_error = e
                self._lost(replica, str(e), client)
                if streamed:
                    self.counters.failed_mid_stream += 1
                    raise EngineDeadError(f"engine replica {replica.name} died while streaming request "
                                          f"{rid}: {e}") from None
                self.counters.retries += 1
                log.warning("fleet_request_retried", request_id=rid, replica=replica.name, error=str(e))
            finally:
                await agen.aclose()
                router.note_settled(replica.name, rid)  # what its events did not confirm is withdrawn
                replica.settled(rid)
                if replica.live:
                    self._push_load(replica)
        raise EngineDeadError(f"request {rid} failed on replicas {tried}: {last_error}")

    def _push_load(self, replica: Replica) -> None:
        assert self.router is not None
        self.router.set_load(replica.name, replica.load())

    def _push_live(self, replica: Replica) -> None:
        """Copy a replica's liveness to the router (after every change)."""
        router = self.router
        if router is None or replica.name not in router.index.replicas:
            return
        if replica.live:
            router.mark_alive(replica.name)
        else:
            router.mark_dead(replica.name)

    async def abort(self, request_id: str) -> None:
        for replica in self.replicas.values():
            if replica.live:
                await replica.client.abort(request_id)  # type: ignore[union-attr]

    async def fleet_stats(self) -> FleetStats:
        """Every live replica's stats, their fleet totals (counters summed,
        ratios recomputed: ``fleet.stats``) and which replicas serve."""
        ups = [r for r in self.replicas.values() if r.live]
        parts = await asyncio.gather(*(r.client.stats() for r in ups), return_exceptions=True)  # type: ignore[union-attr]
        good = {r.name: p for r, p in zip(ups, parts) if isinstance(p, EngineStats)}
        return FleetStats(totals=fleet_totals(good) if good else None, replicas=good,
                          up={n: r.live for n, r in self.replicas.items()})

    async def stats(self) -> EngineStats:
        """The fleet's totals (``fleet_stats().totals``); EngineDeadError when no replica answers."""
        totals = (await self.fleet_stats()).totals
        if totals is None:
            raise EngineDeadError("no live engine replica answered stats")
        return totals

    async def reset_prefix_cache(self) -> bool:
        ups = [r for r in self.replicas.values() if r.live]
        done = await asyncio.gather(*(r.client.reset_prefix_cache() for r in ups))  # type: ignore[union-attr]
        return all(done)

    async def flush_kv(self, timeout_s: float = 60.0) -> None:
        await asyncio.gather(*(r.client.flush_kv(timeout_s) for r in self.replicas.values() if r.live))  # type: ignore[union-attr]

    async def is_healthy(self) -> bool:
        return (await self.check_health()).healthy

    async def check_health(self) -> EngineHealth:
        """"ok" when every replica serves; "degraded" (still healthy) when
        some do, naming the others in ``replicas_down``; with none serving,
        "stalled" when a connected one is, "starting" while one is being
        connected or a local one started, else "dead"."""
        if self._closed:
            raise EngineDeadError("fleet client is closed")
        ups = [r for r in self.replicas.values() if r.live]
        results = await asyncio.gather(*(r.client.check_health() for r in ups), return_exceptions=True)  # type: ignore[union-attr]
        answers = [h for h in results if isinstance(h, EngineHealth)]
        healthy = {r.name for r, h in zip(ups, results) if isinstance(h, EngineHealth) and h.healthy}
        down = tuple(n for n in self.replicas if n not in healthy)
        reason = f"replicas not serving: {', '.join(down)}" if down else None
        unfinished = sum(h.num_unfinished for h in answers)
        if healthy:
            return EngineHealth(healthy=True, status="degraded" if down else "ok", reason=reason,
                                num_unfinished=unfinished, replicas_down=down)
        if any(h.status == "stalled" for h in answers):
            status = "stalled"
        elif any(r.client is not None or (r.kind == "local" and self._bringing(r.name))
                 for r in self.replicas.values()):
            status = "starting"
        else:
            status = "dead"
        since = max((h.seconds_since_progress for h in answers), default=0.0)
        return EngineHealth(healthy=False, status=status, reason=reason, seconds_since_progress=since,
                            num_unfinished=unfinished, replicas_down=down)

    def fleet_status(self) -> dict[str, object]:  # JSON for GET /fleet
        """Per replica: live, address, epoch, load, routed count, last error;
        the router's decision time (the whole ``choose``, lazy hashing
        included), the hashing that finishes a chain after its decision,
        and the index counters."""
        router = self.router
        return {
            "policy": self._router_config.policy,
            "replicas": {
                r.name: {"up": r.live, "kind": r.kind, "address": r.address, "epoch": r.epoch,
                         "queued_prefill_tokens": r.queued_prefill, "running_requests": r.running,
                         "engine_load": msgspec.to_builtins(r.engine_load) if r.engine_load else None,
                         "routed": self.counters.routed[r.name], "starts": r.num_starts, "last_error": r.last_error}
                for r in self.replicas.values()},
            "counters": msgspec.to_builtins(self.counters),
            "index": msgspec.to_builtins(router.index.counters) if router else None,
            "index_blocks": len(router.index) if router else 0,
            "decision_us": _percentiles_us(self._decision_ns),
            "hash_after_decision_us": _percentiles_us(self._finish_ns),
        }

    # --- membership changes -----------------------------------------------------------

    def add_replica(self, replica: Replica) -> None:
        """A new replica joins: registered dead with the router until its
        connection is up (bringing it up starts now)."""
        if replica.name in self.replicas:
            raise ValueError(f"replica {replica.name!r} is already in the fleet")
        if self.router is not None and len(self.router.index.replicas) >= self._router_config.max_replicas:
            raise ValueError(f"replica {replica.name!r}: the router's max_replicas "
                             f"({self._router_config.max_replicas}) are registered")
        self.replicas[replica.name] = replica
        self.counters.routed.setdefault(replica.name, 0)
        if self.router is not None:
            self.router.reset_replica(replica.name, epoch=0)
            self._push_live(replica)
        self._bring_back_soon(replica)
        log.info("fleet_replica_added", replica=replica.name, address=replica.address)

    async def remove_replica(self, name: str) -> None:
        """A replica leaves: nothing more is routed to it, its blocks leave
        the index, its connection is closed (requests in flight there end
        with EngineDeadError, or are retried when they had not streamed)."""
        replica = self.replicas.pop(name, None)
        if replica is None:
            return
        task = self._bringing_back.pop(name, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self.router is not None:
            self.router.remove_replica(name)
        await replica.close()
        log.info("fleet_replica_removed", replica=name, address=replica.address)

    def follow(self, directory: EngineDirectory, make_replica: Callable[[EngineRecord], Replica], *,
               interval_s: float | None = None) -> None:
        """Follow a registry (``fleet.registry.EngineDirectory``): engines that
        register join, ones whose key expires or is deleted leave, one that
        re-registers at another address is replaced. Changes arrive as the
        registry announces them; ``interval_s`` paces the directory's full
        re-read, the safety net (None: the registry's ``scan_interval_s``). ``make_replica(record)`` builds the Replica
        of a record. The directory is closed with the fleet."""
        self._directory = directory

        async def run() -> None:
            async for diff in directory.watch(interval_s):
                for name, record in diff.removed.items():
                    await self.remove_replica(name)
                for name, record in {**diff.added, **diff.changed_epoch}.items():
                    current = self.replicas.get(name)
                    if current is not None and current.address == record.address:
                        continue  # the supervisor reconnects it and sees the new epoch
                    if current is not None:
                        await self.remove_replica(name)
                    try:
                        self.add_replica(make_replica(record))
                    except ValueError as e:
                        log.error("fleet_registry_member_refused", replica=name, error=str(e))

        self._follower = self._loop.create_task(run(), name="kvstrata-fleet-registry")

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = [t for t in (self._follower, self._supervisor, *self._bringing_back.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._bringing_back.clear()
        if self._directory is not None:
            await self._directory.aclose()
        await asyncio.gather(*(r.close() for r in self.replicas.values()), return_exceptions=True)
        log.info("fleet_closed")

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # --- supervision --------------------------------------------------------------

    def _lost(self, replica: Replica, reason: str, client: MPEngineClient | None = None) -> None:
        """The replica stopped serving (over ``client``, when given): the
        router hears of it, and bringing it back starts."""
        if not replica.mark_down(reason, client):
            return
        self._push_live(replica)
        self.counters.replica_deaths += 1
        log.error("fleet_replica_down", replica=replica.name, address=replica.address, reason=reason)
        self._bring_back_soon(replica)

    def _bringing(self, name: str) -> bool:
        task = self._bringing_back.get(name)
        return task is not None and not task.done()

    def _bring_back_soon(self, replica: Replica) -> None:
        if not self._closed and not self._bringing(replica.name):
            self._bringing_back[replica.name] = self._loop.create_task(
                self._bring_back(replica), name=f"kvstrata-fleet-bring-back-{replica.name}")

    async def _supervise(self) -> None:
        """The safety net: a connection whose death its client's ``on_dead``
        did not report (every death is pushed from there as it is seen),
        and replicas whose bringing back ended without success."""
        while True:
            await asyncio.sleep(self.check_interval_s)
            for replica in list(self.replicas.values()):
                reason = replica.connection_lost()
                if reason is not None:
                    self._lost(replica, reason)
                elif not replica.live:
                    self._bring_back_soon(replica)

    async def _bring_back(self, replica: Replica) -> None:
        """Restart a local replica / reconnect a remote one until it is up."""
        while not self._closed and not replica.live:
            old = replica.detach()
            if old is not None:
                await old.aclose()
            try:
                await replica.open()
                attached = await self._attach(replica)
            except _CONNECT_ERRORS as e:
                broken = replica.drop(f"{type(e).__name__}: {e}") if replica.client is not None else None
                if broken is not None:  # connected, then failed while being attached
                    await broken.aclose()
                log.warning("fleet_replica_unreachable", replica=replica.name, address=replica.address,
                            error=replica.last_error)
                await asyncio.sleep(self.retry_interval_s)
                continue
            if attached:
                if replica.num_starts > 1:
                    self.counters.replica_restarts += 1
                return
            await asyncio.sleep(self.retry_interval_s)
