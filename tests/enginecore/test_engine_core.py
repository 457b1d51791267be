"""EngineCore: admission (duplicates, overload), abort, a failing step, and
sizing from the runner. Checks of a request's fields, text and stop strings
are the client's: tests/enginecore/test_processing.py."""

from __future__ import annotations

import pytest
from engine_fakes import FakeRunner, next_token

from kvstrata.config import CacheConfig, EngineConfig
from kvstrata.enginecore.builder import build_engine_core
from kvstrata.enginecore.engine_core import EngineCore
from kvstrata.errors import EngineOverloadedError, RequestError
from kvstrata.enginecore.request import EngineRequest
from kvstrata.types import SamplingParams


def req(rid: str, prompt=(5, 6, 7, 8, 9), **params) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=list(prompt),
                         sampling_params=SamplingParams(**{"max_tokens": 3, **params}))


def run(core: EngineCore, max_steps: int = 200) -> dict[str, list]:
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)
        if not core.has_work():
            return outs
    raise AssertionError("engine did not drain")


def test_duplicate_live_id_is_rejected_and_reusable_after_finish(make_core):
    core = make_core()
    core.add_request(req("same"))
    with pytest.raises(RequestError) as info:
        core.add_request(req("same"))
    assert info.value.field == "request_id"
    run(core)
    core.add_request(req("same"))
    assert run(core)["same"][-1].finished


def test_full_waiting_queue_rejects_with_the_limit(make_core):
    core = make_core(max_waiting_requests=2)
    core.add_request(req("a"))
    core.add_request(req("b"))
    with pytest.raises(EngineOverloadedError, match="max_waiting_requests=2"):
        core.add_request(req("c"))
    core.abort_requests(["a", "b"])
    core.add_request(req("c"))
    run(core)


def test_abort_is_a_noop_for_unknown_and_finished(make_core):
    core = make_core()
    core.add_request(req("a", max_tokens=1))
    run(core)
    assert core.abort_requests(["a", "never"]) == []


def test_abort_frees_blocks_and_emits_a_final_output(make_core):
    core = make_core(num_blocks=32)
    core.add_request(req("a", max_tokens=10))
    core.step()
    assert core.kv.num_free_blocks < 31
    [out] = core.abort_requests(["a"])
    assert (out.finished, out.finish_reason) == (True, "abort")
    assert core.kv.num_free_blocks == 31
    run(core)


def test_failed_step_errors_its_requests_uncaches_their_blocks_and_serves_on(make_core):
    runner = FakeRunner(fail_steps={0})
    core = make_core(runner)
    prompt = list(range(10, 19))
    core.add_request(req("a", prompt))
    outs = core.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "error")]
    assert "injected failure" in outs[0].error
    # a's first two blocks were cached when allocated, but never written: no hit.
    core.add_request(req("b", prompt))
    so = core.schedule()
    assert so.num_scheduled_tokens == {"b": 9}
    core.update(so, core.execute(so))
    outs = run(core)
    assert outs["b"][-1].finish_reason == "length"
    assert core.consecutive_failed_steps == 0 and core.num_failed_steps == 1


def test_abort_during_a_failing_step_also_uncaches(make_core):
    core = make_core(FakeRunner(fail_steps={0}))
    prompt = list(range(10, 19))
    core.add_request(req("a", prompt))
    so = core.schedule()
    core.abort_requests(["a"])  # the step is "in flight"
    with pytest.raises(RuntimeError):
        core.execute(so)
    assert core.fail_step(so, RuntimeError("boom")) == []
    core.add_request(req("b", prompt))
    assert core.schedule().num_scheduled_tokens == {"b": 9}
    core.abort_requests(["b"])
    run(core)


def test_outputs_follow_the_model_and_count_in_stats(make_core):
    core = make_core()
    core.add_request(req("a", (5, 6, 7, 8, 9), max_tokens=4))
    outs = run(core)["a"]
    tokens = [5, 6, 7, 8, 9]
    for _ in range(4):
        tokens.append(next_token(tokens))
    assert [t for o in outs for t in o.new_token_ids] == tokens[5:]
    stats = core.stats()
    assert (stats.num_finished, stats.num_generated_tokens, stats.num_prompt_tokens) == (1, 4, 5)
    assert stats.num_running == stats.num_waiting == 0


