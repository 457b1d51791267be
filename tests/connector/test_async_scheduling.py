"""Async scheduling with the offload connector: step N+1 is scheduled, and
its connector metadata built, while step N runs, before N's output is in.

What that asks of the connector and the scheduler, each checked here: what
is lent to the worker is settled step by step (the lender); a request whose
load rides on a step in flight is not scheduled on top of it (a failed
block rolls it back, and the runner withheld its sample); a load that fails
drops the saves of what was computed over it; a step that fails drops the
saves queued behind it and uncaches what it wrote, and fails only its own
requests. The oracle and leak checks (conftest) hold throughout.
"""

from __future__ import annotations

import torch
from conn_helpers import N, add, assert_stepped, offload_config, prompt, run_until_idle, step

from kvstrata.connector.metadata import WorkerReport
from kvstrata.connector.offload.lending import Lender, Lent
from kvstrata.enginecore import SamplingParams
from kvstrata.enginecore.request import Request
from kvstrata.io.memory import MemoryObj


class _Pool:
    """An allocator that only counts what is given back."""

    def __init__(self) -> None:
        self.freed: list[MemoryObj] = []

    def free(self, obj: MemoryObj) -> None:
        self.freed.append(obj)

    def batched_free(self, objs) -> None:
        self.freed.extend(objs)


def _lent(pool: _Pool, req_id: str) -> Lent:
    obj = MemoryObj(pool, torch.zeros(8, dtype=torch.uint8), 0, 8, (2,), torch.float32, "kv")
    return Lent(obj, None, req_id)  # type: ignore[arg-type]  # the key is never read here


def test_the_lender_settles_each_step_apart_and_releases_discarded_saves():
    pool, lender = _Pool(), Lender()
    lender.begin(1)
    a1, b1 = _lent(pool, "a"), _lent(pool, "b")
    h_a1, h_b1 = lender.lend(a1), lender.lend(b1)
    lender.begin(2)  # step 2's metadata, built while step 1 runs
    a2, b2 = _lent(pool, "a"), _lent(pool, "b")
    h_a2, h_b2 = lender.lend(a2), lender.lend(b2)
    assert len(lender) == 4 and set(lender.buffers) == {h_a1, h_b1, h_a2, h_b2}

    lender.discard_saves({"b"})  # a load into b's blocks failed in step 1
    assert lender.settle(WorkerReport(step=1, saved=[h_a1, h_b1])) == [a1]
    assert pool.freed == [b1.obj] and set(lender.buffers) == {h_a2, h_b2}  # step 2's are untouched
    assert lender.settle(WorkerReport(step=2, saved=[h_a2, h_b2])) == [a2]
    assert pool.freed == [b1.obj, b2.obj] and len(lender) == 0 and not lender.buffers


def test_a_failed_step_releases_its_own_buffers_and_the_saves_behind_it():
    pool, lender = _Pool(), Lender()
    lender.begin(1)
    first = lender.lend(_lent(pool, "a"))
    lender.begin(2)
    queued = _lent(pool, "b")
    h_queued = lender.lend(queued)
    lender.release_step(1)
    lender.discard_saves()  # step 2 ran after step 1 and may have read its KV
    assert first not in lender.buffers and len(pool.freed) == 1
    assert lender.settle(WorkerReport(step=2, saved=[h_queued])) == [] and len(pool.freed) == 2


async def test_a_request_whose_load_is_in_flight_waits_for_its_step(oracle, make_core):
    core = await make_core(offload_config())
    p = prompt(50, 50)
    outputs: dict[str, list[int]] = {}
    add(core, "seed", p)
    await run_until_idle(core, outputs)
    assert core.reset_prefix_cache()
    add(core, "a", p)
    first = core.schedule()  # 48 tokens loaded within the step, 2 computed: it samples
    assert first.num_scheduled_tokens == {"a": 2} and first.kv_connector_metadata.layer_loads
    second = core.schedule()  # planned while the first runs: a waits for its load's outcome
    assert "a" not in second.num_scheduled_tokens and not core.should_execute(second)
    for o in core.update(first, core.execute(first)):
        outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert (await step(core, outputs)).num_scheduled_tokens == {"a": 1}  # now it decodes
    await run_until_idle(core, outputs)
    assert outputs["a"] == oracle.greedy(p, N)


def _noise(engine) -> None:
    """Fill the idle engine's device KV cache with noise: a block no step
    wrote holds garbage, as it would after other requests."""
    with torch.no_grad():
        for k, v in engine.core.runner.kv_caches:
            k.normal_()
            v.normal_()


class _LoadsFail:
    """The worker's KV streams, every load into the device cache raising."""

    def __init__(self, streams) -> None:
        self._streams = streams

    def __getattr__(self, name: str):
        return getattr(self._streams, name)

    def load_layer(self, *args, **kwargs):
        raise RuntimeError("injected KV load failure")

    def load_all(self, *args, **kwargs):
        raise RuntimeError("injected KV load failure")


