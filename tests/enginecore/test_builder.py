"""The composition root: each check and derivation of the builder, and whole
engines built from a model's per-layer KV specs (hybrid included)."""

from __future__ import annotations

import pytest
from engine_fakes import FakeRunner, ScriptedConnector, engine_config

from kvstrata.config import CacheConfig, EngineConfig, SchedulerConfig
from kvstrata.connector import NoOpConnector
from kvstrata.enginecore.builder import (
    build_engine_core,
    cache_identity,
    cap_max_model_len,
    check_batch_budget,
    connector_spec,
    kv_bytes_per_block,
    kv_cache_groups,
    pool_token_capacity,
    resolve_num_blocks,
)
from kvstrata.enginecore.request import EngineRequest
from kvstrata.kv import (
    FullAttentionSpec,
    HybridCoordinator,
    MambaSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UnitaryCoordinator,
)
from kvstrata.types import SamplingParams
from kvstrata.worker.null_runner import NullModelRunner

FULL = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8)  # 512 bytes a page
WINDOW = SlidingWindowSpec(block_size=4, num_kv_heads=2, head_size=8, sliding_window=8)


def test_groups_follow_first_appearance_and_reject_what_is_not_a_spec():
    groups = kv_cache_groups({"a": WINDOW, "b": FULL, "c": WINDOW})
    assert [(g.layer_names, g.spec) for g in groups] == [(["a", "c"], WINDOW), (["b"], FULL)]
    with pytest.raises(ValueError, match="names no layer"):
        kv_cache_groups({})
    with pytest.raises(TypeError, match="layer 'x'.*got dict"):
        kv_cache_groups({"x": {"block_size": 4}})


def test_pool_size_comes_from_memory_over_every_layers_page():
    specs = {"a": FULL, "b": WINDOW}
    assert kv_bytes_per_block(specs) == 2 * 512
    assert resolve_num_blocks(CacheConfig(block_size=4, kv_cache_memory_mib=1), specs) == 1024
    assert resolve_num_blocks(CacheConfig(block_size=4, num_blocks=7), specs) == 7
    with pytest.raises(ValueError, match="kv_cache_memory_mib=1 holds 0 blocks; need >= 2"):
        resolve_num_blocks(CacheConfig(kv_cache_memory_mib=1), {"a": MambaSpec(block_size=4, state_bytes=2**21)})


def test_one_request_must_fit_in_the_pool_every_group_sharing_it():
    assert pool_token_capacity(kv_cache_groups({"a": FULL}), 11) == 40
    assert pool_token_capacity(kv_cache_groups({"a": FULL, "b": WINDOW}), 11) == 20
    sinks = SinkFullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, sink_len=8)
    assert pool_token_capacity(kv_cache_groups({"a": sinks}), 11) == 32
    assert cap_max_model_len(256, 40) == 40 and cap_max_model_len(32, 40) == 32


def test_without_chunked_prefill_a_prompt_must_fit_in_one_step():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\) must be >= max_model_len \(32\)"):
        check_batch_budget(SchedulerConfig(max_num_batched_tokens=16, enable_chunked_prefill=False), 32)
    check_batch_budget(SchedulerConfig(max_num_batched_tokens=16), 32)


def test_identity_carries_the_kv_dtype_and_the_cache_settings():
    cache = CacheConfig(block_size=4, hash_algo="xxhash", cache_namespace="ns", kv_layout="cross_layer")
    ident = cache_identity(cache, {"a": FULL}, "model-x")
    assert (ident.model_fingerprint, ident.kv_dtype, ident.kv_layout, ident.block_size, ident.hash_algo,
            ident.namespace) == ("model-x", "float32", "cross_layer", 4, "xxhash", "ns")
    assert cache_identity(cache, {"m": MambaSpec(block_size=4)}, "m").kv_dtype == "none"


def test_a_connector_needs_full_attention_of_one_shape():
    ident = cache_identity(CacheConfig(block_size=4), {"a": FULL}, "m")
    spec = connector_spec(ident, {"a": FULL, "b": FULL}, 64)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_size, spec.dtype, spec.max_model_len) == (
        2, 2, 8, "float32", 64)
    with pytest.raises(ValueError, match="all full attention of one shape"):
        connector_spec(ident, {"a": FULL, "b": WINDOW}, 64)


def test_config_mismatches_are_named():
    with pytest.raises(ValueError, match=r"cache.block_size \(8\) differs from the runner's \(4\)"):
        build_engine_core(engine_config(block_size=8), FakeRunner(block_size=4))
    with pytest.raises(ValueError, match="FakeRunner cannot run a KV connector"):
        build_engine_core(engine_config(), FakeRunner(), NoOpConnector())


def _run(core, prompts: dict[str, list[int]]) -> None:
    for rid, prompt in prompts.items():
        core.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt,
                                       sampling_params=SamplingParams(max_tokens=3)))
        while core.has_work():
            core.step()


def test_a_hybrid_model_runs_with_the_hybrid_coordinator_and_hits(kv_managers):
    runner = FakeRunner(layer_specs={"attn.0": FULL, "local.1": WINDOW, "attn.2": FULL})
    core = build_engine_core(engine_config(num_blocks=40), runner)
    kv_managers.append(core.kv)
    assert type(core.kv.coordinator) is HybridCoordinator
    assert [g.layer_names for g in core.kv.config.groups] == [["attn.0", "attn.2"], ["local.1"]]
    assert core.max_model_len == 39 // 2 * 4  # two groups share the pool
    prompt = list(range(10, 35))
    _run(core, {"a": prompt, "b": prompt})
    stats = core.stats()
    assert (stats.num_finished, stats.prefix_cache_hits) == (2, 24)


def test_a_scheduler_side_alone_is_the_schedulers_connector(kv_managers):
    conn = ScriptedConnector()
    core = build_engine_core(engine_config(), FakeRunner(), conn)
    kv_managers.append(core.kv)
    assert core.scheduler.connector is conn and core.kv_connector is None
    assert core.block_hasher is not None  # a connector reads the hashes
    core = build_engine_core(EngineConfig(cache=CacheConfig(block_size=4, num_blocks=8,
                                                            enable_prefix_caching=False)), FakeRunner())
    kv_managers.append(core.kv)
    assert core.block_hasher is None and type(core.kv.coordinator) is not UnitaryCoordinator


def test_the_context_is_capped_by_the_pool(kv_managers):
    core = build_engine_core(engine_config(num_blocks=5), FakeRunner(max_model_len=256))  # 4 usable blocks of 4
    kv_managers.append(core.kv)
    assert (core.max_model_len, core.kv.max_model_len, core.scheduler.max_model_len) == (16, 16, 16)


def test_the_config_names_the_runner(kv_managers):
    core = build_engine_core(EngineConfig(executor="null", cache=CacheConfig(num_blocks=64)))
    kv_managers.append(core.kv)
    assert isinstance(core.runner, NullModelRunner) and core.runner.num_blocks == 64
    assert core.identity.model_fingerprint == core.runner.model_fingerprint
    _run(core, {"n": [72, 101, 108, 108, 111]})
    assert core.stats().num_generated_tokens == 3
