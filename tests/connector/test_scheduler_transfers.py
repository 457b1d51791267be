"""The scheduler's handling of connector results, against a scripted
connector and runner: a failed load (sync or async) rolls its request back to
the first failed block, never caches a failed block, and the request still
produces the same tokens; preempted requests are offered to the connector
before their blocks are freed."""

from __future__ import annotations

import conn_helpers  # noqa: F401  (puts tests/enginecore on sys.path)
import pytest
from engine_fakes import FakeRunner, SchedulerHarness, ScriptedConnector, make_scheduler

from kvstrata.enginecore.request import RequestStatus
from kvstrata.types import ModelRunnerOutput


class FailingLoadRunner(FakeRunner):
    """Reports ``fail[rid]`` (block indices into the request's table) invalid
    at the request's first step, withholding its sample and rolling its own
    copy back, as the model runner does when the connector says a load failed;
    and ``invalid_next`` (block ids of a parked request) with the next step."""

    def __init__(self, fail: dict[str, list[int]], **kw) -> None:
        super().__init__(**kw)
        self.fail = fail
        self.invalid_next: list[int] = []
        self.reported: list[int] = []

    def execute_model(self, so):
        out = super().execute_model(so)
        invalid, self.invalid_next = self.invalid_next, []
        sampled = list(out.sampled_token_ids)
        for rid, idx in list(self.fail.items()):
            st = self.reqs.get(rid)
            if st is None or (rid not in so.num_scheduled_tokens and rid not in out.finished_recving):
                continue
            del self.fail[rid]
            invalid += [st.block_ids[i] for i in idx]
            st.num_computed = min(idx) * self.block_size
            if rid in out.req_ids:
                j = out.req_ids.index(rid)
                if sampled[j]:
                    st.tokens.pop()
                    sampled[j] = []
        self.reported += invalid
        return ModelRunnerOutput(req_ids=out.req_ids, sampled_token_ids=sampled, finished_recving=out.finished_recving,
                                 finished_sending=out.finished_sending, invalid_block_ids=invalid)


class RecordingPreempts(ScriptedConnector):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.preempted: list[tuple[str, int, list[int]]] = []

    def request_preempted(self, request, block_ids):
        self.preempted.append((request.request_id, request.num_computed_tokens, list(block_ids[0])))


def harness(kv_managers, connector, runner, num_blocks=32) -> SchedulerHarness:
    sched = make_scheduler(num_blocks=num_blocks, connector=connector)
    kv_managers.append(sched.kv)
    return SchedulerHarness(sched.kv, sched, runner)


@pytest.fixture
def kv_managers():
    managers = []
    yield managers
    for kv in managers:
        assert kv.num_free_blocks == kv.num_blocks - 1


def reference_tokens(kv_managers, prompt, max_tokens) -> list[int]:
    h = harness(kv_managers, ScriptedConnector(), FakeRunner())
    h.add("ref", prompt, max_tokens=max_tokens)
    h.run_to_completion()
    return [t for o in h.outputs for t in o.new_token_ids]


def hits_of(h, prompt) -> int:
    probe = h.add("probe", prompt, max_tokens=1)
    _, n = h.kv.get_computed_blocks(probe)
    h.sched.finish_requests(["probe"], RequestStatus.FINISHED_ABORTED)
    return n


def test_a_failed_sync_load_rolls_back_and_recomputes(kv_managers):
    prompt = list(range(100, 120))
    expected = reference_tokens(kv_managers, prompt, 3)
    runner = FailingLoadRunner({"a": [2, 3]})
    h = harness(kv_managers, ScriptedConnector(hits={"a": (16, False)}), runner)
    h.add("a", prompt, max_tokens=3)
    so = h.step()
    assert so.num_scheduled_tokens == {"a": 4}  # 16 tokens "loaded", 4 computed
    a = h.sched.requests["a"]
    assert a.num_computed_tokens == 8 and a.status == RequestStatus.RUNNING
    assert a.all_token_ids == prompt  # the sample was withheld
    assert hits_of(h, prompt) == 0  # nothing of the failed load is cached
    so = h.step()
    assert so.scheduled_cached_reqs.num_computed_tokens == [8] and so.num_scheduled_tokens == {"a": 12}
    h.run_to_completion()
    assert [t for o in h.outputs for t in o.new_token_ids] == expected
    assert runner.reported == [3, 4]


def test_a_successful_sync_load_is_cached_after_the_step(kv_managers):
    prompt = list(range(200, 220))
    h = harness(kv_managers, ScriptedConnector(hits={"a": (16, False)}), FakeRunner())
    h.add("a", prompt, max_tokens=3)
    h.step()
    assert hits_of(h, prompt) == 16
    h.run_to_completion()


def test_a_failed_async_load_rolls_back_before_admission(kv_managers):
    prompt = list(range(300, 320))
    expected = reference_tokens(kv_managers, prompt, 2)
    runner = FailingLoadRunner({})
    h = harness(kv_managers, ScriptedConnector(hits={"a": (16, True)}), runner)
    h.add("a", prompt, max_tokens=2)
    assert h.step().num_scheduled_tokens == {}
    assert h.sched.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    runner.finished_recving = ["a"]
    runner.invalid_next = [h.kv.get_block_ids("a")[0][1]]
    h.step()
    so = h.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4 and so.num_scheduled_tokens == {"a": 16}
    h.run_to_completion()
    assert [t for o in h.outputs for t in o.new_token_ids] == expected


def test_aborting_an_async_load_never_caches_its_blocks(kv_managers):
    prompt = list(range(400, 420))
    h = harness(kv_managers, ScriptedConnector(hits={"a": (16, True)}), FakeRunner())
    h.add("a", prompt, max_tokens=2)
    h.step()
    h.sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert hits_of(h, prompt) == 0
    h.run_to_completion()


def test_the_connector_sees_a_preempted_request_before_its_blocks_are_freed(kv_managers):
    conn = RecordingPreempts()
    h = harness(kv_managers, conn, FakeRunner(), num_blocks=9)
    h.add("a", 12, max_tokens=12)
    h.add("b", 12, max_tokens=12)
    h.run_to_completion()
    assert conn.preempted, "the tiny pool must force a preemption"
    rid, computed, blocks = conn.preempted[0]
    assert rid == "b" and computed >= 12 and len(blocks) * 4 >= computed
