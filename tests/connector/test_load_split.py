"""Load or compute: the cost model's split, the measured tier rates, and
identical tokens wherever the split falls (the front computed while the
back loads from disk or Redis)."""

from __future__ import annotations

import asyncio

import pytest
from conn_helpers import CHUNK, disk_tier, offload_config, prompt, redis_tier
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.connector.offload.costs import ChunkCost, choose_split, forced_split
from kvstrata.connector.offload.options import OffloadOptions
from kvstrata.enginecore import SamplingParams
from kvstrata.io.rates import ReadRate, ReadThrottle

N = 8


async def gen(engine, p, n=N) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=n)
    return [t async for out in engine.generate(p, params) for t in out.new_token_ids]


# -- the cost model, pure ---------------------------------------------------------

def _rates(bw: dict[str, float], lat: float = 0.0):
    return (lambda tier, nbytes: max(lat, nbytes / bw[tier])), (lambda tier: 0.0)


def test_chunks_in_cpu_memory_are_always_loaded():
    chunks = [ChunkCost(16, 1000, None)] * 4
    assert choose_split(chunks, 1.0, *_rates({})).compute == 0


def test_a_fast_tier_is_loaded_and_a_slow_one_recomputed():
    chunks = [ChunkCost(100, 10_000, "disk")] * 4
    # Compute: 1 ms per token -> 0.1 s per chunk. Load: 10 KB per chunk.
    fast = choose_split(chunks, 1e-3, *_rates({"disk": 1e9}))
    slow = choose_split(chunks, 1e-3, *_rates({"disk": 1e3}))  # 10 s per chunk
    assert fast.compute == 0 and fast.reason == "load_only"
    assert slow.compute == 4 and slow.reason == "compute_only"


def test_the_split_meets_where_compute_and_load_take_as_long():
    chunks = [ChunkCost(100, 10_000, "disk")] * 10
    # 0.1 s to compute a chunk, 0.1 s to read one: compute 5 while 5 load.
    split = choose_split(chunks, 1e-3, *_rates({"disk": 1e5}))
    assert split.compute == 5 and split.reason == "split"
    assert split.seconds == pytest.approx(0.5)
    # Reads three times faster: compute 2 (0.2 s) while 8 load (0.27 s).
    faster = choose_split(chunks, 1e-3, *_rates({"disk": 3e5}))
    assert faster.compute == 2 and faster.seconds == pytest.approx(8 / 30)


def test_unmeasured_rates_load_everything():
    chunks = [ChunkCost(16, 1000, "disk")] * 3
    assert choose_split(chunks, None, *_rates({"disk": 1.0})).reason == "compute_unmeasured"
    unmeasured = choose_split(chunks, 1e-3, lambda t, b: None, lambda t: 0.0)
    assert unmeasured.compute == 0 and unmeasured.reason == "tier_unmeasured"


def test_a_failing_tier_is_not_read():
    chunks = [ChunkCost(16, 1000, "redis")] * 3
    split = choose_split(chunks, 1e-3, lambda t, b: 1e-6, lambda t: 0.9)
    assert split.compute == 3 and split.reason == "tier_failing"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 64), st.sampled_from([None, "disk", "redis"])), min_size=1, max_size=12),
       st.floats(1e-6, 1e-2), st.floats(1e3, 1e9), st.floats(1e3, 1e9), st.floats(0, 0.05))
def test_the_split_minimizes_the_time_to_cover_the_hit(spec, s_per_token, bw_disk, bw_redis, lat):
    chunks = [ChunkCost(tok, tok * 512, tier) for tok, tier in spec]
    bws = {"disk": bw_disk, "redis": bw_redis}
    predict, failing = _rates(bws, lat)
    split = choose_split(chunks, s_per_token, predict, failing)

    def cost(k: int) -> float:
        per_tier: dict[str, int] = {}
        for c in chunks[k:]:
            if c.tier is not None:
                per_tier[c.tier] = per_tier.get(c.tier, 0) + c.nbytes
        load = max((predict(t, b) for t, b in per_tier.items()), default=0.0)
        return max(sum(c.tokens for c in chunks[:k]) * s_per_token, load)

    best = min(cost(k) for k in range(len(chunks) + 1))
    assert 0 <= split.compute <= len(chunks)
    if any(c.tier for c in chunks):
        assert cost(split.compute) <= best + 1e-9
        assert all(cost(k) > best + 1e-12 for k in range(split.compute))  # ties: the smallest k
    else:
        assert split.compute == 0


def test_forced_split_rounds_to_chunks():
    assert [forced_split(4, f).compute for f in (0, 0.25, 0.5, 0.9, 1.0)] == [0, 1, 2, 4, 4]


