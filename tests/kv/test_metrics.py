"""Sampled block residency and prefix-cache stats."""

import pytest

from kvstrata.kv import BlockPool, BlockResidencySample
from kvstrata.kv.metrics import RESIDENCY_BUCKETS_S, ResidencySampler
from kvstrata.types import HistogramSnapshot

from .builders import make_manager, make_request


class StepClock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _cache_one(pool, block, request):
    pool.cache_full_blocks(request, [block], request.block_hashes, 0, 1, 4, 0)


def test_residency_reports_lifetime_idle_time_and_reuse_gaps():
    clock = StepClock()
    pool = BlockPool(3, sampler=ResidencySampler(1.0, clock=clock))  # 2 usable blocks
    req = make_request("r", range(4), block_size=4)
    (block,) = pool.get_new_blocks(1)  # t=100: born
    _cache_one(pool, block, req)
    pool.free_blocks([block])
    clock.now = 103.0
    pool.touch([block])  # reuse after 3 s
    pool.free_blocks([block])
    clock.now = 104.5
    pool.touch([block])  # reuse after 1.5 s
    pool.free_blocks([block])
    clock.now = 110.0
    pool.get_new_blocks(2)  # evicts it
    assert pool.sampler.take_samples() == [
        BlockResidencySample(lifetime_s=10.0, idle_before_eviction_s=5.5, num_reuses=2, reuse_gaps_s=[3.0, 1.5])
    ]
    assert pool.sampler.take_samples() == []
    # ... and the histograms since start hold it too, draining or not.
    totals = pool.sampler.totals.snapshot(1.0)
    assert (totals.num_samples, totals.num_reuses) == (1, 2)
    bounds = RESIDENCY_BUCKETS_S  # 0.01, 0.1, 1, 10, 60, ...
    assert totals.lifetime_s == HistogramSnapshot(bounds=bounds, counts=(0, 0, 0, 1, 0, 0, 0, 0, 0),
                                                  sum=10.0, count=1)
    assert totals.idle_before_eviction_s.counts == (0, 0, 0, 1, 0, 0, 0, 0, 0)
    assert totals.reuse_gap_s == HistogramSnapshot(bounds=bounds, counts=(0, 0, 0, 2, 0, 0, 0, 0, 0),
                                                   sum=4.5, count=2)


def test_a_sampled_block_never_cached_leaves_no_sample():
    clock = StepClock()
    pool = BlockPool(2, sampler=ResidencySampler(1.0, clock=clock))
    block = pool.get_new_blocks(1)
    pool.free_blocks(block)
    pool.get_new_blocks(1)
    pool.free_blocks(block)
    assert pool.sampler.take_samples() == []


def test_sampling_rate_is_respected_with_a_fixed_seed():
    sampler = ResidencySampler(0.01, seed=7)
    pool = BlockPool(1001, sampler=sampler)
    sampled = 0
    for _ in range(100):
        blocks = pool.get_new_blocks(1000)
        sampled += sum(b.sample is not None for b in blocks)
        pool.free_blocks(blocks)
    assert 800 <= sampled <= 1200  # 100,000 allocations at 1%


@pytest.mark.parametrize("rate", [0.0, -0.1, 1.5, "1%"])
def test_bad_sample_rate_is_named(rate):
    with pytest.raises(ValueError, match="metrics_sample_rate"):
        ResidencySampler(rate)


def test_manager_stats_carry_residency_samples():
    m = make_manager(4, metrics_sample_rate=1.0)  # 3 usable blocks
    r0 = make_request("r0", range(33))
    m.allocate_slots(r0, 33)
    m.free(r0)
    m.allocate_slots(make_request("r1", range(100, 148)), 48)  # evicts r0's two cached blocks
    stats = m.make_prefix_cache_stats()
    assert len(stats.residency) == 2
    assert all(s.num_reuses == 0 and s.lifetime_s >= s.idle_before_eviction_s >= 0 for s in stats.residency)
    assert m.make_prefix_cache_stats().residency == []
    residency = m.block_residency()
    assert (residency.sample_rate, residency.num_samples, residency.lifetime_s.count) == (1.0, 2, 2)
    assert make_manager(4).block_residency() is None  # sampling off


def test_usage_counts_held_blocks_over_usable_blocks():
    m = make_manager(11)
    r0 = make_request("r0", range(40))
    m.allocate_slots(r0, 40)
    assert m.usage == 3 / 10
    m.free(r0)
    assert m.usage == 0.0
