"""The scheduler's KV-connector calls: made at the right points, external
hits counted as computed, asynchronous loads parked in
WAITING_FOR_REMOTE_KVS, frees delayed until the worker's save is done."""

from __future__ import annotations

from engine_fakes import FakeRunner, SchedulerHarness, ScriptedConnector, make_scheduler

from kvstrata.enginecore.request import RequestStatus
from kvstrata.types import ModelRunnerOutput


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


# -- async scheduling: the next step is planned before this one's output ------

PROMPT = list(range(100, 120))


def test_an_abort_during_a_sync_load_caches_none_of_its_blocks(kv_managers):
    """A request aborted while the step filling its external blocks (a sync
    load) is in flight: those blocks may never arrive, so they are freed
    uncached. Cached, a request admitted next with the same prompt would
    compute on them, and the load's failure (reported a step later) could
    no longer roll it back."""
    from kvstrata.types import ModelRunnerOutput

    h = harness(kv_managers, ScriptedConnector(hits={"a": (16, False)}))
    sched = h.sched
    h.add("a", PROMPT, max_tokens=3)
    loading = sched.schedule()  # a's 16 tokens are loaded within this step
    a_blocks = sched.kv.get_block_ids("a")[0]
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # while the step runs
    h.add("q", PROMPT, max_tokens=3)
    behind = sched.schedule()  # planned before the loading step's output
    assert behind.scheduled_new_reqs[0].num_computed_tokens == 0  # no hit on a's unfilled blocks
    out = h.runner.execute_model(loading)
    sched.update_from_output(loading, ModelRunnerOutput(req_ids=out.req_ids, sampled_token_ids=[[] for _ in out.req_ids],
                                                        invalid_block_ids=a_blocks[2:4]))
    sched.update_from_output(behind, h.runner.execute_model(behind))
    h.run_to_completion()


def test_a_reused_request_id_does_not_take_the_old_requests_load_report(kv_managers):
    """Request a is aborted while the step carrying its async (bulk) load is
    in flight, and a new request takes the id. The report of the old load
    (by id, from that step) is not the new one's: the new a stays parked
    until its own load is reported."""
    conn = ScriptedConnector(hits={"a": (16, True)}, meta={"transfers": "every step's"})  # loads ride on metadata
    h = harness(kv_managers, conn)
    sched, runner = h.sched, h.runner
    h.add("a", PROMPT, max_tokens=3)
    h.step()
    carrying = sched.schedule()  # a's load rides on this step
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # while it runs
    h.add("a", PROMPT, max_tokens=3)  # the id is free again
    behind = sched.schedule()  # planned before the carrying step's output: the new a parks
    assert sched.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    runner.finished_recving = ["a"]  # the old a's load, reported by the step that carried it
    sched.update_from_output(carrying, runner.execute_model(carrying))
    runner.finished_recving = []
    sched.update_from_output(behind, runner.execute_model(behind))
    so = h.step()
    assert "a" not in so.num_scheduled_tokens  # still waiting for its own load
    assert sched.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    runner.finished_recving = ["a"]  # now its own
    h.step()
    runner.finished_recving = []
    so = h.step()
    assert so.num_scheduled_tokens == {"a": 4} and so.scheduled_new_reqs[0].num_computed_tokens == 16
    h.run_to_completion()


class _SplitConnector(ScriptedConnector):
    """A split tier hit for ``b``: compute its first 8 tokens, then load 15."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("match", request.request_id, num_computed_tokens))
        return (15, False) if request.request_id == "b" and num_computed_tokens >= 8 else (0, False)

    def load_point(self, request):
        return 8 if request.request_id == "b" and request.num_computed_tokens < 8 else None


def test_a_split_load_that_finds_no_room_behind_a_step_in_flight_is_asked_again(kv_managers):
    """b computes the front of a split hit, then its load is answered while
    a step is in flight and the pool has no room: b waits for that step
    rather than preempting itself. Its load must still be there for it next
    step (the connector holds the chunks for it), not recomputed."""
    conn = _SplitConnector()
    h = harness(kv_managers, conn, num_blocks=12)  # 11 usable
    sched, runner = h.sched, h.runner
    h.add("a", 20, max_tokens=2)
    b = h.add("b", 24, max_tokens=1)
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 20, "b": 8}  # b's front, up to its load point
    second = sched.schedule()  # in flight behind the first: a's decode takes a block, b finds 3 of 4
    assert second.num_scheduled_tokens == {"a": 1}
    assert ("match", "b", 8) in conn.calls and b.load_at == 8
    sched.update_from_output(first, runner.execute_model(first))
    sched.update_from_output(second, runner.execute_model(second))  # a finishes: its blocks are free
    third = sched.schedule()
    assert third.num_scheduled_tokens == {"b": 1}
    assert [c for c in conn.calls if c[0] == "alloc" and c[1] == "b"][-1][3] == 15
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    sched.update_from_output(third, ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
    h.run_to_completion()