def test_split_options_are_checked():
    with pytest.raises(ValueError, match="load_split_fraction"):
        OffloadOptions(load_split_fraction=1.5).validate()
    with pytest.raises(ValueError, match="load_split must be"):
        OffloadOptions(load_split="maybe").validate()  # type: ignore[arg-type]


# -- measured rates and the throttle ------------------------------------------------

def test_read_rate_moving_averages_and_prediction():
    r = ReadRate()
    assert r.predict(1000) is None
    r.observe_read(0.01, 1000, True)
    r.observe_batch(0.02, 4000)
    assert r.latency_s == pytest.approx(0.01) and r.bandwidth_bps == pytest.approx(200_000)
    assert r.predict(1000) == pytest.approx(0.01)  # latency-bound
    assert r.predict(100_000) == pytest.approx(0.5)  # bandwidth-bound
    for _ in range(20):
        r.observe_read(0.5, 1000, False)
    assert r.failure_rate > 0.9 and r.failures == 20


def test_throttle_serializes_reads_on_the_link():
    t = ReadThrottle(1000.0)
    assert t.reserve(500, 10.0) == pytest.approx(10.5)
    assert t.reserve(500, 10.0) == pytest.approx(11.0)  # waits for the first
    assert t.reserve(100, 20.0) == pytest.approx(20.1)  # idle link: starts now
    with pytest.raises(ValueError):
        ReadThrottle(0)


async def test_a_throttled_tier_reads_at_its_cap(tmp_path):
    import msgspec
    import torch

    from kvstrata.io import ChunkKey, StorageManager, StoreConfig

    store_cfg = msgspec.convert({
        "cpu": {"capacity_bytes": 1 << 20, "pin_memory": False},
        "tiers": [{**disk_tier(tmp_path / "d"), "read_bandwidth_bps": 200_000.0}]}, StoreConfig)
    keys = [ChunkKey("split-test", i.to_bytes(4, "big") * 8, 16, -1) for i in range(4)]
    async with StorageManager(store_cfg) as store:
        for k in keys:
            obj = store.allocate((2048,), torch.float32)
            obj.tensor.fill_(1.0)
            store.put(k, obj)
            obj.release()
        await store.drain()
        store.l1.clear()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        got = await store.get(keys)
        took = loop.time() - t0
        assert len(got) == 4
        for o in got:
            o.release()
        assert took >= 4 * 8192 / 200_000 * 0.9  # four 8 KiB reads at 200 kB/s
        rate = store.read_rates()["disk"]
        assert rate.bandwidth_bps == pytest.approx(200_000, rel=0.35)
        assert rate.reads == 4 and rate.latency_s is not None


# -- through the engine ------------------------------------------------------------

def _stats_split(stats) -> dict[str, float]:
    return {k.split(".", 1)[1]: v for k, v in stats.extra.items() if k.startswith("connector.split")}


async def _hit_from_tier(engine, p) -> None:
    await engine.flush_kv()
    assert await engine.reset_prefix_cache()
    engine.core.kv_connector.store.l1.clear()


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 0.75, 1.0])
async def test_tokens_identical_wherever_the_split_falls_on_disk(oracle, make_engine, tmp_path, fraction):
    engine = await make_engine(offload_config(tiers=(disk_tier(tmp_path / "disk"),), load_split_fraction=fraction,
                                              max_prefetch=0))
    p = prompt(31, 70)  # 4 full chunks of 16 stored
    assert await gen(engine, p) == oracle.greedy(p, N)
    await _hit_from_tier(engine, p)
    assert await gen(engine, p) == oracle.greedy(p, N)
    stats = await engine.stats()
    split = _stats_split(stats)
    k = round(fraction * 4)
    loaded = stats.extra.get("connector.disk.hit_tokens", 0.0)
    if k == 0:
        assert split["split_load_only"] == 1 and loaded == 64
    elif k == 4:
        assert split["split_compute_only"] == 1 and loaded == 0
    else:
        assert split["split_loads"] == 1
        # The fetched chunks are loaded, unless computing outran the fetch.
        assert loaded == (4 - k) * CHUNK or split["split_fetch_outrun"] == 1 or loaded < (4 - k) * CHUNK
        assert loaded > 0 or split["split_fetch_outrun"] == 1
    assert stats.prefix_cache_hits == 0


@pytest.mark.parametrize("fraction", [0.25, 0.75])
async def test_tokens_identical_wherever_the_split_falls_on_redis(oracle, make_engine, redis_server, fraction):
    engine = await make_engine(offload_config(tiers=(redis_tier(redis_server.port),), load_split_fraction=fraction,
                                              max_prefetch=0))
    p = prompt(32, 70)
    assert await gen(engine, p) == oracle.greedy(p, N)
    await _hit_from_tier(engine, p)
    assert await gen(engine, p) == oracle.greedy(p, N)
    stats = await engine.stats()
    split = _stats_split(stats)
    assert split["split_loads"] == 1
    loaded = stats.extra.get("connector.redis.hit_tokens", 0.0)
    assert loaded <= (4 - round(fraction * 4)) * CHUNK
    assert loaded > 0 or split["split_fetch_outrun"] == 1  # computing may outrun the network


