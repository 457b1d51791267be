"""Scheduler unit tests: exact tokens scheduled per step in small scenarios
(block size 4), over a real KVCacheManager and the scripted FakeRunner."""

from __future__ import annotations

from engine_fakes import EOS, FakeRunner, SchedulerHarness

from kvstrata.config import SchedulerConfig
from kvstrata.enginecore.request import RequestStatus
from kvstrata.enginecore.scheduler import Scheduler
from kvstrata.kv import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager


def schedules(h: SchedulerHarness) -> list[dict[str, int]]:
    h.run_to_completion()
    return [s for s in h.runner.steps if s]


def test_budget_split_and_chunked_prefill(make_harness):
    h = make_harness(max_num_batched_tokens=10)
    for rid in "ABC":
        h.add(rid, 7, max_tokens=2)
    assert schedules(h) == [
        {"A": 7, "B": 3},
        {"A": 1, "B": 4, "C": 5},
        {"B": 1, "C": 2},
        {"C": 1},
    ]


def test_long_prefill_threshold_caps_each_chunk(make_harness):
    h = make_harness(long_prefill_token_threshold=4)
    h.add("A", 10, max_tokens=2)
    h.add("B", 10, max_tokens=2)
    assert schedules(h) == [
        {"A": 4, "B": 4},
        {"A": 4, "B": 4},
        {"A": 2, "B": 2},
        {"A": 1, "B": 1},
    ]


def test_long_prefill_threshold_shares_the_budget_among_concurrent_prefills(make_harness):
    # vLLM's scenario: budget 1024, threshold 400, three 800-token prompts.
    h = make_harness(num_blocks=700, max_model_len=2048, max_num_batched_tokens=1024,
                     long_prefill_token_threshold=400)
    for rid in "ABC":
        h.add(rid, 800, max_tokens=1)
    assert h.step().num_scheduled_tokens == {"A": 400, "B": 400, "C": 224}
    # A and B finish their prefills; C's chunk is capped, then cut by the budget.
    assert h.step().num_scheduled_tokens == {"A": 400, "B": 400, "C": 224}
    h.run_to_completion()


def test_long_prefill_threshold_does_not_cap_a_lone_request(make_harness):
    # Nobody else wants the budget: the request gets all of it (as in vLLM,
    # first-token latency is not traded for a fairness nobody needs).
    h = make_harness(num_blocks=700, max_model_len=2048, max_num_batched_tokens=1024,
                     long_prefill_token_threshold=400)
    h.add("A", 800, max_tokens=2)
    assert h.step().num_scheduled_tokens == {"A": 800}
    h.add("B", 800, max_tokens=1)  # now two compete: both capped again
    assert h.step().num_scheduled_tokens == {"A": 1, "B": 400}
    h.run_to_completion()


def test_running_first_then_waiting_in_arrival_order(make_harness):
    h = make_harness(max_num_batched_tokens=6)
    h.add("A", 4, max_tokens=3)
    h.step()
    h.add("B", 8, max_tokens=1)
    h.add("C", 2, max_tokens=1)
    # A's decode comes first; B takes what is left; C waits for the budget.
    assert h.step().num_scheduled_tokens == {"A": 1, "B": 5}
    assert h.step().num_scheduled_tokens == {"A": 1, "B": 3, "C": 2}
    h.run_to_completion()


def test_max_num_seqs_holds_back_waiting_requests(make_harness):
    h = make_harness(max_num_seqs=2)
    h.add("A", 4, max_tokens=1)
    h.add("B", 4, max_tokens=3)
    h.add("C", 4, max_tokens=1)
    assert schedules(h) == [{"A": 4, "B": 4}, {"B": 1, "C": 4}, {"B": 1}]


def test_chunked_prefill_disabled_waits_for_a_whole_prompt(make_harness):
    h = make_harness(max_num_batched_tokens=8, enable_chunked_prefill=False)
    h.add("A", 6, max_tokens=2)
    h.add("B", 6, max_tokens=1)
    assert schedules(h) == [{"A": 6}, {"A": 1, "B": 6}]


