"""Replica.load: the router's view of one replica's work. Before the engine
has reported, the fleet's own requests in flight there; after, the engine's
report (every router's requests) plus the fleet's requests it had not taken
in yet (the newest ones sent after the report's ``received`` count)."""

from __future__ import annotations

from types import SimpleNamespace

from kvstrata.fleet import Replica
from kvstrata.router import ReplicaLoad
from kvstrata.types import EngineLoad


async def _never():  # a connector the test never calls
    raise AssertionError


def test_replica_load_before_and_after_the_engines_reports():
    r = Replica("r0", "remote", _never)
    r.queued_prefill = 300
    r.inflight = {"q1": 100, "q2": 120, "q3": 80}  # three requests in flight
    assert r.load() == ReplicaLoad(queued_prefill_tokens=300, running_requests=3)  # no client: ours only
    r.client = SimpleNamespace(num_requests_sent=3)
    assert r.load() == ReplicaLoad(queued_prefill_tokens=300, running_requests=3)  # no report yet
    r.note_load(EngineLoad(queued_prefill_tokens=1000, num_running=4, num_waiting=2), 1)
    # q2 and q3 were sent after the engine's count: not in its report yet
    assert r.load() == ReplicaLoad(queued_prefill_tokens=1000 + 120 + 80, running_requests=4 + 2 + 2)
    r.note_load(r.engine_load, 3)
    assert r.load() == ReplicaLoad(queued_prefill_tokens=1000, running_requests=6)
    r.client = SimpleNamespace(num_requests_sent=5)  # two sends (q4, q5), q5 already ended here; q1 ended too
    r.inflight["q4"] = 50
    del r.inflight["q1"]
    assert r.load().running_requests == 6 + 2

    r.load_at -= 3.5  # no report for longer than LOAD_REPORT_STALE_S: our own counts stand in
    assert r.load() == ReplicaLoad(queued_prefill_tokens=300, running_requests=3)
