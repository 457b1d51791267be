"""Property test: random workloads through a real Scheduler and KVCacheManager
with a connector that loads KV (synchronously inside the step, or
asynchronously over several steps), fails some of the loaded blocks, and
delays some frees until a save is reported.

The runner models the KV each block holds: the tokens a block was computed
or loaded for, or None once a load into it failed. After every step: the
budget holds, the blocks in use are exactly those of the requests holding
blocks (running, parked for a load, or finished and waiting for a save), no
block a load failed is left in the prefix cache, and every block a new
request is told is computed holds that request's tokens. At the end: every
request finished with exactly the tokens of an undisturbed run, no transfer
is pending, and every block is free (the autouse check in conftest).
"""

from __future__ import annotations

import random

from engine_fakes import FakeRunner, SchedulerHarness, ScriptedConnector, make_scheduler, next_token
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_property import MAX_OUT, MAX_PROMPT, REQUEST, draw_config, expected_outputs, prompt_of

from kvstrata.enginecore.request import RequestStatus
from kvstrata.types import ModelRunnerOutput


class Load:
    __slots__ = ("rid", "blocks", "tokens", "is_async", "cancelled")

    def __init__(self, rid, blocks, tokens, is_async):
        self.rid, self.blocks, self.tokens, self.is_async = rid, blocks, tokens, is_async
        self.cancelled = False