def test_prefix_hit_skips_cached_blocks(make_harness):
    h = make_harness()
    h.add("A", list(range(10, 20)), max_tokens=1)
    h.run_to_completion()
    h.add("B", list(range(10, 18)) + [40, 41], max_tokens=1)
    so = h.step()
    assert so.num_scheduled_tokens == {"B": 2}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    h.run_to_completion()
    assert h.outputs[-1].request_id == "B" and h.outputs[-1].num_cached_tokens == 8
    assert h.kv.prefix_cache_totals().hits == 8  # the KV cache manager counts prefix hits
    assert h.kv.prefix_cache_totals().queries == 20


def test_whole_prompt_hit_still_computes_the_last_block(make_harness):
    h = make_harness()
    prompt = list(range(10, 18))
    h.add("A", prompt, max_tokens=1)
    h.run_to_completion()
    h.add("B", prompt, max_tokens=1)
    so = h.step()
    # A hit never covers the whole prompt: the last token must yield logits.
    assert so.num_scheduled_tokens == {"B": 4}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4
    h.run_to_completion()


def test_prefix_caching_off_never_hits(make_harness):
    h = make_harness(caching=False)
    h.add("A", list(range(10, 20)), max_tokens=1)
    h.run_to_completion()
    h.add("B", list(range(10, 20)), max_tokens=1)
    assert h.step().num_scheduled_tokens == {"B": 10}
    h.run_to_completion()


def test_preemption_takes_the_latest_arrival_under_fcfs(make_harness):
    h = make_harness(num_blocks=7)  # 6 usable blocks
    h.add("A", list(range(10, 18)), max_tokens=3)
    h.add("B", list(range(20, 28)), max_tokens=3)
    h.add("C", list(range(30, 38)), max_tokens=3)
    assert h.step().num_scheduled_tokens == {"A": 8, "B": 8, "C": 8}
    so = h.step()
    assert so.num_scheduled_tokens == {"A": 1, "B": 1}
    assert so.preempted_req_ids == ["C"]
    assert h.sched.requests["C"].status == RequestStatus.PREEMPTED
    assert h.sched.counters.num_preemptions == 1
    # No admission while blocks are short; C comes back with its output so far.
    assert h.step().num_scheduled_tokens == {"A": 1, "B": 1}
    so = h.step()
    assert so.num_scheduled_tokens == {"C": 9}
    assert so.scheduled_new_reqs[0].token_ids == h.sched.requests["C"].all_token_ids[:9]
    h.run_to_completion()
    c_tokens = [o.new_token_ids[0] for o in h.outputs if o.request_id == "C"]
    assert len(c_tokens) == 3


def test_preempted_victim_keeps_its_full_blocks_cached(make_harness):
    h = make_harness(num_blocks=8)  # 7 usable: A and B both grow, one block is spare
    h.add("A", list(range(10, 18)), max_tokens=3)
    h.add("B", list(range(20, 28)), max_tokens=3)
    h.add("C", list(range(30, 38)), max_tokens=3)
    h.step()
    so = h.step()
    assert so.preempted_req_ids == ["C"]
    h.step()
    so = h.step()
    # C's first block survived in the prefix cache: only 5 of its 9 tokens are recomputed.
    assert so.num_scheduled_tokens == {"C": 5}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4
    h.run_to_completion()


def test_priority_policy_admits_lower_values_first(make_harness):
    h = make_harness(policy="priority", max_num_seqs=1)
    h.add("A", 4, max_tokens=1, priority=1, arrival=0.0)
    h.add("B", 4, max_tokens=1, priority=0, arrival=1.0)
    h.add("C", 4, max_tokens=1, priority=0, arrival=2.0)
    assert schedules(h) == [{"B": 4}, {"C": 4}, {"A": 4}]


def test_priority_policy_preempts_the_lowest_priority(make_harness):
    h = make_harness(policy="priority", num_blocks=5)  # 4 usable
    h.add("A", list(range(10, 18)), max_tokens=2, priority=1, arrival=0.0)
    h.add("B", list(range(20, 28)), max_tokens=2, priority=0, arrival=1.0)
    assert h.step().num_scheduled_tokens == {"B": 8, "A": 8}
    so = h.step()
    assert so.preempted_req_ids == ["A"]
    assert so.num_scheduled_tokens == {"B": 1}
    h.run_to_completion()