async def test_computing_outruns_a_slow_fetch_and_still_matches(oracle, make_engine, tmp_path):
    """A tier capped so low that the fetch cannot land before the front is
    computed: the request computes chunk after chunk, drops the fetch when
    nothing is left to load, and its tokens are unchanged."""
    tier = {**disk_tier(tmp_path / "disk"), "read_bandwidth_bps": 2_000.0}  # seconds per chunk
    engine = await make_engine(offload_config(tiers=(tier,), load_split_fraction=0.25, max_prefetch=0))
    p = prompt(33, 70)
    assert await gen(engine, p) == oracle.greedy(p, N)
    await _hit_from_tier(engine, p)
    others = [prompt(40 + i, 20) for i in range(2)]
    got = await asyncio.gather(gen(engine, p), *(gen(engine, q) for q in others))
    assert got == [oracle.greedy(p, N), *(oracle.greedy(q, N) for q in others)]
    stats = await engine.stats()
    split = _stats_split(stats)
    assert split["split_loads"] == 1 and split["split_fetch_outrun"] == 1
    assert stats.extra.get("connector.disk.hit_tokens", 0.0) == 0


async def test_the_cost_model_stops_reading_a_slow_tier(oracle, make_engine, tmp_path):
    """Measured online: the first hit from a capped disk is loaded (nothing
    measured yet) and shows the tier slow; the next one is recomputed."""
    tier = {**disk_tier(tmp_path / "disk"), "read_bandwidth_bps": 100_000.0}
    engine = await make_engine(offload_config(tiers=(tier,), max_prefetch=0))
    p = prompt(34, 70)
    assert await gen(engine, p) == oracle.greedy(p, N)
    await _hit_from_tier(engine, p)
    assert await gen(engine, p) == oracle.greedy(p, N)  # loaded: measures the tier
    stats = await engine.stats()
    assert _stats_split(stats)["split_load_only"] == 1
    assert stats.extra["store.disk.read_bandwidth_bps"] < 150_000
    assert stats.extra["store.disk.read_latency_s"] > 0
    assert stats.extra["connector.prefill_tokens_per_s"] > 0
    await _hit_from_tier(engine, p)
    assert await gen(engine, p) == oracle.greedy(p, N)
    split = _stats_split(await engine.stats())
    assert split["split_compute_only"] + split["split_loads"] == 1


async def test_a_prefetched_promotion_is_split_too(oracle, make_engine, tmp_path):
    """The promotion a request's arrival started (prefetch) is still reading
    a capped disk when the scheduler reaches it: the front is computed
    meanwhile, and tokens are unchanged."""
    tier = {**disk_tier(tmp_path / "disk"), "read_bandwidth_bps": 40_000.0}
    engine = await make_engine(offload_config(tiers=(tier,), load_split_fraction=0.5))
    p = prompt(35, 70)
    assert await gen(engine, p) == oracle.greedy(p, N)
    await _hit_from_tier(engine, p)
    assert await gen(engine, p) == oracle.greedy(p, N)
    stats = await engine.stats()
    assert _stats_split(stats)["split_loads"] == 1
    assert stats.extra.get("connector.disk.hit_tokens", 0.0) <= 2 * CHUNK


def test_a_step_of_its_own_makes_a_small_split_not_worth_it():
    chunks = [ChunkCost(100, 10_000, "disk")] * 4
    # 0.1 s per chunk either way: split 2/2 (0.2 s) without overhead...
    assert choose_split(chunks, 1e-3, *_rates({"disk": 1e5})).compute == 2
    # ...but a 0.3 s step overhead makes computing any front slower than loading it all (0.4 s).
    assert choose_split(chunks, 1e-3, *_rates({"disk": 1e5}), step_s=0.3).compute == 0


def test_the_step_cost_fit_separates_overhead_from_per_token_cost():
    from kvstrata.connector.metrics import StepCostFit, TransferMetrics

    fit = StepCostFit()
    assert fit.fit() is None
    for tokens in (1, 32, 1, 512, 8, 256, 1, 1024) * 3:
        fit.observe(tokens, 0.02 + 1e-4 * tokens)
    a, b = fit.fit()
    assert a == pytest.approx(0.02, rel=1e-6) and b == pytest.approx(1e-4, rel=1e-6)
    m = TransferMetrics(["cpu"])
    for _ in range(5):
        m.observe_forward(0.05, 100)  # one size only: all of it per token
    assert m.step_s == 0.0 and m.s_per_token == pytest.approx(5e-4)
    assert m.as_dict()["connector.prefill_tokens_per_s"] == pytest.approx(2000)
