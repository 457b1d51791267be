"""The scheduler's decision objects alone: the TransferTracker turns a step's
connector results into exact decisions (which requests are cached, rolled
back to which position, freed), and ``admit`` sizes and reserves one waiting
request or refuses without changing anything."""

from __future__ import annotations

import pytest
from engine_fakes import EOS, ScriptedConnector, hasher_for, make_kv

from kvstrata.enginecore.request import Request, RequestStatus
from kvstrata.enginecore.scheduler.transfers import TransferTracker
from kvstrata.enginecore.scheduler.waiting import Admission, Refusal, admit
from kvstrata.types import ModelRunnerOutput, SamplingParams

BS = 4


def running(rid: str, num_computed: int) -> Request:
    req = Request(rid, list(range(100, 120)), SamplingParams(), eos_token_ids=(EOS,))
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = num_computed
    return req


def tracker(tables: dict[str, list[int]]) -> TransferTracker:
    return TransferTracker(BS, lambda rid: (tables[rid],))


def output(*, recving=(), sending=(), invalid=()) -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], finished_recving=list(recving),
                             finished_sending=list(sending), invalid_block_ids=list(invalid))


# -- TransferTracker ----------------------------------------------------------

def test_sync_loads_are_cached_or_rolled_back_to_their_first_failed_block():
    t = tracker({"ok": [1, 2, 3], "bad": [4, 5, 6, 7], "gone": [8, 9]})
    ok, bad, gone = running("ok", 12), running("bad", 16), running("gone", 8)
    for r in (ok, bad, gone):
        t.start_sync_load(r)
    gone.status = RequestStatus.FINISHED_ABORTED  # aborted while the step ran
    st = t.settle(output(invalid=[7, 6, 9]))
    assert st.evict == [6, 7, 9]
    assert st.cache == [ok]
    assert st.roll_back == [(bad, 8)]  # block 6 is the third: tokens 8.. recompute
    assert st.free == []
    assert not t.settle(output())  # the step's sync loads are settled once


def test_a_failed_block_past_the_computed_tokens_rolls_nothing_back_and_caches_nothing():
    t = tracker({"a": [1, 2, 3]})
    a = running("a", 8)
    t.start_sync_load(a)
    st = t.settle(output(invalid=[3]))
    assert (st.cache, st.roll_back, st.evict) == ([], [], [3])


def test_an_async_load_lands_once_reported_with_its_rollback_position():
    t = tracker({"a": [1, 2, 3, 4]})
    t.start_async_load("a")
    assert t.has_pending() and t.loading == {"a"}
    assert t.take_landed("a") is None  # not reported yet
    st = t.settle(output(recving=["a"], invalid=[3]))
    assert st.evict == [3] and st.cache == [] and st.roll_back == []
    assert t.loading == {"a"}  # loading until admitted
    landed = t.take_landed("a")
    assert landed is not None and landed.roll_back_to == 8
    assert t.loading == set() and not t.has_pending()
    assert t.take_landed("a") is None


def test_an_async_load_without_failures_lands_with_no_rollback():
    t = tracker({"a": [1, 2]})
    t.start_async_load("a")
    t.settle(output(recving=["a"], invalid=[9]))
    assert t.take_landed("a").roll_back_to is None


def test_a_second_report_keeps_the_first_rollback():
    t = tracker({"a": [1, 2, 3]})
    t.start_async_load("a")
    t.settle(output(recving=["a"], invalid=[2]))
    t.settle(output(recving=["a"]))
    assert t.take_landed("a").roll_back_to == 4


def test_a_forgotten_load_is_never_landed_and_says_it_was_in_flight():
    t = tracker({"a": [1, 2]})
    t.start_async_load("a")
    assert t.forget("a") is True  # its blocks must not be cached
    t.settle(output(recving=["a"], invalid=[1]))
    assert t.take_landed("a") is None and not t.has_pending()
    assert t.forget("a") is False


def test_a_delayed_free_is_freed_when_its_save_is_reported():
    t = tracker({})
    a, b = running("a", 4), running("b", 4)
    t.delay_free(a)
    t.delay_free(b)
    assert t.has_pending()
    st = t.settle(output(sending=["b", "unknown"]))
    assert st.free == [b] and st.cache == [] and st.evict == []
    assert t.has_pending()
    assert t.settle(output(sending=["a"])).free == [a]
    assert not t.has_pending()