def test_fcfs_preempts_the_later_arrival_whatever_its_priority(make_harness):
    h = make_harness(num_blocks=5)
    h.add("A", list(range(10, 18)), max_tokens=2, priority=1, arrival=0.0)
    h.add("B", list(range(20, 28)), max_tokens=2, priority=0, arrival=1.0)
    h.step()
    so = h.step()
    assert so.preempted_req_ids == ["B"]
    assert so.num_scheduled_tokens == {"A": 1}
    h.run_to_completion()


def test_preempting_an_already_scheduled_request_returns_its_budget(make_harness):
    # Running order is [B, A] (B was admitted first: lower priority value);
    # B is scheduled, then A's allocation fails and the victim (largest key) is B.
    h = make_harness(policy="priority", num_blocks=6)  # 5 usable
    h.add("B", list(range(20, 28)), max_tokens=5, priority=1, arrival=1.0)
    h.step()
    h.add("A", list(range(10, 18)), max_tokens=2, priority=0, arrival=0.0)
    assert h.step().num_scheduled_tokens == {"B": 1, "A": 8}
    so = h.step()
    assert so.preempted_req_ids == ["B"] and so.num_scheduled_tokens == {"A": 1}
    assert so.total_num_scheduled_tokens == 1
    h.run_to_completion()


def test_a_victim_scheduled_earlier_in_the_step_leaves_no_uncomputed_block_cached(make_harness):
    # Running order is [B, A]. B's third chunk is allocated (allocate_slots
    # caches blocks 4 and 5 as it hands them out), then A's decode finds no
    # room and the victim is B: that chunk is never computed, so only B's 16
    # computed tokens may be hit afterwards, not block 4 (freed tail first,
    # block 5 goes to A and block 4 would survive in the cache).
    h = make_harness(policy="priority", num_blocks=8, long_prefill_token_threshold=8)  # 7 usable
    prompt = list(range(100, 124))
    h.add("B", prompt, max_tokens=2, priority=1, arrival=0.0)
    # X keeps B from being a lone request (which the threshold would not cap)
    h.add("X", [900, 901], max_tokens=1, priority=2, arrival=0.5)
    assert h.step().num_scheduled_tokens == {"B": 8, "X": 2}
    h.add("A", list(range(10, 14)), max_tokens=3, priority=0, arrival=1.0)
    assert h.step().num_scheduled_tokens == {"B": 8, "A": 4}
    so = h.step()
    assert so.preempted_req_ids == ["B"] and so.num_scheduled_tokens == {"A": 1}
    probe = h.add("probe", prompt + [7], max_tokens=1)
    assert h.kv.get_computed_blocks(probe)[1] == 16
    h.sched.finish_requests(["probe"], RequestStatus.FINISHED_ABORTED)
    h.run_to_completion()


class CountingKV(KVCacheManager):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.allocs: list[int] = []
        self.caches: list[int] = []

    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        self.allocs.append(request.num_computed_tokens + num_new_tokens)
        return super().allocate_slots(request, num_new_tokens, *args, **kwargs)

    def cache_blocks(self, request, num_computed_tokens):
        self.caches.append(num_computed_tokens)
        return super().cache_blocks(request, num_computed_tokens)


def test_decode_within_a_block_skips_the_kv_manager(kv_managers):
    cfg = KVCacheConfig(num_blocks=16, groups=[KVCacheGroupSpec(
        layer_names=["layer.0"], spec=FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=4))])
    kv = CountingKV(cfg, max_model_len=64, enable_caching=True, log_stats=False,
                    enable_events=False, metrics_sample_rate=0.0)
    kv_managers.append(kv)
    h = SchedulerHarness(kv, Scheduler(SchedulerConfig(), kv, max_model_len=64), FakeRunner())
    a = h.add("A", 5, max_tokens=8)
    h.run_to_completion()
    # Positions 0..11 are computed: blocks are needed for 5 tokens, then at 9;
    # the other six decode steps never call the KV manager.
    assert kv.allocs == [5, 9]
    # The block filled at 8 tokens is cached by the allocation at 9, the one
    # filled at 12 when the request is freed: all three can be hit.
    assert kv.caches == [12]
    h.add("B", a.all_token_ids[:12] + [3], max_tokens=1)
    assert h.step().scheduled_new_reqs[0].num_computed_tokens == 12
    h.run_to_completion()


