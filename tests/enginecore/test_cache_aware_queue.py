"""The cache-aware waiting queue: more cached tokens first, priorities still
win, and the aging bound holds: no request is passed over by later
arrivals more than ``max_skips`` times."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.enginecore.request import EngineRequest, Request
from kvstrata.enginecore.scheduler.queues import CacheAwareQueue
from kvstrata.types import SamplingParams


def req(i: int, priority: int = 0) -> Request:
    return Request(f"r{i}", [1, 2, 3], SamplingParams(), arrival_time=float(i), priority=priority)


def queue(scores: dict[str, int], **kw) -> CacheAwareQueue:
    q = CacheAwareQueue(**kw)
    q.scorer = lambda r: scores.get(r.request_id, 0)
    return q


def test_more_cached_tokens_first_ties_by_arrival_priorities_win():
    q = queue({"r2": 64, "r3": 64, "r4": 16})
    for i in range(5):
        q.add(req(i, priority=1 if i == 4 else 0))
    assert [q.pop().request_id for _ in range(5)] == ["r2", "r3", "r0", "r1", "r4"]
    q = queue({"r1": 64})
    q.add(req(0, priority=-1))  # a better priority class, nothing cached
    q.add(req(1))
    assert q.pop().request_id == "r0"


def test_a_request_passed_over_max_skips_times_goes_first():
    q = queue({}, max_skips=3, max_wait_s=1e9)
    q.add(req(0))  # nothing cached: every cached arrival passes it
    served = []
    for i in range(1, 10):
        r = req(i)
        q.scorer = (lambda r, i=i: 0 if r.request_id == "r0" else 100)
        q.add(r)
        served.append(q.pop().request_id)
    assert served.index("r0") == 3 and q.max_skips_seen == 3


def test_waiting_too_long_ages_a_request():
    now = [0.0]
    q = queue({"r1": 64}, max_skips=1000, max_wait_s=5.0)
    q.clock = lambda: now[0]
    q.add(req(0))
    q.add(req(1))
    now[0] = 6.0
    assert q.pop().request_id == "r0"  # waited past max_wait_s: ahead of the cached one


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 200)), max_size=80),
       max_skips=st.integers(0, 6))
def test_no_request_is_skipped_more_than_the_bound(ops, max_skips):
    """Random arrivals (score, priority) and admissions: the skip count of
    every request stays within max_skips; every request comes out once."""
    scores: dict[str, int] = {}
    q = queue(scores, max_skips=max_skips, max_wait_s=1e9)
    added, popped = [], []
    for i, (is_add, prio, score) in enumerate(ops):
        if is_add or not q:
            r = req(i, priority=prio % 2)
            scores[r.request_id] = score
            q.add(r)
            added.append(r.request_id)
        else:
            popped.append(q.pop().request_id)
    while q:
        popped.append(q.pop().request_id)
    assert sorted(popped) == sorted(added)
    assert q.max_skips_seen <= max_skips


def test_the_engine_admits_the_cached_request_first(make_core):
    """A pool-wide shared prefix is cached; of four waiting requests the two
    that extend it are admitted before the two earlier uncached ones."""
    core = make_core(num_blocks=64, policy="cache-aware", max_num_seqs=1)
    shared = list(range(10, 30))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    core.add_request(EngineRequest(request_id="seed", prompt_token_ids=shared + [1], sampling_params=params))
    while core.has_work():
        core.step()
    for rid, prompt in (("u1", list(range(100, 120))), ("u2", list(range(200, 220))),
                        ("c1", shared + [7, 8]), ("c2", shared + [9])):
        core.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params))
    order = []
    while core.has_work():
        so = core.schedule()
        order += [d.req_id for d in so.scheduled_new_reqs]
        if core.should_execute(so):
            core.update(so, core.execute(so))
    assert order[:2] == ["c1", "c2"] and sorted(order[2:]) == ["u1", "u2"]
    assert core.stats().extra["scheduler.cache_aware.max_skips_observed"] == 2


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 200)), max_size=80), max_skips=st.integers(0, 5))
def test_the_bound_holds_when_requests_go_back_to_the_front(ops, max_skips):
    """Admissions mixed with requests put back at the front (a preemption,
    or one parked for a load): the skip bound still holds."""
    scores: dict[str, int] = {}
    q = queue(scores, max_skips=max_skips, max_wait_s=1e9)
    for i, (op, score) in enumerate(ops):
        if op == 0 or not q:
            r = req(i)
            scores[r.request_id] = score
            q.add(r)
        elif op == 1:
            q.pop()
        else:
            q.prepend(q.pop())
    while q:
        q.pop()
    assert q.max_skips_seen <= max_skips
