"""The scheduler's KV-connector calls: made at the right points, external
hits counted as computed, asynchronous loads parked in
WAITING_FOR_REMOTE_KVS, frees delayed until the worker's save is done."""

from __future__ import annotations

from engine_fakes import FakeRunner, SchedulerHarness, ScriptedConnector, make_scheduler

from kvstrata.enginecore.request import RequestStatus


def harness(kv_managers, connector, num_blocks=32) -> SchedulerHarness:
    sched = make_scheduler(num_blocks=num_blocks, connector=connector)
    kv_managers.append(sched.kv)
    return SchedulerHarness(sched.kv, sched, FakeRunner())


def test_calls_are_made_at_the_right_points(kv_managers):
    conn = ScriptedConnector(meta={"step": "opaque"})
    h = harness(kv_managers, conn)
    h.add("a", 6, max_tokens=1)
    so = h.step()
    assert so.kv_connector_metadata == {"step": "opaque"}
    blocks = h.runner.reqs["a"].block_ids
    assert conn.calls == [("match", "a", 0), ("alloc", "a", blocks, 0), ("meta", {"a": 6}),
                          ("finished", "a", blocks)]
    h.run_to_completion()


def test_external_hit_counts_as_computed(kv_managers):
    conn = ScriptedConnector(hits={"a": (8, False)})
    h = harness(kv_managers, conn)
    h.add("a", 10, max_tokens=1)
    so = h.step()
    assert so.num_scheduled_tokens == {"a": 2}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    h.run_to_completion()


def test_external_hit_never_covers_the_last_token(kv_managers):
    h = harness(kv_managers, ScriptedConnector(hits={"a": (12, False)}))
    h.add("a", 10, max_tokens=1)
    assert h.step().num_scheduled_tokens == {"a": 1}
    h.run_to_completion()


def test_async_load_parks_the_request_until_the_worker_reports_it(kv_managers):
    conn = ScriptedConnector(hits={"a": (8, True)})
    h = harness(kv_managers, conn)
    h.add("a", 10, max_tokens=1)
    h.add("b", 3, max_tokens=3)
    so = h.step()
    assert so.num_scheduled_tokens == {"b": 3}
    a = h.sched.requests["a"]
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS and h.kv.has_request("a")
    h.runner.finished_recving = ["a"]
    assert h.step().num_scheduled_tokens == {"b": 1}
    so = h.step()
    assert so.num_scheduled_tokens == {"a": 2, "b": 1}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    h.run_to_completion()


def test_delayed_free_holds_blocks_until_the_save_finishes(kv_managers):
    conn = ScriptedConnector(delay_free={"a"})
    h = harness(kv_managers, conn)
    h.add("a", 6, max_tokens=1)
    h.step()
    assert "a" not in h.sched.requests and h.kv.has_request("a")
    h.runner.finished_sending = ["a"]
    h.step()
    assert not h.kv.has_request("a")