def test_stop_conditions(make_harness):
    h = make_harness(script={"eos": [5, EOS], "stopid": [5, 6, 7], "min": [EOS, EOS, 9],
                             "ign": [EOS, EOS]})
    h.add("eos", 4, max_tokens=10)
    h.add("stopid", 4, max_tokens=10, stop_token_ids=[6])
    h.add("min", 4, max_tokens=3, min_tokens=2)
    h.add("ign", 4, max_tokens=2, ignore_eos=True)
    h.run_to_completion()
    final = {o.request_id: o for o in h.outputs if o.finished}
    assert (final["eos"].finish_reason, final["eos"].stop_reason) == ("stop", None)
    assert (final["stopid"].finish_reason, final["stopid"].stop_reason) == ("stop", 6)
    # EOS before min_tokens outputs is not a stop; the second one is.
    assert final["min"].finish_reason == "stop"
    assert [o.new_token_ids[0] for o in h.outputs if o.request_id == "min"] == [EOS, EOS]
    assert final["ign"].finish_reason == "length"


def test_max_model_len_ends_a_request(make_harness):
    h = make_harness(max_model_len=12)
    h.add("A", 10, max_tokens=100)
    h.run_to_completion()
    outs = [o for o in h.outputs if o.request_id == "A"]
    assert len(outs) == 2 and outs[-1].finish_reason == "length"


def test_finish_requests_is_a_noop_for_unknown_and_finished(make_harness):
    h = make_harness()
    h.add("A", 4, max_tokens=1)
    h.run_to_completion()
    assert h.sched.finish_requests(["A", "nope"], RequestStatus.FINISHED_ABORTED) == []


def test_abort_frees_blocks_at_once(make_harness):
    h = make_harness(num_blocks=16)
    h.add("A", 9, max_tokens=5)
    h.add("B", 3, max_tokens=5)
    h.step()
    assert h.kv.num_free_blocks == 15 - 3 - 1
    done = h.sched.finish_requests(["A", "B"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["A", "B"]
    assert h.kv.num_free_blocks == 15
    assert sorted(h.sched.schedule().finished_req_ids) == ["A", "B"]
    assert not h.sched.running and not h.sched.waiting


def test_load_counts_what_is_left_to_prefill_waiting_and_running(make_harness):
    """``Scheduler.load`` (the engine's LoadReports to routers): waiting
    requests' uncomputed tokens, running ones' rest of prefill (decodes add
    nothing), request counts; a preempted request counts its whole recompute."""
    from kvstrata.types import EngineLoad

    h = make_harness(max_num_batched_tokens=10)
    assert h.sched.load() == EngineLoad()
    h.add("a", 16, max_tokens=3)
    h.add("b", 6, max_tokens=3)
    assert h.sched.load() == EngineLoad(queued_prefill_tokens=22, num_running=0, num_waiting=2)
    h.step()  # a: 10 of 16
    assert h.sched.load() == EngineLoad(queued_prefill_tokens=6 + 6, num_running=1, num_waiting=1)
    h.step()  # a: 16 of 16 (first token), b: 4 of 6
    assert h.sched.load() == EngineLoad(queued_prefill_tokens=2, num_running=2, num_waiting=0)
    h.step()
    assert h.sched.load().queued_prefill_tokens == 0  # both decoding
    h.run_to_completion()
    assert h.sched.load() == EngineLoad()

    h = make_harness(num_blocks=7)  # 6 usable blocks: the third request is preempted at its first decode
    for name, base in (("A", 10), ("B", 20), ("C", 30)):
        h.add(name, list(range(base, base + 8)), max_tokens=3)
    h.step()
    assert h.step().preempted_req_ids == ["C"]
    c = h.sched.requests["C"]
    assert h.sched.load() == EngineLoad(queued_prefill_tokens=c.num_tokens, num_running=2, num_waiting=1)
    assert c.num_tokens == 9  # its prompt and the token it had sampled: all recomputed
    h.run_to_completion()