def test_pool_size_from_memory_and_identity_from_the_runner(kv_managers):
    runner = FakeRunner()
    config = EngineConfig(cache=CacheConfig(block_size=4, kv_cache_memory_mib=2))
    core = build_engine_core(config, runner)
    kv_managers.append(core.kv)
    assert core.kv.num_blocks == runner.num_blocks == 2048
    assert core.identity.model_fingerprint == "fake-runner-v1"


def test_stats_report_the_kv_managers_prefix_counts_and_block_residency(kv_managers):
    config = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=10, metrics_sample_rate=1.0))
    core = build_engine_core(config, FakeRunner())  # 9 usable blocks
    kv_managers.append(core.kv)
    prompt = list(range(10, 19))  # two full blocks and one token
    for rid in ("a", "b"):
        core.add_request(req(rid, prompt, max_tokens=1))
        run(core)
    core.add_request(req("c", range(20, 55), max_tokens=1))  # 9 blocks: evicts every cached one
    run(core)
    stats = core.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (9 + 9 + 35, 8)
    assert stats.extra["kv.prefix_cache.requests"] == 3
    assert stats.extra["kv.prefix_cache.preempted_queries"] == 0
    r = stats.block_residency
    assert (r.sample_rate, r.num_samples, r.num_reuses) == (1.0, 2, 2)  # a's blocks, hit once by b
    assert r.lifetime_s.count == r.idle_before_eviction_s.count == 2 and r.reuse_gap_s.count == 2
    assert core.stats() == stats  # counts since start: reading changes nothing


# -- one hash pass: a fleet router's chain comes with the request ------------

def _own_chain(core: EngineCore, prompt) -> list[bytes]:
    from kvstrata.router.hashes import PromptHasher
    return PromptHasher(core.identity).hash_prompt(list(prompt))


def test_a_given_chain_of_the_right_shape_is_taken_as_is_not_rehashed(make_core):
    core = make_core()
    prompt = list(range(10, 20))  # 10 tokens, 4-token blocks: 2 full blocks
    size = core.block_hasher.hash_fn.digest_size
    # Not the prompt's real hashes: had the engine hashed, they would differ.
    marked = [bytes([1]) * size, bytes([2]) * size]
    core.add_request(EngineRequest(request_id="x", prompt_token_ids=prompt, block_hashes=marked,
                                   sampling_params=SamplingParams(max_tokens=3, ignore_eos=True)))
    assert core.scheduler.requests["x"].block_hashes == marked
    out = run(core)
    assert out["x"][-1].finished
    stats = core.stats().extra
    assert stats["engine.given_chains"] == 1 and stats["engine.given_chains_refused"] == 0


def test_the_real_chain_given_gives_the_same_hits_as_the_engines_own(make_core):
    core = make_core()
    prompt = list(range(30, 47))  # 17 tokens: 4 full blocks
    core.add_request(req("a", prompt))
    run(core)
    core.add_request(EngineRequest(request_id="b", prompt_token_ids=prompt, block_hashes=_own_chain(core, prompt),
                                   sampling_params=SamplingParams(max_tokens=3)))
    outs = run(core)
    assert outs["b"][-1].num_cached_tokens == 16
    assert core.stats().extra["engine.given_chains"] == 1


@pytest.mark.parametrize("bad", ["short", "long", "digest"])
def test_a_chain_of_the_wrong_shape_is_ignored_and_the_engine_hashes(make_core, bad):
    core = make_core()
    prompt = list(range(10, 20))
    good = _own_chain(core, prompt)
    size = core.block_hasher.hash_fn.digest_size
    given = {"short": good[:1], "long": good + [bytes(size)], "digest": [h[:8] for h in good]}[bad]
    core.add_request(EngineRequest(request_id="x", prompt_token_ids=prompt, block_hashes=given,
                                   sampling_params=SamplingParams(max_tokens=1)))
    assert core.scheduler.requests["x"].block_hashes == good
    run(core)
    assert core.stats().extra["engine.given_chains_refused"] == 1


def test_an_engine_with_a_private_hash_root_never_takes_a_chain(make_core, kv_managers):
    from engine_fakes import FakeRunner, engine_config
    config = engine_config()
    config.cache.random_hash_root = True
    core = build_engine_core(config, FakeRunner())
    kv_managers.append(core.kv)
    prompt = list(range(10, 20))
    public = _own_chain(core, prompt)
    core.add_request(EngineRequest(request_id="x", prompt_token_ids=prompt, block_hashes=public,
                                   sampling_params=SamplingParams(max_tokens=1)))
    assert core.scheduler.requests["x"].block_hashes != public
    run(core)
    assert core.stats().extra["engine.given_chains_refused"] == 1
