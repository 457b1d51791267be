"""FleetClient: one ``EngineClient`` over N engine replicas, routed by
``kvstrata.router`` (KV-cache-aware by default).

    fleet = await FleetClient.start([Replica("engine-0", "local", local_connector(config)), ...])
    async for out in fleet.generate("Hello", SamplingParams(max_tokens=8)): ...

Per request, on the server's loop: tokenize and check once, for every
replica (the replicas share one model: the first replica up sets the
fleet's cache identity, and a replica whose identity differs is refused;
the replica's client sends the checked request as it is,
``MPEngineClient.generate_request``), hash the
prompt's blocks as the engines do, ``Router.choose`` (pure), apply the
decision (the replica's load), and stream from that replica. The router's
index is fed by every replica's KV events, which arrive over the replica's
own engine socket (``MPEngineClient.subscribe_kv_events``): each batch is
numbered, so a gap is seen and replayed from the engine's ring (or, when the
ring no longer holds it, rebuilt from a snapshot of the engine's caches,
``kv_snapshot``, then followed from there); a replica
that restarted has a new epoch, and its old blocks are dropped from the index
before any of its new ones count. A replica's load, for the router, is its
engine's last ``LoadReport`` (the work every router sent there) plus this
fleet's requests the engine had not taken in yet (``Replica.load``).

Failures: a replica whose engine dies (process exit, disconnect, EngineDead)
is marked dead in the router at once when a request sees it, and otherwise by
the supervisor within ``check_interval_s`` (0.25 s): no request is routed to
it after that. A request that had not streamed anything when its replica
died is sent again to another replica (at most ``max_attempts`` replicas);
one that had streamed tokens ends with ``EngineDeadError`` naming the replica
(its tokens cannot be taken back). The supervisor restarts local replicas and
reconnects remote ones (every ``retry_interval_s``); a replica that answers
with garbage (protocol errors, another model) is kept out, with the reason
logged and shown in ``fleet_status``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from functools import partial
from typing import Any, Self

import msgspec
import structlog

from kvstrata.config import EngineConfig
from kvstrata.enginecore.client import generate_chat
from kvstrata.enginecore.processing import InputProcessor
from kvstrata.errors import EngineDeadError, EngineOverloadedError, RequestError
from kvstrata.fleet.replica import Replica
from kvstrata.ipc import protocol as P
from kvstrata.kv.events import KVEventBatch, make_batch_decoder
from kvstrata.kv.hashing import CacheIdentity
from kvstrata.router import NoLiveReplicaError, ReplicaLoad, Router, RouterConfig
from kvstrata.text.prompts import Prompt
from kvstrata.text.tokenizer import Tokenizer
from kvstrata.types import EngineHealth, EngineStats, RequestOutput, SamplingParams

log = structlog.get_logger(__name__)


class FleetCounters(msgspec.Struct, kw_only=True):
    routed: dict[str, int] = msgspec.field(default_factory=dict)
    retries: int = 0
    failed_mid_stream: int = 0
    replica_deaths: int = 0
    replica_restarts: int = 0
    kv_batches: int = 0
    kv_replays: int = 0
    kv_snapshots: int = 0
    load_reports: int = 0  # engines' LoadReports applied


class FleetClient:
    """Owns: the replicas (their connections and in-flight accounting), the
    router (index, loads, liveness), the input processor, the supervisor
    task, the KV batch decoder and the counters."""

    takes_session_key = True  # the HTTP server passes the OpenAI ``user`` field as ``session_key``

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
        self._decode_batch = make_batch_decoder().decode
        self._replaying: set[str] = set()
        self._decision_ns: deque[int] = deque(maxlen=4096)
        self._supervisor: asyncio.Task[None] | None = None
        self._follower: asyncio.Task[None] | None = None
        self._directory: Any = None  # a registry EngineDirectory being followed (closed with the fleet)
        self._closed = False

    # --- construction -----------------------------------------------------------

    @classmethod
    async def start(cls, replicas: Sequence[Replica], router_config: RouterConfig | None = None, *,
                    grace_s: float = 2.0, **kwargs: Any) -> FleetClient:
        """Connect to (or start) every replica at once. Returns when every
        replica has answered or failed once, or ``grace_s`` after the first
        one came up (the others keep trying in the background: an
        unreachable address does not hold the server back). Raises
        EngineDeadError naming each failure when every replica failed."""
        fleet = cls(replicas, router_config, **kwargs)
        for replica in fleet.replicas.values():
            replica.restarting = fleet._loop.create_task(fleet._bring_back(replica))
        try:
            first_up = None
            while True:
                reps = fleet.replicas.values()
                tried = all(r.up or r.num_attempts > 0 for r in reps)
                live = fleet.router is not None and bool(fleet.router.live_replicas())
                if live:
                    first_up = first_up or time.monotonic()
                    if tried or time.monotonic() - first_up >= grace_s:
                        break
                elif tried and all(r.num_attempts > 0 and not r.up for r in reps):
                    reasons = "; ".join(f"{r.name}: {r.last_error}" for r in reps)
                    raise EngineDeadError(f"no engine replica could be reached ({reasons})")
                await asyncio.sleep(0.02)
        except BaseException:
            await fleet.aclose()
            raise
        fleet._supervisor = fleet._loop.create_task(fleet._supervise(), name="kvstrata-fleet-supervisor")
        log.info("fleet_started", replicas=fleet.router.live_replicas(), policy=fleet._router_config.policy,
                 waiting_for=[r.name for r in fleet.replicas.values() if not r.up])
        return fleet

    async def _attach(self, replica: Replica) -> bool:
        """A replica's connection is up: check it serves our model, register
        its epoch with the router, subscribe to its KV events. False (and
        the replica closed) when it does not fit this fleet."""
        client = replica.client
        assert client is not None and client.info is not None
        info = client.info
        try:
            identity = msgspec.convert(info.cache_identity, CacheIdentity)
            if not info.kv_events:
                raise ValueError("it runs without cache.enable_kv_events (the router could not see its cache)")
            if self._identity is None:
                self._identity = identity
                self.router = Router(identity, self._router_config)
                for name in self.replicas:
                    self.router.reset_replica(name, epoch=0)
                    self.router.mark_dead(name)
                self._inputs = InputProcessor(client.facts, client.tokenizer)
                self._config = client.config
            elif identity != self._identity:
                raise ValueError(f"its cache identity {identity} differs from the fleet's {self._identity} "
                                 "(another model, block size, dtype or hash): its blocks could never be shared")
            elif client.facts.vocab_size != self._inputs.facts.vocab_size:  # type: ignore[union-attr]
                raise ValueError("its vocabulary differs from the fleet's")
        except (ValueError, msgspec.ValidationError) as e:
            replica.last_error = f"refused: {e}"
            log.error("fleet_replica_refused", replica=replica.name, address=replica.address, reason=str(e))
            replica.client = None
            await client.aclose()
            return False
        router = self.router
        assert router is not None
        replica.queued_prefill = 0
        if router.index.epoch(replica.name) != replica.epoch:
            router.reset_replica(replica.name, replica.epoch)  # a new engine: its old blocks are gone
        else:
            router.mark_alive(replica.name)
            router.set_load(replica.name, ReplicaLoad())
        start = router.index.expected_seq(replica.name) or 0
        await self._subscribe(replica, start)
        log.info("fleet_replica_up", replica=replica.name, address=replica.address, epoch=replica.epoch,
                 pid=info.pid)
        return True

    async def _subscribe(self, replica: Replica, start_seq: int) -> None:
        client = replica.client
        assert client is not None and self.router is not None
        if start_seq < (await client.kv_position())["oldest_seq"]:
            # The engine's ring no longer holds what we missed: load a
            # snapshot of its caches, then follow the stream from there.
            snap = await client.kv_snapshot()
            if snap["epoch"] != replica.epoch:
                raise EngineDeadError(f"replica {replica.name} restarted during the snapshot")
            self.router.index.load_snapshot(replica.name, replica.epoch, snap["next_seq"],
                                            self._decode_batch(snap["payload"]))
            self.counters.kv_snapshots += 1
            log.info("fleet_kv_snapshot_loaded", replica=replica.name, wanted_seq=start_seq,
                     next_seq=snap["next_seq"])
            start_seq = snap["next_seq"]
        await client.subscribe_kv_events(partial(self._on_kv_events, replica.name, replica.epoch), start_seq,
                                         load_listener=partial(self._on_load, replica.name, replica.epoch))

    def _on_load(self, name: str, epoch: int, msg: P.LoadReport) -> None:
        """The engine's queued work (every router's requests): the router's
        load for that replica from now on (``Replica.load``)."""
        replica = self.replicas[name]
        if msg.epoch != epoch or replica.epoch != epoch or self.router is None:
            return
        replica.note_load(msg.load, msg.received)
        self.counters.load_reports += 1
        self._push_load(replica)

    # --- KV events ----------------------------------------------------------------

    def _on_kv_events(self, name: str, epoch: int, msg: P.KVEvents) -> None:
        router = self.router
        if router is None or msg.epoch != epoch:
            return
        try:
            batch = self._decode_batch(msg.payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.error("fleet_kv_events_undecodable", replica=name, seq=msg.seq, error=str(e))
            return
        res = router.ingest(name, msg.seq, batch, epoch=epoch)
        self.counters.kv_batches += 1
        if res.action == "gap" and name not in self._replaying:
            replica = self.replicas[name]
            self._replaying.add(name)
            self.counters.kv_replays += 1
            log.warning("fleet_kv_gap", replica=name, seq=msg.seq, expected_seq=res.expected_seq)
            task = self._loop.create_task(self._replay(replica, res.expected_seq or 0))
            task.add_done_callback(lambda _t, n=name: self._replaying.discard(n))

    async def _replay(self, replica: Replica, start_seq: int) -> None:
        try:
            if replica.up:
                await self._subscribe(replica, start_seq)
        except (EngineDeadError, RuntimeError) as e:
            log.warning("fleet_kv_replay_failed", replica=replica.name, error=str(e))

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

    def chat(self, messages: Sequence[Any], params: SamplingParams | None = None,
             **kwargs: Any) -> AsyncGenerator[RequestOutput, None]:
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
        ids = req.prompt_token_ids
        router = self.router
        t0 = time.perf_counter_ns()
        hashes = router.hash_prompt(ids, lora_name=lora_name, cache_salt=cache_salt)
        self._decision_ns.append(time.perf_counter_ns() - t0)
        tried: list[str] = []
        last_error: EngineDeadError | None = None
        while len(tried) < self.max_attempts:
            try:
                decision = router.choose(hashes, session_key, num_tokens=len(ids))
            except NoLiveReplicaError as e:
                raise EngineDeadError(f"no live engine replica: {e}"
                                      + (f"; last failure: {last_error}" if last_error else "")) from None
            replica = self.replicas[decision.replica]
            if decision.replica in tried or not replica.up:
                self._replica_down(replica, "seen dead at dispatch")
                tried.append(decision.replica)
                continue
            tried.append(decision.replica)
            uncached = max(len(ids) - decision.hit_tokens, 0)
            router.note_dispatched(decision, len(ids), hashes, key=req.request_id)  # credited while in flight
            replica.queued_prefill += uncached
            replica.inflight[req.request_id] = uncached
            self.counters.routed[replica.name] += 1
            streamed = False
            waiting = uncached
            agen = replica.client.generate_request(req)  # type: ignore[union-attr]
            try:
                async for out in agen:
                    if waiting:
                        replica.queued_prefill -= waiting
                        waiting = 0
                        self._push_load(replica)
                    streamed = True
                    yield out
                return
            except EngineDeadError as e:
                last_error = e
                self._replica_down(replica, str(e))
                if streamed:
                    self.counters.failed_mid_stream += 1
                    raise EngineDeadError(f"engine replica {replica.name} died while streaming request "
                                          f"{req.request_id}: {e}") from None
                self.counters.retries += 1
                log.warning("fleet_request_retried", request_id=req.request_id, replica=replica.name, error=str(e))
            finally:
                await agen.aclose()
                router.note_settled(replica.name, req.request_id)  # what its events did not confirm is withdrawn
                replica.inflight.pop(req.request_id, None)
                replica.queued_prefill -= waiting
                if replica.up:
                    self._push_load(replica)
        raise EngineDeadError(f"request {req.request_id} failed on replicas {tried}: {last_error}")

    def _push_load(self, replica: Replica) -> None:
        assert self.router is not None
        self.router.set_load(replica.name, replica.load())

    async def abort(self, request_id: str) -> None:
        for replica in self.replicas.values():
            if replica.up:
                await replica.client.abort(request_id)  # type: ignore[union-attr]

    async def stats(self) -> EngineStats:
        """The replicas' counters summed (numbers added, per-key in dicts)."""
        ups = [r for r in self.replicas.values() if r.up]
        if not ups:
            raise EngineDeadError("no live engine replica")
        parts = await asyncio.gather(*(r.client.stats() for r in ups), return_exceptions=True)  # type: ignore[union-attr]
        good = [msgspec.to_builtins(p) for p in parts if isinstance(p, EngineStats)]
        if not good:
            raise EngineDeadError(f"no replica answered stats: {parts}")
        return msgspec.convert(_sum_tree(good), EngineStats)

    async def reset_prefix_cache(self) -> bool:
        ups = [r for r in self.replicas.values() if r.up]
        done = await asyncio.gather(*(r.client.reset_prefix_cache() for r in ups))  # type: ignore[union-attr]
        return all(done)

    async def flush_kv(self, timeout_s: float = 60.0) -> None:
        await asyncio.gather(*(r.client.flush_kv(timeout_s) for r in self.replicas.values() if r.up))  # type: ignore[union-attr]

    async def is_healthy(self) -> bool:
        return (await self.check_health()).healthy

    async def check_health(self) -> EngineHealth:
        """Healthy while at least one replica serves; the reason lists the down ones."""
        if self._closed:
            raise EngineDeadError("fleet client is closed")
        ups = [r for r in self.replicas.values() if r.up]
        results = await asyncio.gather(*(r.client.check_health() for r in ups), return_exceptions=True)  # type: ignore[union-attr]
        healthy = [r.name for r, h in zip(ups, results) if isinstance(h, EngineHealth) and h.healthy]
        down = [n for n in self.replicas if n not in healthy]
        reason = f"replicas not serving: {', '.join(down)}" if down else None
        unfinished = sum(h.num_unfinished for h in results if isinstance(h, EngineHealth))
        return EngineHealth(healthy=bool(healthy), status="ok" if healthy else "stalled", reason=reason,
                            num_unfinished=unfinished)

    def fleet_status(self) -> dict[str, Any]:
        """Per replica: up, address, epoch, load, routed count, last error;
        the router's decision (hashing) latency and the index counters."""
        router = self.router
        ns = sorted(self._decision_ns)
        return {
            "policy": self._router_config.policy,
            "replicas": {
                r.name: {"up": r.up, "kind": r.kind, "address": r.address, "epoch": r.epoch,
                         "queued_prefill_tokens": r.queued_prefill, "running_requests": r.running,
                         "engine_load": msgspec.to_builtins(r.engine_load) if r.engine_load else None,
                         "routed": self.counters.routed[r.name], "starts": r.num_starts, "last_error": r.last_error}
                for r in self.replicas.values()},
            "counters": msgspec.to_builtins(self.counters),
            "index": msgspec.to_builtins(router.index.counters) if router else None,
            "index_blocks": len(router.index) if router else 0,
            "hash_us_p50": ns[len(ns) // 2] / 1e3 if ns else None,
        }

    # --- membership changes -----------------------------------------------------------

    def add_replica(self, replica: Replica) -> None:
        """A new replica joins: registered dead with the router until its
        connection is up (the supervisor brings it up)."""
        if replica.name in self.replicas:
            raise ValueError(f"replica {replica.name!r} is already in the fleet")
        if self.router is not None and len(self.router.index.replicas) >= self._router_config.max_replicas:
            raise ValueError(f"replica {replica.name!r}: the router's max_replicas "
                             f"({self._router_config.max_replicas}) are registered")
        self.replicas[replica.name] = replica
        self.counters.routed.setdefault(replica.name, 0)
        if self.router is not None:
            self.router.reset_replica(replica.name, epoch=0)
            self.router.mark_dead(replica.name)
        replica.restarting = self._loop.create_task(self._bring_back(replica))
        log.info("fleet_replica_added", replica=replica.name, address=replica.address)

    async def remove_replica(self, name: str) -> None:
        """A replica leaves: nothing more is routed to it, its blocks leave
        the index, its connection is closed (requests in flight there end
        with EngineDeadError, or are retried when they had not streamed)."""
        replica = self.replicas.pop(name, None)
        if replica is None:
            return
        if self.router is not None:
            self.router.remove_replica(name)
        await replica.close()
        log.info("fleet_replica_removed", replica=name, address=replica.address)

    def follow(self, directory: Any, make_replica: Any, *, interval_s: float = 0.5) -> None:
        """Follow a registry (``fleet.registry.EngineDirectory``): engines that
        register join, ones whose key expires or is deleted leave, one that
        re-registers at another address is replaced. ``make_replica(record)``
        builds the Replica of a record. The directory is closed with the fleet."""
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
        for task in (self._follower, self._supervisor):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._directory is not None:
            await self._directory.aclose()
        await asyncio.gather(*(r.close() for r in self.replicas.values()), return_exceptions=True)
        log.info("fleet_closed")

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # --- supervision --------------------------------------------------------------

    def _replica_down(self, replica: Replica, reason: str) -> None:
        router = self.router
        if router is None or replica.name not in router.live_replicas():
            return
        router.mark_dead(replica.name)
        self.counters.replica_deaths += 1
        replica.last_error = reason
        log.error("fleet_replica_down", replica=replica.name, address=replica.address, reason=reason)

    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval_s)
            for replica in self.replicas.values():
                if not replica.up:
                    self._replica_down(replica, replica.last_error or "engine connection lost")
                    if replica.restarting is None or replica.restarting.done():
                        replica.restarting = self._loop.create_task(self._bring_back(replica))

    async def _bring_back(self, replica: Replica) -> None:
        """Restart a local replica / reconnect a remote one until it is up."""
        old, replica.client = replica.client, None
        if old is not None:
            await old.aclose()
        while not self._closed:
            try:
                await replica.open()
            except (EngineDeadError, OSError, RuntimeError, ValueError, TimeoutError) as e:
                replica.num_attempts += 1
                replica.last_error = f"{type(e).__name__}: {e}"
                log.warning("fleet_replica_unreachable", replica=replica.name, address=replica.address,
                            error=replica.last_error)
                await asyncio.sleep(self.retry_interval_s)
                continue
            replica.num_attempts += 1
            if await self._attach(replica):
                if replica.num_starts > 1:
                    self.counters.replica_restarts += 1
                return
            await asyncio.sleep(self.retry_interval_s)


def _sum_tree(items: list[Any]) -> Any:
    first = items[0]
    if isinstance(first, bool) or first is None or isinstance(first, str):
        return first
    if isinstance(first, (int, float)):
        return sum(x for x in items if isinstance(x, (int, float)))
    if isinstance(first, dict):
        keys = {k for x in items if isinstance(x, dict) for k in x}
        return {k: _sum_tree([x[k] for x in items if isinstance(x, dict) and k in x]) for k in keys}
    return first
