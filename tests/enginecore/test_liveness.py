"""No configuration of pool size and concurrency hangs: waiting requests that
hold blocks for a landed async KV load give them back when the request at
the head of the queue (or a running one) cannot get room, so the engine
always makes progress; every block is free at the end."""

from __future__ import annotations

from engine_fakes import EOS, ScriptedConnector, next_token
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st



class TierConnector(ScriptedConnector):
    """A connector whose tier holds the first ``hits[rid]`` tokens of each
    request: the first lookup loads them asynchronously; a later lookup (the
    request was preempted or gave its blocks back) finds whatever the device
    cache no longer has and loads it synchronously."""

    def __init__(self, hits: dict[str, int]):
        super().__init__()
        self.tier_hits = hits
        self.looked_up: set[str] = set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        rid = request.request_id
        n = max(0, self.tier_hits.get(rid, 0) - num_computed_tokens)
        first = rid not in self.looked_up
        self.looked_up.add(rid)
        return n, first and n > 0


def drive(h, *, load_delay: int, max_steps: int) -> int:
    """Step until every request finished; async loads land ``load_delay``
    steps after they started. Returns the number of steps."""
    started: dict[str, int] = {}
    steps = 0
    while h.sched.has_unfinished_requests():
        assert steps < max_steps, (
            f"no progress after {steps} steps: waiting={[r.request_id for r in h.sched.waiting]} "
            f"running={[r.request_id for r in h.sched.running]} free={h.kv.num_free_blocks}")
        h.step()
        steps += 1
        for rid in h.sched.transfers.loading:
            started.setdefault(rid, steps)
        landed = [rid for rid, s in started.items() if steps - s >= load_delay and rid in h.sched.transfers.loading]
        for rid in landed:
            del started[rid]
        h.runner.finished_recving.extend(landed)
    h.step()
    return steps


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt):]


def outputs_by_request(h) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for o in h.outputs:
        out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_four_waiting_requests_holding_92_of_96_blocks_all_finish(make_harness):
    # Each request's tier hit fills 23 blocks; each needs 30 for its prompt.
    # Today: all four park for their loads, then none can grow and nothing frees.
    hits = {f"r{i}": 92 for i in range(4)}
    conn = TierConnector(hits)
    h = make_harness(num_blocks=97, max_num_seqs=4, max_model_len=256, connector=conn)
    prompts = {}
    for i in range(4):
        prompts[f"r{i}"] = list(range(1000 * (i + 1), 1000 * (i + 1) + 120))
        h.add(f"r{i}", prompts[f"r{i}"], max_tokens=3)
    h.step()
    assert h.kv.num_free_blocks == 4  # 92 of 96 held by parked loads
    steps = drive(h, load_delay=1, max_steps=200)
    got = outputs_by_request(h)
    for rid, prompt in prompts.items():
        assert got[rid] == expected_tokens(prompt, 3), rid
    assert h.kv.num_free_blocks == 96
    assert steps < 200


def test_a_running_request_gets_room_from_a_landed_waiting_one(make_harness):
    """max_num_seqs=1, block size 2, 19 usable blocks: the running request
    needs 11 blocks while a waiting one's landed load holds 9."""
    conn = TierConnector({"w": 18})
    h = make_harness(num_blocks=20, block_size=2, max_num_seqs=1, max_model_len=64, connector=conn)
    a = list(range(100, 116))
    h.add("a", a, max_tokens=6)  # 16 + 6 tokens: 11 blocks
    h.step()
    w = list(range(500, 520))
    h.add("w", w, max_tokens=2)
    drive(h, load_delay=1, max_steps=100)
    got = outputs_by_request(h)
    assert got["a"] == expected_tokens(a, 6) and got["w"] == expected_tokens(w, 2)
    assert h.kv.num_free_blocks == 19


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    block_size=st.sampled_from([2, 4]),
    usable=st.integers(8, 40),
    max_num_seqs=st.integers(1, 4),
    budget=st.sampled_from([8, 16, 64]),
    load_delay=st.integers(1, 3),
    reqs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 6), st.integers(0, 40), st.integers(0, 3)),
                  min_size=1, max_size=6),
)
def test_no_configuration_hangs(make_harness, block_size, usable, max_num_seqs, budget, load_delay, reqs):
    """Random pools, concurrency, prompts, tier hits and load delays (requests
    arriving over the first steps): everything finishes within a step bound,
    with the right tokens, and every block comes back."""
    cap = usable * block_size
    specs = []
    for i, (plen, max_tokens, hit, arrive) in enumerate(reqs):
        plen = min(plen, cap - max_tokens - block_size)  # each request fits the pool alone
        if plen < 1:
            continue
        specs.append((f"r{i}", list(range(100 * (i + 1), 100 * (i + 1) + plen)), max_tokens, min(hit, plen - 1), arrive))
    if not specs:
        return
    conn = TierConnector({rid: hit for rid, _, _, hit, _ in specs})
    h = make_harness(num_blocks=usable + 1, block_size=block_size, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, max_model_len=256, connector=conn)
    for step in range(4):
        for rid, prompt, max_tokens, _, arrive in specs:
            if arrive == step:
                h.add(rid, prompt, max_tokens=max_tokens)
        if h.sched.has_unfinished_requests():
            h.step()
            h.runner.finished_recving.extend(h.sched.transfers.loading)
    drive(h, load_delay=load_delay, max_steps=3000)
    got = outputs_by_request(h)
    for rid, prompt, max_tokens, _, _ in specs:
        assert got[rid] == expected_tokens(prompt, max_tokens)[: len(got[rid])]
        assert len(got[rid]) == max_tokens or got[rid][-1] == EOS
    assert h.kv.num_free_blocks == usable