def test_a_failed_step_forgets_its_sync_loads():
    t = tracker({"a": [1, 2]})
    t.start_sync_load(running("a", 8))
    t.step_failed()
    assert not t.settle(output())


# -- admit --------------------------------------------------------------------

def waiting_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=2), eos_token_ids=(EOS,),
                   block_hasher=hasher_for(BS), hash_block_size=BS)


def admit_args(**kw):
    args = dict(budget=64, long_prefill_threshold=0, chunked_prefill=True, enable_caching=True)
    args.update(kw)
    return args


def fields(a: Admission) -> tuple:
    return (a.num_computed, a.num_new, a.num_local, a.num_external, a.load_async)


@pytest.fixture
def kv(kv_managers):
    """A 16-block KV manager (block size 4), checked all free at the end."""
    kv = make_kv(16)
    kv_managers.append(kv)
    return kv


def cache_prefix(kv, tokens: list[int]) -> None:
    """Compute ``tokens`` once as request "warm" and free it: its full blocks stay cached."""
    warm = waiting_request("warm", tokens)
    kv.allocate_slots(warm, len(tokens))
    warm.num_computed_tokens = len(tokens)
    kv.free(warm)


def test_admit_takes_the_device_hit_then_the_external_one_and_reserves_the_rest(kv):
    cache_prefix(kv, list(range(100, 108)))
    conn = ScriptedConnector(hits={"a": (4, False)})
    req = waiting_request("a", list(range(100, 114)))
    a = admit(req, kv, conn, **admit_args())
    assert fields(a) == (12, 2, 8, 4, False)
    assert kv.get_block_ids("a") == ([1, 2, 3, 4],)  # the hit's two blocks, then new ones
    assert conn.calls == [("match", "a", 8), ("alloc", "a", [1, 2, 3, 4], 4)]
    assert req.num_computed_tokens == 0 and req.status == RequestStatus.WAITING  # the caller applies it
    kv.free(req)


def test_admit_never_counts_the_last_token_as_external(kv):
    req = waiting_request("a", list(range(10)))
    a = admit(req, kv, ScriptedConnector(hits={"a": (40, False)}), **admit_args())
    assert fields(a) == (9, 1, 0, 9, False)
    kv.free(req)


def test_admit_parks_an_async_load_with_nothing_to_compute(kv):
    req = waiting_request("a", list(range(10)))
    a = admit(req, kv, ScriptedConnector(hits={"a": (8, True)}), **admit_args())
    assert fields(a) == (8, 0, 0, 8, True)
    assert kv.get_block_ids("a") == ([1, 2],)
    kv.free(req)


def test_admit_resumes_a_request_that_holds_blocks_without_a_lookup(kv):
    req = waiting_request("a", list(range(10)))
    kv.allocate_slots(req, 0, num_external_computed_tokens=8, delay_cache_blocks=True)
    req.num_computed_tokens = 4  # rolled back after a failed block
    conn = ScriptedConnector(hits={"a": (8, True)})
    a = admit(req, kv, conn, **admit_args(long_prefill_threshold=3))
    assert fields(a) == (4, 3, 0, 0, False)
    assert conn.calls == [("alloc", "a", [1, 2], 0)]
    kv.free(req)


def test_admit_refuses_without_changing_anything(kv_managers):
    kv = make_kv(4)  # 3 usable blocks
    kv_managers.append(kv)
    req = waiting_request("a", list(range(10)))
    conn = ScriptedConnector()
    conn.get_num_new_matched_tokens = lambda r, n: (None, False)
    assert admit(req, kv, conn, **admit_args()) is Refusal.NOT_KNOWN
    assert admit(req, kv, ScriptedConnector(), **admit_args(budget=6, chunked_prefill=False)) is Refusal.NO_FIT
    big = waiting_request("big", list(range(13)))
    assert admit(big, kv, ScriptedConnector(), **admit_args()) is Refusal.NO_FIT
    assert not kv.has_request("a") and not kv.has_request("big") and kv.num_free_blocks == 3
    a = admit(req, kv, ScriptedConnector(), **admit_args(budget=6))
    assert fields(a) == (0, 6, 0, 0, False) and kv.get_block_ids("a") == ([1, 2],)
    kv.free(req)
