"""The multi-connector (first child with a hit loads, every child saves, a
finished request's blocks wait for every child's save), events from every
tier over the real ZMQ publisher, and the per-request / per-tier metrics."""

from __future__ import annotations

import asyncio

import msgspec
import zmq
import zmq.asyncio
from conn_helpers import disk_tier, offload_config, prompt

from kvstrata.config import KVTransferConfig
from kvstrata.enginecore import SamplingParams
from kvstrata.kv.events import BlockRemoved, BlockStored, make_batch_decoder

N = 8


async def gen(engine, p, n=N) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=n)
    return [t async for out in engine.generate(p, params) for t in out.new_token_ids]


def multi(*children: KVTransferConfig) -> KVTransferConfig:
    return KVTransferConfig(connector="multi", options={"connectors": [msgspec.to_builtins(c) for c in children]})


async def test_multi_loads_from_the_first_child_with_a_hit(oracle, make_engine, tmp_path):
    local = offload_config()
    remote = offload_config(tiers=(disk_tier(tmp_path / "disk"),))
    engine = await make_engine(multi(local, remote))
    p = prompt(40, 60)  # 60 + 8 tokens: chunk 3 fills during decode, saved when the request finishes
    assert await gen(engine, p) == oracle.greedy(p, N)
    await engine.flush_kv()
    children = engine.core.kv_connector.children
    assert [c.store.stats().tier("cpu").num_objects for c in children] == [4, 4]
    assert await engine.reset_prefix_cache()
    assert await gen(engine, p) == oracle.greedy(p, N)
    stats = (await engine.stats()).extra
    assert stats["multi0.connector.cpu.hit_tokens"] == 48 and stats["multi1.connector.cpu.hit_tokens"] == 0
    await engine.flush_kv()
    for c in children:
        c.store.l1.clear()
    assert await engine.reset_prefix_cache()
    assert await gen(engine, p) == oracle.greedy(p, N)
    stats = (await engine.stats()).extra
    assert stats["multi1.connector.disk.hit_tokens"] == 48 and stats["multi0.connector.cpu.hit_tokens"] == 48


async def test_events_from_every_tier_over_zmq(oracle, make_engine, tmp_path, redis_server):
    from conn_helpers import redis_tier

    from kvstrata.config import CacheConfig, EngineConfig, ModelConfig
    from kvstrata.ipc.engines import start_async_engine

    kvt = offload_config(cpu_chunks=3, enable_events=True,
                         tiers=(disk_tier(tmp_path / "disk"), redis_tier(redis_server.port)))
    config = EngineConfig(model=ModelConfig(model=oracle.path), device="cpu", kv_transfer=kvt,
                          cache=CacheConfig(block_size=4, num_blocks=64, kv_events_endpoint="tcp://127.0.0.1:*"))
    engine = await start_async_engine(config)  # with the ZMQ publisher of its KV events
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(engine._publisher.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        await asyncio.sleep(0.2)  # the subscription reaches the publisher
        p, q = prompt(41, 50), prompt(42, 50)
        assert await gen(engine, p) == oracle.greedy(p, N)
        await engine.flush_kv()
        assert await gen(engine, q) == oracle.greedy(q, N)  # the small L1: q's chunks evict p's
        await engine.flush_kv()
        await gen(engine, [5, 6, 7])  # one more step publishes what the flush completed
        decode = make_batch_decoder().decode
        events = []
        while await sub.poll(300):
            _topic, _seq, payload = await sub.recv_multipart()
            events.extend(decode(payload).events)
    finally:
        sub.close(0)
        ctx.term()
        await engine.aclose()
    stored = {}
    for e in events:
        if isinstance(e, BlockStored):
            stored.setdefault(e.medium, []).append(e)
    assert set(stored) == {"GPU", "CPU", "DISK", "REMOTE"}
    first_chunk = stored["CPU"][0]
    assert first_chunk.token_ids == p[:16] and first_chunk.parent_block_hash is None
    assert len(first_chunk.block_hashes) == 4 and first_chunk.block_size == 4
    assert first_chunk.block_hashes == stored["GPU"][0].block_hashes[:4]  # the same vocabulary as the device
    assert [len(stored[m]) for m in ("CPU", "DISK", "REMOTE")] == [6, 6, 6]  # 3 chunks of p, 3 of q
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert {e.medium for e in removed} == {"CPU"}  # only L1 evicted; disk and Redis keep both prompts
    assert len(removed) == 3


async def test_per_request_and_per_tier_metrics(oracle, make_engine, tmp_path):
    engine = await make_engine(offload_config(tiers=(disk_tier(tmp_path / "disk"),)))
    p = prompt(43, 70)
    await gen(engine, p)
    await engine.flush_kv()
    assert await engine.reset_prefix_cache()
    await gen(engine, p)
    await engine.flush_kv()
    metrics = engine.core.kv_connector.metrics
    rec = metrics.requests[-1]
    assert rec.hit_tokens == 64 and rec.hit_tokens_by_tier == {"cpu": 64}
    assert rec.load_s > 0 and rec.saved_s_est >= 0
    extra = (await engine.stats()).extra
    assert extra["connector.cpu.hit_tokens"] == 64 and extra["connector.cpu.load_s"] == rec.load_s
    assert extra["connector.requests_with_hits"] == 1 and extra["connector.recompute_s_per_token"] > 0
    assert extra["store.disk.num_objects"] == 4 and extra["connector.saved_chunks"] == 4