def _chunk_keys(engine, tokens: list[int]):
    req = Request("probe", tokens, SamplingParams(), block_hasher=engine.core.block_hasher,
                  hash_block_size=engine.core.block_hasher.block_size)
    return engine.core.kv_connector.scheduler.keyer.keys(req.block_hashes)


async def gen(engine, p: list[int]):
    outs = [o async for o in engine.generate(p, SamplingParams(temperature=0.0, max_tokens=N))]
    return [t for o in outs for t in o.new_token_ids], outs[-1]


async def test_a_failed_load_is_recomputed_and_nothing_computed_over_it_is_saved(
        oracle, make_engine, monkeypatch, stepping):
    engine = await make_engine(offload_config(), **stepping)
    p = prompt(51, 50)
    assert (await gen(engine, p))[0] == oracle.greedy(p, N)
    await engine.flush_kv()
    assert await engine.reset_prefix_cache()
    _noise(engine)
    # q loads p's 3 chunks; in that step it computes 2 more chunks over them.
    q = p[:48] + prompt(52, 40)

    worker = engine.core.runner.kv_connector
    monkeypatch.setattr(worker, "streams", _LoadsFail(worker.streams))
    assert (await gen(engine, q))[0] == oracle.greedy(q, N)  # rolled back and recomputed, not failed
    monkeypatch.undo()
    await engine.flush_kv()
    store = engine.core.kv_connector.store
    assert [store.holds(k) for k in _chunk_keys(engine, q)[:5]] == [True] * 5  # saved again once recomputed
    assert await engine.reset_prefix_cache()
    _noise(engine)
    assert (await gen(engine, q))[0] == oracle.greedy(q, N)  # so they hold what q computes
    assert (await engine.stats()).extra["connector.cpu.hit_tokens"] == 48 + 80
    assert_stepped(engine, stepping)


async def test_a_failed_overlapped_step_fails_only_its_requests_and_drops_what_it_tainted(
        oracle, make_engine, monkeypatch):
    # 8-token prefill chunks: step 1 computes tokens 0-7 of p and fails before
    # writing them; step 2, queued behind it, computes 8-15 over them and
    # fills chunk 0 (a save riding on the step after a failed one).
    engine = await make_engine(offload_config(), async_scheduling=True, max_num_batched_tokens=8)
    p = prompt(53, 40)
    worker = engine.core.runner.kv_connector
    real, calls = worker.start_load_kv, []

    def fails_once() -> None:
        calls.append(None)
        if len(calls) == 1:
            raise RuntimeError("injected step failure")
        real()

    _noise(engine)
    monkeypatch.setattr(worker, "start_load_kv", fails_once)
    tokens, last = await gen(engine, p)
    assert (tokens, last.finish_reason) == ([], "error") and "injected step failure" in last.error
    await engine.flush_kv()
    assert not engine.core.kv_connector.store.holds(_chunk_keys(engine, p)[0])  # step 2's save dropped
    # Nothing it wrote is hit on the device either: the same prompt computes afresh.
    assert (await gen(engine, p))[0] == oracle.greedy(p, N)
    stats = await engine.stats()
    assert stats.prefix_cache_hits == 0 and stats.extra["connector.cpu.hit_tokens"] == 0
    assert engine.core.num_failed_steps == 1 and engine.core.consecutive_failed_steps == 0
    assert engine.num_overlapped_steps > 0


async def test_a_connector_step_samples_before_it_waits_for_its_transfers(oracle, make_core):
    """With a connector the step's end waits for its loads and saves
    (``wait_for_save``: on CUDA a sync of the side streams). The sampler's
    kernels go in first, so the device computes the logits while the host
    waits, instead of sitting idle until that wait ends (issue 22). The
    tokens are the oracle's either way; what a failed load withholds is
    known when its copies are issued, before the wait."""
    core = await make_core(offload_config())
    runner, order, steps = core.runner, [], [0]
    worker, sampler = runner.kv_connector, runner.sampler
    bind, wait_for_save, clear = worker.bind_connector_metadata, worker.wait_for_save, worker.clear_connector_metadata

    def bound(meta):
        steps[0] += 1
        bind(meta)

    def sample(*args, **kwargs):
        order.append(("sample", steps[0]))
        return sampler(*args, **kwargs)

    def wait():
        order.append(("wait_for_save", steps[0]))
        return wait_for_save()

    def cleared():
        order.append(("cleared", steps[0]))
        clear()

    runner.sampler = sample
    worker.bind_connector_metadata, worker.wait_for_save, worker.clear_connector_metadata = bound, wait, cleared
    outputs: dict[str, list[int]] = {}
    p = prompt(50, 50)
    add(core, "a", p)
    await run_until_idle(core, outputs)
    runner.sampler = sampler
    worker.bind_connector_metadata, worker.wait_for_save, worker.clear_connector_metadata = bind, wait_for_save, clear
    assert outputs["a"] == oracle.greedy(p, N)
    sampled = [st for what, st in order if what == "sample"]
    assert len(sampled) == N
    for st in sampled:  # within its step's connector work, before the wait
        assert order.index(("sample", st)) < order.index(("wait_for_save", st)) < order.index(("cleared", st)), order
