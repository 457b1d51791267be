"""A model's per-layer KV specs reach every manager through the coordinator:
the engine's builder (``build_kv_cache_manager``) groups the layers, and each
attention type is then driven through the public API only
(get_computed_blocks / allocate_slots / free), with exact block ids.

Freed blocks without a hash go to the head of the free queue (reused first),
cached ones to the tail; the managers free their groups in group order."""

import pytest

from kvstrata.config import CacheConfig
from kvstrata.enginecore.builder import build_kv_cache_manager
from kvstrata.kv import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    HybridCoordinator,
    KVCacheManager,
    KVCacheSpec,
    MambaSpec,
    NoPrefixCacheCoordinator,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UnitaryCoordinator,
)
from kvstrata.kv.managers import (
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    SinkFullAttentionManager,
    SlidingWindowManager,
)

from .builders import make_request


def build(num_blocks: int, specs: dict[str, KVCacheSpec], *, caching: bool = True) -> KVCacheManager:
    cache = CacheConfig(block_size=min(s.block_size for s in specs.values()), num_blocks=num_blocks,
                        enable_prefix_caching=caching, metrics_sample_rate=0.0)
    return build_kv_cache_manager(cache, specs, max_model_len=256)


def full(bs: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1)


def sliding(window: int = 8) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=1, sliding_window=window)


def chunked(chunk: int = 8) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, attention_chunk_size=chunk)


def mamba(mode: str = "align") -> MambaSpec:
    return MambaSpec(block_size=16, mamba_cache_mode=mode)


def admit(m: KVCacheManager, req, num_new_tokens: int | None = None):
    """A request's first step as the scheduler takes it: lookup, then allocate."""
    hit, n_hit = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - n_hit if num_new_tokens is None else num_new_tokens, n_hit, hit)
    return hit.get_block_ids(), n_hit, None if new is None else new.get_block_ids()


def test_layers_with_equal_specs_form_one_group_each_and_pick_the_coordinator():
    m = build(16, {"l0": full(), "l1": sliding(), "l2": full(), "l3": sliding()})
    assert [g.layer_names for g in m.config.groups] == [["l0", "l2"], ["l1", "l3"]]
    assert type(m.coordinator) is HybridCoordinator
    assert [type(x) for x in m.coordinator.managers] == [FullAttentionManager, SlidingWindowManager]
    m = build(16, {"l0": full(), "l1": full()})
    assert [g.layer_names for g in m.config.groups] == [["l0", "l1"]]
    assert type(m.coordinator) is UnitaryCoordinator
    assert type(build(16, {"l0": full()}, caching=False).coordinator) is NoPrefixCacheCoordinator


def test_full_and_sliding_window_layers_hit_the_window_and_free_everything():
    m = build(40, {"attn": full(), "local": sliding()})
    r0 = make_request("r0", range(25), block_size=4)
    assert admit(m, r0) == (([], []), 0, ([1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]))
    m.free(r0)
    r1 = make_request("r1", range(25), block_size=4)
    # full: the whole prefix; window 8: only the two blocks before the hit end
    assert admit(m, r1) == (([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 12, 13]), 24, ([14], [7]))
    assert m.get_block_ids("r1") == ([1, 2, 3, 4, 5, 6, 14], [0, 0, 0, 0, 12, 13, 7])
    m.free(r1)
    assert m.num_free_blocks == 39


def test_full_and_chunked_local_layers_hit_up_to_the_current_chunk():
    m = build(40, {"attn": full(), "chunk": chunked()})
    assert [type(x) for x in m.coordinator.managers] == [FullAttentionManager, ChunkedLocalAttentionManager]
    r0 = make_request("r0", range(17), block_size=4)
    assert admit(m, r0) == (([], []), 0, ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]))
    m.free(r0)
    r1 = make_request("r1", range(17), block_size=4)
    # the hit ends where chunk 2 starts: the earlier chunks are never read again
    assert admit(m, r1) == (([1, 2, 3, 4], [0, 0, 0, 0]), 16, ([10], [5]))
    m.free(r1)
    assert m.num_free_blocks == 39


def test_mamba_layers_alone_keep_one_running_state():
    m = build(10, {"ssm": mamba("none")})
    assert type(m.coordinator.managers[0]) is MambaManager
    r0 = make_request("r0", range(40))
    assert admit(m, r0) == (([],), 0, ([1, 2, 3],))
    r0.num_computed_tokens = 40
    r0.append_output_token_ids([5])
    assert m.allocate_slots(r0, 1).get_block_ids() == ([],)
    assert m.get_block_ids("r0") == ([0, 0, 3],)  # only the state after the last token
    m.free(r0)
    assert admit(m, make_request("r1", range(40)))[:2] == (([],), 0)  # "none" caches no state


def test_full_and_mamba_align_layers_resume_from_a_cached_state_next_step():
    m = build(20, {"attn": full(16), "ssm": mamba("align")})
    assert type(m.coordinator) is HybridCoordinator
    r0 = make_request("r0", range(64))
    assert admit(m, r0) == (([], []), 0, ([1, 2, 3, 4], [0, 0, 0, 5]))
    m.free(r0)
    r1 = make_request("r1", [*range(64), *range(500, 510)])
    # the state at 64 was cached this step (not written yet): no room until the next step
    assert admit(m, r1) == (([1, 2, 3, 4], [0, 0, 0, 5]), 64, None)
    m.new_step_starts()
    assert admit(m, r1) == (([1, 2, 3, 4], [0, 0, 0, 5]), 64, ([6], [7]))
    assert m.get_block_ids("r1") == ([1, 2, 3, 4, 6], [0, 0, 0, 5, 7])
    m.free(r1)
    assert m.num_free_blocks == 19


def test_cross_attention_layers_take_encoder_slots_once_and_refuse_prefix_caching():
    with pytest.raises(ValueError, match="enable_prefix_caching must be false.*cross-attention"):
        build(10, {"self": full(16), "cross": CrossAttentionSpec(block_size=16, num_kv_heads=1, head_size=1)})
    m = build(10, {"self": full(16), "cross": CrossAttentionSpec(block_size=16, num_kv_heads=1, head_size=1)},
              caching=False)
    assert [type(x) for x in m.coordinator.managers] == [FullAttentionManager, CrossAttentionManager]
    r0 = make_request("r0", range(10))
    assert m.get_computed_blocks(r0)[1] == 0
    assert m.allocate_slots(r0, 10, num_encoder_tokens=40).get_block_ids() == ([1], [2, 3, 4])
    r0.num_computed_tokens = 10
    r0.append_output_token_ids([3])
    assert m.allocate_slots(r0, 1, num_encoder_tokens=40).get_block_ids() == ([], [])
    m.free(r0)
    assert m.num_free_blocks == 9


def test_sink_layers_reserve_their_blocks_and_hit_behind_them():
    m = build(10, {"attn": SinkFullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, sink_len=32)})
    assert type(m.coordinator.managers[0]) is SinkFullAttentionManager
    assert m.coordinator.managers[0].sink_block_ids == [1, 2]
    assert m.num_free_blocks == 7
    r0 = make_request("r0", range(20))
    assert admit(m, r0) == (([],), 0, ([3, 4],))
    m.free(r0)
    r1 = make_request("r1", range(20))
    assert admit(m, r1) == (([3],), 16, ([4],))  # r0's partial block, reused first
    m.free(r1)
    assert m.num_free_blocks == 7  # the sinks are never freed
