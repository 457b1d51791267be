"""Identical tokens (transformers' greedy fp32 Llama on the same weights)
whichever tier the prefix comes from, including when the tier fails, with
steps run serially or overlapped (async scheduling: step N+1's connector
metadata is built while step N runs)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conn_helpers import CHUNK, assert_stepped, disk_tier, offload_config, prompt

from kvstrata.enginecore import SamplingParams

N = 8


async def gen(engine, p, n=N, **kw) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=n)
    return [t async for out in engine.generate(p, params, **kw) for t in out.new_token_ids]


def tier_hits(stats, tier: str) -> float:
    return stats.extra.get(f"connector.{tier}.hit_tokens", 0.0)


async def test_a_device_cache(oracle, make_engine, stepping):
    engine = await make_engine(offload_config(), **stepping)
    p = prompt(1, 50)
    assert await gen(engine, p) == oracle.greedy(p, N)
    assert await gen(engine, p) == oracle.greedy(p, N)
    stats = await engine.stats()
    assert stats.prefix_cache_hits == 48 and tier_hits(stats, "cpu") == 0
    assert_stepped(engine, stepping)


@pytest.mark.parametrize("staged", [False, True], ids=["batched", "staged"])
async def test_b_cpu_tier_after_device_reset(oracle, make_engine, stepping, monkeypatch, staged):
    """The prefix comes back from the CPU tier; with ``staged_layer_transfers``
    each step's saved and loaded chunks go through one staging buffer, every
    layer gathered into or scattered from it."""
    from kvstrata.kernels import KVStreams

    moved: dict[str, list[int]] = {"load_staged_layer": [], "store_staged_layer": []}
    for name, layers in moved.items():
        def counted(self, staged_chunks, layer, *args, _f=getattr(KVStreams, name), _layers=layers):
            _layers.append(layer)
            return _f(self, staged_chunks, layer, *args)
        monkeypatch.setattr(KVStreams, name, counted)
    engine = await make_engine(offload_config(staged_layer_transfers=staged), **stepping)
    p = prompt(2, 50)
    assert await gen(engine, p) == oracle.greedy(p, N)
    await engine.flush_kv()
    assert await engine.reset_prefix_cache()
    assert await gen(engine, p) == oracle.greedy(p, N)
    stats = await engine.stats()
    # 3 full chunks of 16 stored (48 tokens); the last prompt token is always computed.
    assert stats.prefix_cache_hits == 0 and tier_hits(stats, "cpu") == 48
    assert stats.extra["kv.external_hit_tokens"] == 48
    layers = set(range(len(engine.core.runner.kv_caches))) if staged else set()
    assert all(set(got) == layers for got in moved.values()), moved
    assert_stepped(engine, stepping)


def store_of(engine):
    return engine.core.kv_connector.store


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("batched", "staged"), [(False, False), (True, False), (True, True)],
                         ids=["per_chunk", "batched", "staged"])
async def test_b_cpu_tier_on_cuda_streams(oracle, make_engine, stepping, batched, staged):
    """The CUDA path: layer i+1's load on the load stream overlaps layer i,
    saves on the store stream, a preempted request's blocks read first;
    layer transfers one call per chunk, or batched (one per layer), or
    staged (a step's chunks to the device a run of layers at a time)."""
    engine = await make_engine(offload_config(batched_layer_transfers=batched, staged_layer_transfers=staged),
                               device="cuda", num_blocks=33, **stepping)
    prompts = [prompt(2, 50), prompt(9, 24), prompt(19, 24)]
    assert [await gen(engine, p) for p in prompts[:1]] == [oracle.greedy(prompts[0], N)]
    await engine.flush_kv()
    assert await engine.reset_prefix_cache()
    got = await asyncio.gather(*(gen(engine, p, 16) for p in prompts))
    assert got == [oracle.greedy(p, 16) for p in prompts]
    stats = await engine.stats()
    assert tier_hits(stats, "cpu") >= 48
    assert_stepped(engine, stepping)


async def test_c_disk_tier_after_l1_cleared(oracle, make_engine, tmp_path, stepping):
    engine = await make_engine(offload_config(tiers=(disk_tier(tmp_path / "disk"),)), **stepping)
    p = prompt(3, 70)
    assert await gen(engine, p) == oracle.greedy(p, N)
    await engine.flush_kv()
    assert await engine.reset_prefix_cache()
    store_of(engine).l1.clear()
    assert await gen(engine, p) == oracle.greedy(p, N)
    stats = await engine.stats()
    assert stats.prefix_cache_hits == 0
    assert tier_hits(stats, "disk") == 64 and tier_hits(stats, "cpu") == 0
    # Promoted from disk into L1 first (no blocks held meanwhile), then loaded within the step.
    assert stats.extra["connector.sync_loads"] == 1 and stats.extra["connector.async_loads"] == 0
    assert stats.extra["store.disk.hit_tokens"] == 64
    assert_stepped(engine, stepping)


@pytest.mark.parametrize("load_mode", ["auto", "async"])
async def test_e_corrupt_disk_object_is_recomputed(oracle, make_engine, tmp_path, load_mode, stepping):
    engine = await make_engine(offload_config(load_mode=load_mode, tiers=(disk_tier(tmp_path / "disk"),)),
                               **stepping)
    p = prompt(4, 70)
    assert await gen(engine, p) == oracle.greedy(p, N)
    await engine.flush_kv()
    assert await engine.reset_prefix_cache()
    store_of(engine).l1.clear()
    files = sorted(f for f in (tmp_path / "disk").rglob("*") if f.is_file())
    assert len(files) == 4
    chunk2 = engine.core.kv_connector.scheduler.keyer.keys(_hashes(engine, p))[1].name
    victim = next(f for f in files if chunk2 in f.name)
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF  # a flipped payload byte: the checksum no longer matches
    victim.write_bytes(bytes(data))
    assert await gen(engine, p) == oracle.greedy(p, N)
    stats = await engine.stats()
    assert stats.extra["store.disk.corrupt"] == 1
    assert tier_hits(stats, "disk") == CHUNK  # chunk 0 loaded; chunks 1-3 recomputed
    assert stats.extra["connector.load_failed_tokens"] == 48
    # "auto" promotes first and plans around the loss; "async" has blocks allocated and rolls back.
    assert stats.extra["connector.async_loads"] == (load_mode == "async")
    assert_stepped(engine, stepping)


def _hashes(engine, p):
    """The device block hashes of ``p``, as the engine computes them."""
    from kvstrata.enginecore.request import Request

    req = Request("probe", p, SamplingParams(), block_hasher=engine.core.block_hasher,
                  hash_block_size=engine.core.block_hasher.block_size)
    return req.block_hashes


async def run_engine_process(oracle, kv_transfer, prompts: list[list[int]]) -> dict:
    """Generate in a freshly started engine process; returns its JSON report."""
    import json
    import sys
    from pathlib import Path

    import msgspec
    from conn_helpers import BLOCK

    args = {"model": oracle.path, "block_size": BLOCK, "max_tokens": N, "prompts": prompts,
            "kv_transfer": msgspec.to_builtins(kv_transfer)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(Path(__file__).parent / "engine_proc.py"), json.dumps(args),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()[-2000:]
    return json.loads(out.decode().strip().splitlines()[-1])


async def test_d_redis_from_a_freshly_started_engine_process(oracle, make_engine, redis_server):
    from conn_helpers import redis_tier

    kv_transfer = offload_config(tiers=(redis_tier(redis_server.port),))
    engine = await make_engine(kv_transfer)
    p = prompt(5, 70)
    assert await gen(engine, p) == oracle.greedy(p, N)
    await engine.flush_kv()
    assert await asyncio.to_thread(redis_server.dbsize) == 2 * 4  # 4 chunks: data + meta keys each
    report = await run_engine_process(oracle, kv_transfer, [p])
    assert report["tokens"] == [oracle.greedy(p, N)]
    assert report["prefix_cache_hits"] == 0
    assert report["extra"]["connector.redis.hit_tokens"] == 64
    assert report["extra"]["store.redis.hit_tokens"] == 64


async def test_f_redis_killed_mid_run(oracle, make_engine, redis_server):
    from conn_helpers import redis_tier

    engine = await make_engine(offload_config(cpu_chunks=1, tiers=(redis_tier(redis_server.port),)))
    prompts = [prompt(10 + i, 40 + 6 * i) for i in range(4)]
    for p in prompts[:2]:
        assert await gen(engine, p) == oracle.greedy(p, N)
    await engine.flush_kv()
    assert await engine.reset_prefix_cache()
    # Redis dies while the next requests look their prefixes up and load them.
    tasks = [asyncio.create_task(gen(engine, p)) for p in prompts]
    sched = engine.core.scheduler
    for _ in range(2000):
        if sched.transfers.loading:  # a load from Redis is in flight
            break
        await asyncio.sleep(0.001)
    assert sched.transfers.loading
    redis_server.kill()
    assert await asyncio.gather(*tasks) == [oracle.greedy(p, N) for p in prompts]
    stats = await engine.stats()
    assert stats.extra["store.redis.available"] == 0.0
    assert [await gen(engine, p) for p in prompts[:2]] == [oracle.greedy(p, N) for p in prompts[:2]]


async def test_cache_salt_isolates_tenants_in_every_tier(oracle, make_engine, tmp_path, redis_server):
    from conn_helpers import redis_tier

    tiers = (disk_tier(tmp_path / "disk"), redis_tier(redis_server.port))
    engine = await make_engine(offload_config(tiers=tiers))
    p = prompt(6, 70)
    assert await gen(engine, p, cache_salt="tenant-a") == oracle.greedy(p, N)
    await engine.flush_kv()
    base = await engine.stats()
    # Tenant b: the device cache, L1, disk and Redis all hold a's prefix; b hits none.
    assert await gen(engine, p, cache_salt="tenant-b") == oracle.greedy(p, N)
    await engine.flush_kv()
    assert await engine.reset_prefix_cache()
    engine.core.kv_connector.store.l1.clear()
    assert await gen(engine, p, cache_salt="tenant-b") == oracle.greedy(p, N)
    stats = await engine.stats()
    assert stats.prefix_cache_hits == base.prefix_cache_hits == 0
    assert stats.extra["kv.external_hit_tokens"] == 64  # b's own prefix, saved by its first request
    assert stats.extra["connector.disk.hit_tokens"] == 64
    # No salt at all is a third tenant.
    assert await gen(engine, p) == oracle.greedy(p, N)
    assert (await engine.stats()).extra["kv.external_hit_tokens"] == 64
    await engine.flush_kv()
    assert await asyncio.to_thread(redis_server.dbsize) == 3 * 2 * 4  # three tenants' 4 chunks


async def test_a_conversation_turn_loads_the_partial_tail_saved_at_finish(oracle, make_engine, stepping):
    engine = await make_engine(offload_config(save_partial=True), **stepping)
    p = prompt(7, 50)
    first = await gen(engine, p)
    assert first == oracle.greedy(p, N)
    await engine.flush_kv()
    assert await engine.reset_prefix_cache()
    # Turn 2: the history (50 + 8 tokens, 57 of them computed) and a new user message.
    q = p + first + prompt(8, 10)
    assert await gen(engine, q) == oracle.greedy(q, N)
    stats = await engine.stats()
    # 3 full chunks (48) and the partial chunk of 2 blocks (8) saved when turn 1 finished.
    assert tier_hits(stats, "cpu") == 56
    assert_stepped(engine, stepping)


async def test_decode_graphs_with_a_connector_save_after_the_whole_forward(oracle, make_engine, stepping):
    """Decode steps with no layer-by-layer load replay their graph (on a CPU:
    padded eager replays) and the connector saves every layer after it: the
    chunks saved while decoding (``save_decode``) come back from the CPU tier exact."""
    engine = await make_engine(offload_config(save_decode=True), **stepping)
    graphs = engine.core.runner.capture_decode_graphs([1, 2, 4], emulate=True)
    p = prompt(4, 30)
    first = await gen(engine, p, 40)  # 70 tokens: chunks 16..64 are completed by decode steps
    assert first == oracle.greedy(p, 40)
    assert graphs.num_replays > 0
    await engine.flush_kv()
    assert await engine.reset_prefix_cache()
    follow = p + first[:36]  # the decoded tokens' KV, saved after graph replays, now loaded
    assert await gen(engine, follow) == oracle.greedy(follow, N)
    assert tier_hits(await engine.stats(), "cpu") == 64
