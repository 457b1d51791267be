"""Bad replicas do not take the fleet down: an unreachable address, one that
answers garbage, one that runs another model. Each is kept out with a reason
that names it; the fleet serves with the replicas it has."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig
from kvstrata.errors import EngineDeadError
from kvstrata.fleet import FleetClient, Replica, local_connector, remote_connector
from kvstrata.ipc.addresses import make_address
from kvstrata.types import SamplingParams

CACHE = CacheConfig(block_size=4, num_blocks=64)


def tiny(seed: int = 0) -> EngineConfig:
    return EngineConfig(device="cpu", log_level="WARNING", cache=CACHE,
                        model=ModelConfig(num_threads=1, max_model_len=128, seed=seed))


async def test_no_reachable_replica_is_a_clear_error_naming_each():
    a, b = make_address("ipc"), make_address("ipc")
    try:
        replicas = [Replica("a", "remote", remote_connector(a.url, timeout_s=0.5), address=a.url),
                    Replica("b", "remote", remote_connector(b.url, timeout_s=0.5), address=b.url)]
        with pytest.raises(EngineDeadError, match="no engine replica could be reached") as e:
            await FleetClient.start(replicas, retry_interval_s=0.1)
        assert "a: EngineDeadError" in str(e.value) and "b: EngineDeadError" in str(e.value)
    finally:
        a.cleanup()
        b.cleanup()


async def test_garbage_and_another_model_are_kept_out_while_the_good_replica_serves():
    garbage_addr = make_address("ipc")
    ctx = zmq.asyncio.Context()
    garbage = ctx.socket(zmq.ROUTER)
    garbage.bind(garbage_addr.url)

    async def answer_garbage() -> None:
        while True:
            ident, *_ = await garbage.recv_multipart()
            await garbage.send_multipart([ident, b"\xc1not msgpack"])

    task = asyncio.create_task(answer_garbage())
    fleet = None
    try:
        replicas = [Replica("good", "local", local_connector(tiny())),
                    Replica("garbage", "remote", remote_connector(garbage_addr.url, timeout_s=1.0),
                            address=garbage_addr.url)]
        fleet = await FleetClient.start(replicas, retry_interval_s=0.5, grace_s=30.0)
        # The first replica up sets the fleet's model; another model joining later is refused.
        fleet.add_replica(Replica("other-model", "local", local_connector(tiny(seed=7))))
        async with asyncio.timeout(120):  # each bad one has failed at least once (engine starts are slow on a busy host)
            while not all(fleet.replicas[n].last_error for n in ("garbage", "other-model")):
                await asyncio.sleep(0.05)
        status = fleet.fleet_status()["replicas"]
        assert status["good"]["up"] and not status["garbage"]["up"] and not status["other-model"]["up"]
        assert "did not answer the handshake" in status["garbage"]["last_error"]
        assert "cache identity" in status["other-model"]["last_error"]
        outs = [o async for o in fleet.generate([1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=3))]
        assert sum(len(o.new_token_ids) for o in outs) == 3
        assert fleet.counters.routed == {"good": 1, "garbage": 0, "other-model": 0}
    finally:
        if fleet is not None:
            await fleet.aclose()
        task.cancel()
        garbage.close(0)
        ctx.term()
        garbage_addr.cleanup()


async def test_a_bad_request_is_a_request_error_and_the_fleet_keeps_serving():
    from kvstrata.errors import RequestError

    fleet = await FleetClient.start([Replica("a", "local", local_connector(tiny()))])
    try:
        with pytest.raises(RequestError, match="prompt"):
            [o async for o in fleet.generate([1, 2, 10**9], SamplingParams(max_tokens=2))]
        assert fleet.counters.routed == {"a": 0}
        outs = [o async for o in fleet.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2))]
        assert outs[-1].finished
    finally:
        await fleet.aclose()


async def test_a_replica_that_never_caches_a_prompt_is_not_credited_with_it_after_the_request():
    """The router credits a replica with a prompt's blocks when it sends the
    request there; an engine that never reports them (prefix caching off
    here; an abort before prefill elsewhere) must not keep that credit once
    the request is over, or every later request with that prefix would be
    sent there for hits that do not exist."""
    from kvstrata.config import CacheConfig

    cfg = tiny()
    cfg = EngineConfig(device=cfg.device, log_level=cfg.log_level, model=cfg.model,
                       cache=CacheConfig(block_size=4, num_blocks=64, enable_prefix_caching=False))
    fleet = await FleetClient.start([Replica("a", "local", local_connector(cfg))])
    try:
        prompt = list(range(1, 18))  # 4 full blocks
        gen = fleet.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3))
        first = await gen.__anext__()
        assert first.new_token_ids
        index = fleet.router.index
        assert len(index.provisional("a")) == 4  # credited while in flight
        outs = [first] + [o async for o in gen]
        assert outs[-1].finished
        assert index.provisional("a") == frozenset() and index.held("a", "GPU") == frozenset()
        assert len(index) == 0 and index.counters.withdrawn == 4
        d = fleet.router.choose(fleet.router.hash_prompt(prompt), num_tokens=len(prompt))
        assert d.hit_tokens == 0
    finally:
        await fleet.aclose()