class LoadingConnector(ScriptedConnector):
    """``hits[rid] = (tokens, async)`` at every first lookup (after ``unknown[rid]``
    answers of "not known yet"); the loads it starts are this step's metadata."""

    def __init__(self, hits, unknown, delay_free, block_size):
        super().__init__(hits=hits, delay_free=delay_free)
        self.unknown = dict(unknown)
        self.bs = block_size
        self.n_local: dict[str, int] = {}
        self.loads: dict[str, Load] = {}  # by request, until reported or cancelled
        self.started: list[Load] = []
        self.saving: list[str] = []  # finished requests whose free waits for a save

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        rid = request.request_id
        if self.unknown.get(rid, 0) > 0:
            self.unknown[rid] -= 1
            return None, False
        self.n_local[rid] = num_computed_tokens
        return self.hits.get(rid, (0, False))

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if not num_external_tokens:
            return
        rid, bs = request.request_id, self.bs
        first = self.n_local[rid] // bs
        end = -(-(self.n_local[rid] + num_external_tokens) // bs)
        ids = request.all_token_ids
        load = Load(rid, list(block_ids[0][first:end]),
                    [tuple(ids[i * bs:(i + 1) * bs]) for i in range(first, end)], self.hits[rid][1])
        self.loads[rid] = load
        self.started.append(load)

    def build_connector_meta(self, scheduler_output):
        started, self.started = self.started, []
        return started or None

    def request_finished(self, request, block_ids):
        rid = request.request_id
        load = self.loads.pop(rid, None)
        if load is not None:
            load.cancelled = True
        delay = rid in self.delay_free and any(block_ids)
        if delay:
            self.saving.append(rid)
        return delay, None


class LoadingRunner(FakeRunner):
    """FakeRunner plus loads: a loaded block gets its tokens, or None when the
    load into it fails (then the request rolls back to its first failed block
    and, for a sync load, the step's sample is withheld, as the model runner
    does); async loads and saves are reported after a few steps."""

    def __init__(self, conn: LoadingConnector, rng: random.Random, fail_rate: float, **kw):
        super().__init__(**kw)
        self.conn, self.rng, self.fail_rate = conn, rng, fail_rate
        self.content: dict[int, tuple | None] = {}
        self.async_due: list[list] = []  # [steps left, Load, failed blocks]
        self.save_due: list[list] = []  # [steps left, rid]
        self.reported_invalid: list[int] = []

    def _failed(self, load: Load) -> set[int]:
        return {b for b in load.blocks if self.rng.random() < self.fail_rate}

    def _land(self, load: Load, failed: set[int]) -> None:
        if load.cancelled:
            return  # its blocks may belong to someone else by now
        for b, toks in zip(load.blocks, load.tokens):
            self.content[b] = None if b in failed else toks

    def execute_model(self, so):
        self.steps.append(dict(so.num_scheduled_tokens))
        self.apply_diff(so)
        bs = self.block_size
        invalid: list[int] = []
        recving: list[str] = []
        sync_failed: dict[str, set[int]] = {}
        for load in so.kv_connector_metadata or []:
            failed = self._failed(load)
            if load.is_async:
                self.async_due.append([self.rng.randint(0, 3), load, failed])
                continue
            self._land(load, failed)
            self.conn.loads.pop(load.rid, None)
            if failed:
                sync_failed[load.rid] = failed
                invalid += sorted(failed)
        for entry in list(self.async_due):
            entry[0] -= 1
            if entry[0] < 0:
                self.async_due.remove(entry)
                _, load, failed = entry
                self._land(load, failed)
                recving.append(load.rid)
                if not load.cancelled:
                    self.conn.loads.pop(load.rid, None)
                    invalid += sorted(failed)
        for rid in self.conn.saving:
            self.save_due.append([self.rng.randint(0, 3), rid])
        self.conn.saving = []
        sending = []
        for entry in list(self.save_due):
            entry[0] -= 1
            if entry[0] < 0:
                self.save_due.remove(entry)
                sending.append(entry[1])
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            assert n > 0 and st.num_computed + n <= len(st.tokens)
            assert len(st.block_ids) * bs >= st.num_computed + n
            for i in range(st.num_computed // bs, (st.num_computed + n) // bs):
                self.content[st.block_ids[i]] = tuple(st.tokens[i * bs:(i + 1) * bs])
            st.num_computed += n
            req_ids.append(rid)
            sampled.append([next_token(st.tokens)] if st.num_computed == len(st.tokens) else [])
        # What a new request is told is computed must hold its tokens (checked
        # once the step wrote its blocks: a request may hit blocks another one
        # computes in the same step), except past its own failed sync load.
        for d in so.scheduled_new_reqs:
            st = self.reqs[d.req_id]
            limit = d.num_computed_tokens
            failed = sync_failed.get(d.req_id)
            if failed:
                limit = min(limit, min(st.block_ids.index(b) for b in failed) * bs)
            for i in range(limit // bs):
                assert self.content.get(st.block_ids[i]) == tuple(st.tokens[i * bs:(i + 1) * bs]), (d.req_id, i)
        for j, rid in enumerate(req_ids):
            st = self.reqs[rid]
            failed = sync_failed.get(rid)
            if failed:
                pos = min(st.block_ids.index(b) for b in failed) * bs
                if pos < st.num_computed:
                    st.num_computed = pos
                    sampled[j] = []
                    for b in st.block_ids[pos // bs:]:
                        self.content[b] = None  # computed over a failed load
            if sampled[j]:
                st.tokens.append(sampled[j][0])
        self.reported_invalid = invalid
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, finished_recving=recving,
                                 finished_sending=sending, invalid_block_ids=invalid)


@st.composite
def workloads(draw):
    bs = draw(st.sampled_from([2, 4]))
    reqs = draw(st.lists(st.fixed_dictionaries(dict(
        REQUEST, hit=st.integers(0, MAX_PROMPT), load_async=st.booleans(), unknown=st.integers(0, 2),
        delay_free=st.booleans(),
    )), min_size=1, max_size=8))
    # A request alone must fit beside every parked async load: a load that
    # finished is only admitted when the waiting pass reaches it, and a
    # running request that cannot fit preempts itself forever meanwhile.
    parked = sum(-(-r["hit"] // bs) + 1 for r in reqs if r["load_async"])
    cfg = draw_config(draw, bs, -(-(MAX_PROMPT + MAX_OUT) // bs) + 1 + parked)
    return cfg, reqs, draw(st.sampled_from([0.0, 0.2, 0.5])), draw(st.integers(0, 2**32))


def check_step(h, so, cfg, conn, saving):
    kv, sched, runner = h.kv, h.sched, h.runner
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= cfg["max_num_batched_tokens"]
    assert len(sched.running) <= cfg["max_num_seqs"]
    holders = [rid for rid in sched.requests if kv.has_request(rid)] + sorted(saving)
    held = set().union(*(kv.get_block_ids(rid)[0] for rid in holders))
    assert kv.num_blocks - 1 - kv.num_free_blocks == len(held), "blocks in use != blocks of their holders"
    for r in sched.waiting:  # parked for a load: holds the blocks being filled
        assert r.status != RequestStatus.WAITING_FOR_REMOTE_KVS or kv.has_request(r.request_id)
    for b in runner.reported_invalid:
        assert kv.block_pool.blocks[b].block_hash is None, f"failed block {b} left in the prefix cache"
    for r in sched.running:
        assert runner.reqs[r.request_id].block_ids == kv.get_block_ids(r.request_id)[0]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workloads())
def test_random_transfers_keep_every_invariant(kv_managers, workload):
    run_workload(kv_managers, workload)


def run_workload(kv_managers, workload):
    cfg, specs, fail_rate, seed = workload
    cfg = dict(cfg)
    hits = {f"r{k}": (s["hit"], s["load_async"]) for k, s in enumerate(specs)}
    unknown = {f"r{k}": s["unknown"] for k, s in enumerate(specs)}
    delay = {f"r{k}" for k, s in enumerate(specs) if s["delay_free"]}
    bs = cfg.pop("block_size")
    conn = LoadingConnector(hits, unknown, delay, bs)
    sched = make_scheduler(num_blocks=cfg.pop("num_blocks"), block_size=bs, max_model_len=256, connector=conn, **cfg)
    kv_managers.append(sched.kv)
    h = SchedulerHarness(sched.kv, sched, LoadingRunner(conn, random.Random(seed), fail_rate, block_size=bs))
    prompts, aborted, saving = {}, set(), set()
    for step in range(600):
        for k, spec in enumerate(specs):
            rid = f"r{k}"
            if spec["arrive"] == step:
                prompts[rid] = prompt_of(k, spec)
                h.add(rid, prompts[rid], max_tokens=spec["max_tokens"], priority=spec["priority"],
                      arrival=step + k / 100)
            if spec["abort"] == step and rid in h.sched.requests:
                h.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
                aborted.add(rid)
        if step > 12 and not h.sched.has_unfinished_requests() and not h.sched.has_pending_transfers():
            break
        saving |= set(conn.saving)
        so = h.sched.schedule()
        out = h.runner.execute_model(so)
        h.outputs.extend(h.sched.update_from_output(so, out))
        saving = (saving - set(out.finished_sending)) | set(conn.saving)
        check_step(h, so, cfg, conn, saving)
    assert not h.sched.has_unfinished_requests(), "requests did not finish"
    assert not h.sched.has_pending_transfers() and not saving
    got: dict[str, list[int]] = {}
    for o in h.outputs:
        got.setdefault(o.request_id, []).extend(o.new_token_ids)
    for k, spec in enumerate(specs):
        rid = f"r{k}"
        want = expected_outputs(prompts[rid], spec["max_tokens"])
        if rid in aborted:
            assert want[: len(got.get(rid, []))] == got.get(rid, [])
        else:
            assert got[rid] == want
