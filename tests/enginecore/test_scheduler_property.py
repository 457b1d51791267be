"""Property test: random workloads (arrivals, aborts, shared prefixes, tiny
pools) through a real Scheduler and KVCacheManager with the fake model.

After every step: the budget holds, running <= max_num_seqs, the blocks in
use are exactly those of the running requests (so a preemption freed exactly
its victim's blocks and nobody else lost any), the runner's block tables
built from the diffs equal the KV manager's. At the end: every request
finished, each produced exactly the tokens an undisturbed run would, and
every block is free (the autouse check in conftest).
"""

from __future__ import annotations

from engine_fakes import next_token
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.enginecore.request import RequestStatus

PREFIXES = [list(range(100, 130)), list(range(200, 230)), list(range(300, 330))]
MAX_PROMPT, MAX_OUT = 30, 10


# One request of a workload: its prompt (a shared prefix and its own tail),
# output length, priority, arrival step and abort step.
REQUEST = dict(
    prefix=st.integers(0, 2), shared=st.integers(0, MAX_PROMPT), tail=st.integers(0, 12),
    max_tokens=st.integers(1, MAX_OUT), priority=st.integers(0, 2),
    arrive=st.integers(0, 12), abort=st.one_of(st.none(), st.integers(0, 30)),
)


def draw_config(draw, bs: int, min_blocks: int) -> dict:
    """A harness config (pool of at least ``min_blocks``), drawn."""
    return dict(
        block_size=bs,
        num_blocks=draw(st.integers(min_blocks, min_blocks + 24)),
        caching=draw(st.booleans()),
        max_num_batched_tokens=draw(st.integers(2, 48)),
        max_num_seqs=draw(st.integers(1, 6)),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 8])),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
    )


def prompt_of(k: int, spec: dict) -> list[int]:
    prompt = PREFIXES[spec["prefix"]][: spec["shared"]] + [1000 + 50 * k + j for j in range(spec["tail"])]
    return prompt[:MAX_PROMPT] or [7]


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([2, 4]))
    cfg = draw_config(draw, bs, -(-(MAX_PROMPT + MAX_OUT) // bs) + 1)
    return cfg, draw(st.lists(st.fixed_dictionaries(REQUEST), min_size=1, max_size=10))


def expected_outputs(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def check_step(h, so, cfg, held_before):
    kv, sched = h.kv, h.sched
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= cfg["max_num_batched_tokens"]
    if cfg["long_prefill_token_threshold"] and len(so.num_scheduled_tokens) > 1:
        # the cap shares the budget among several requests (a lone one is uncapped)
        assert max(so.num_scheduled_tokens.values(), default=0) <= cfg["long_prefill_token_threshold"]
    assert len(sched.running) <= cfg["max_num_seqs"]
    held = {r.request_id: kv.get_block_ids(r.request_id)[0] for r in sched.running}
    in_use = kv.num_blocks - 1 - kv.num_free_blocks
    assert in_use == len(set().union(*held.values())), "blocks in use != blocks of running requests"
    for r in sched.waiting:
        assert not kv.has_request(r.request_id)
    for rid in so.preempted_req_ids:
        assert sched.requests[rid].status == RequestStatus.PREEMPTED
    for rid, before in held_before.items():
        if rid in held:  # still running: nothing of its table was taken
            assert held[rid][: len(before)] == before
    for rid, ids in held.items():
        assert h.runner.reqs[rid].block_ids == ids, "runner table (from diffs) != KV manager's"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workloads())
def test_random_workloads_keep_every_invariant(make_harness, workload):
    cfg, specs = workload
    h = make_harness(**cfg)
    prompts, aborted = {}, set()
    for step in range(400):
        for k, spec in enumerate(specs):
            rid = f"r{k}"
            if spec["arrive"] == step:
                prompts[rid] = prompt = prompt_of(k, spec)
                h.add(rid, prompt, max_tokens=spec["max_tokens"], priority=spec["priority"],
                      arrival=step + k / 100)
            if spec["abort"] == step and rid in h.sched.requests:
                h.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
                aborted.add(rid)
        if step > 12 and not h.sched.has_unfinished_requests():
            break
        held_before = {r.request_id: h.kv.get_block_ids(r.request_id)[0] for r in h.sched.running}
        so = h.sched.schedule()
        out = h.runner.execute_model(so)
        check_step(h, so, cfg, held_before)
        h.outputs.extend(h.sched.update_from_output(so, out))
    assert not h.sched.has_unfinished_requests(), "requests did not finish"
    got: dict[str, list[int]] = {}
    reasons = {}
    for o in h.outputs:
        got.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.finished:
            reasons[o.request_id] = o.finish_reason
    for k, spec in enumerate(specs):
        rid = f"r{k}"
        want = expected_outputs(prompts[rid], spec["max_tokens"])
        if rid in aborted:
            assert want[: len(got.get(rid, []))] == got.get(rid, [])
        else:
            assert got[rid] == want and reasons[rid] == "length"
