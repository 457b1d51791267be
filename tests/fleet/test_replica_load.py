"""Replica: the one writer of its own state. Its load for the router
(``load_of``): before the engine has reported, the fleet's own requests in
flight there; after, the engine's report (every router's requests) plus
the fleet's requests it had not taken in yet (the newest ones sent after
the report's ``received`` count). Its liveness changes only through its
methods, which say whether it changed."""

from __future__ import annotations

import pytest

from kvstrata.fleet import Replica
from kvstrata.fleet.replica import load_of
from kvstrata.router import ReplicaLoad
from kvstrata.types import EngineLoad


async def _never():  # a connector the test never calls
    raise AssertionError


def test_replica_load_before_and_after_the_engines_reports():
    inflight = {"q1": 100, "q2": 120, "q3": 80}  # three requests in flight, 300 tokens to prefill
    assert load_of(inflight, None, 0, 3) == ReplicaLoad(queued_prefill_tokens=300, running_requests=3)
    report = EngineLoad(queued_prefill_tokens=1000, num_running=4, num_waiting=2)
    # q2 and q3 were sent after the engine's count: not in its report yet
    assert load_of(inflight, report, 1, 3) == ReplicaLoad(queued_prefill_tokens=1000 + 120 + 80,
                                                          running_requests=4 + 2 + 2)
    assert load_of(inflight, report, 3, 3) == ReplicaLoad(queued_prefill_tokens=1000, running_requests=6)
    inflight["q4"] = 50  # two more sends (q4, q5); q5 already ended here, and q1
    del inflight["q1"]
    assert load_of(inflight, report, 3, 5).running_requests == 6 + 2
    assert load_of(inflight, report, 9, 5) == ReplicaLoad(queued_prefill_tokens=1000, running_requests=6)


def test_a_replicas_requests_are_written_by_its_methods_only():
    r = Replica("r0", "remote", _never)
    r.dispatched("q1", 100)
    r.dispatched("q2", 120)
    r.dispatched("q3", -5)  # all of it cached
    assert (r.queued_prefill, r.running) == (220, 3)
    assert r.load() == ReplicaLoad(queued_prefill_tokens=220, running_requests=3)  # no client: ours only
    assert r.prefill_started("q1") and not r.prefill_started("q1") and not r.prefill_started("q3")
    assert (r.queued_prefill, r.running) == (120, 3)
    r.settled("q1")
    r.settled("q1")  # idempotent
    r.settled("unknown")
    assert list(r.inflight) == ["q2", "q3"] and r.queued_prefill == 120


def test_liveness_changes_only_through_the_replica_and_says_when_it_changed():
    r = Replica("r0", "remote", _never)
    assert not r.live and r.connection_lost() is None
    assert not r.mark_live()  # not connected: cannot serve
    assert not r.mark_down("x") and r.last_error is None  # was not live: no change, nothing recorded
    with pytest.raises(ValueError, match="kind"):
        Replica("r1", "elsewhere", _never)
