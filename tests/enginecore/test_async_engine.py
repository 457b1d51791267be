"""AsyncEngine: concurrency, abort, cancellation, overload, failures,
shutdown, and a loop that never blocks (asyncio debug mode)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from engine_fakes import FakeRunner, next_token

from kvstrata.enginecore.async_engine import run
from kvstrata.errors import EngineDeadError, EngineOverloadedError, RequestError
from kvstrata.types import SamplingParams


def expected(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


async def collect(engine, prompt, **kw):
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 4))
    return [o async for o in engine.generate(prompt, params, **kw)]


async def wait_for(predicate, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.002)


def all_free(engine) -> bool:
    kv = engine.core.kv
    return kv.num_free_blocks == kv.num_blocks - 1


async def test_many_concurrent_generates(start_engine):
    engine = await start_engine(num_blocks=256, max_num_batched_tokens=64)
    prompts = [[2 + i, 3 + i, 5 + i, 7 + (i % 5)] + [11] * (i % 7) for i in range(40)]
    results = await asyncio.gather(*(collect(engine, p, max_tokens=6, request_id=f"r{i}")
                                     for i, p in enumerate(prompts)))
    for p, outs in zip(prompts, results, strict=True):
        assert [t for o in outs for t in o.new_token_ids] == expected(p, 6)
        assert [o.finished for o in outs] == [False] * 5 + [True]
    stats = await engine.stats()
    assert stats.num_finished == 40 and stats.num_generated_tokens == 240


async def test_abort_mid_stream_frees_blocks_at_once(start_engine):
    engine = await start_engine(FakeRunner(delay_s=0.005))
    outs = []
    async for out in engine.generate([3, 4, 5, 6, 7], SamplingParams(max_tokens=200), request_id="a"):
        outs.append(out)
        if len(outs) == 3:
            await engine.abort("a")
            assert all_free(engine)
    assert (outs[-1].finished, outs[-1].finish_reason) == (True, "abort")
    assert len(outs) == 4
    await engine.abort("a")  # finished: a no-op
    await engine.abort("never-seen")


async def test_cancelled_consumer_aborts_its_request(start_engine):
    engine = await start_engine(FakeRunner(delay_s=0.005))
    got_one = asyncio.Event()

    async def consume():
        async for _ in engine.generate([3, 4, 5], SamplingParams(max_tokens=500), request_id="c"):
            got_one.set()

    task = asyncio.create_task(consume())
    await got_one.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "c" not in engine.core.scheduler.requests
    assert all_free(engine)


async def test_consumer_that_stops_iterating_aborts_its_request(start_engine):
    engine = await start_engine(FakeRunner(delay_s=0.005))
    async for _ in engine.generate([3, 4, 5], SamplingParams(max_tokens=500), request_id="s"):
        break
    # The abandoned generator is finalized by the loop's asyncgen hook.
    await wait_for(lambda: "s" not in engine.core.scheduler.requests)
    assert all_free(engine)


async def test_requests_are_accepted_while_a_step_runs(start_engine):
    runner = FakeRunner(delay_s=0.2)
    engine = await start_engine(runner)
    first = asyncio.create_task(collect(engine, [3, 4, 5], max_tokens=2, request_id="a"))
    await wait_for(lambda: len(runner.steps) == 1)
    second = asyncio.create_task(collect(engine, [6, 7, 8], max_tokens=2, request_id="b"))
    await asyncio.sleep(0.01)
    assert "b" in engine.core.scheduler.requests and len(runner.steps) == 1
    await asyncio.gather(first, second)


async def test_loop_never_blocks_in_debug_mode(start_engine, caplog):
    loop = asyncio.get_running_loop()
    loop.set_debug(True)
    loop.slow_callback_duration = 0.05
    caplog.set_level(logging.WARNING, logger="asyncio")
    engine = await start_engine(FakeRunner(delay_s=0.1))
    await asyncio.gather(*(collect(engine, [3 + i, 4, 5], max_tokens=3) for i in range(4)))
    assert not [r for r in caplog.records if "Executing" in r.getMessage()]
    # The detector works: a callback that does block is reported.
    loop.call_soon(time.sleep, 0.1)
    await asyncio.sleep(0.15)
    assert [r for r in caplog.records if "Executing" in r.getMessage()]


async def test_bad_input_raises_before_queueing_and_engine_serves_on(start_engine):
    engine = await start_engine()
    with pytest.raises(RequestError) as info:
        await collect(engine, [3, 4], max_tokens=0)
    assert info.value.field == "max_tokens"
    with pytest.raises(RequestError, match="prompt"):
        await collect(engine, [])
    with pytest.raises(RequestError, match="no tokenizer"):
        await collect(engine, "text needs a tokenizer")
    assert len(await collect(engine, [3, 4], max_tokens=2)) == 2


async def test_duplicate_live_request_id_is_rejected(start_engine):
    engine = await start_engine(FakeRunner(delay_s=0.01))
    task = asyncio.create_task(collect(engine, [3, 4], max_tokens=5, request_id="dup"))
    await wait_for(lambda: "dup" in engine.core.scheduler.requests)
    with pytest.raises(RequestError) as info:
        await collect(engine, [5, 6], request_id="dup")
    assert info.value.field == "request_id"
    assert len(await task) == 5


async def test_full_waiting_queue_is_rejected(start_engine):
    runner = FakeRunner(delay_s=0.05)
    engine = await start_engine(runner, max_num_seqs=1, max_waiting_requests=1)
    a = asyncio.create_task(collect(engine, [3, 4], max_tokens=3))
    await wait_for(lambda: len(runner.steps) >= 1)
    b = asyncio.create_task(collect(engine, [5, 6], max_tokens=3))
    await wait_for(lambda: len(engine.core.scheduler.waiting) == 1)
    with pytest.raises(EngineOverloadedError) as info:
        await collect(engine, [7, 8])
    assert info.value.limit == 1
    await asyncio.gather(a, b)


async def test_failed_step_errors_its_requests_and_engine_serves_on(start_engine):
    engine = await start_engine(FakeRunner(fail_steps={0}))
    outs = await collect(engine, [3, 4, 5])
    assert (outs[-1].finish_reason, outs[-1].finished) == ("error", True)
    assert "injected failure" in outs[-1].error
    assert len(await collect(engine, [3, 4, 5], max_tokens=2)) == 2


async def test_repeated_step_failures_kill_the_engine(start_engine):
    # serial steps: each failing step is one request's (with async scheduling
    # a step queued behind a failed one fails with it, uncounted: below)
    engine = await start_engine(FakeRunner(fail_steps={0, 1, 2}), max_num_seqs=1, async_scheduling=False)
    tasks = [asyncio.create_task(collect(engine, [3 + i, 4])) for i in range(4)]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert [r[-1].finish_reason for r in results[:3]] == ["error"] * 3
    assert isinstance(results[3], EngineDeadError)
    with pytest.raises(EngineDeadError):
        await collect(engine, [3, 4])
    with pytest.raises(EngineDeadError):
        await engine.stats()


async def test_a_failed_step_with_async_scheduling_fails_its_requests_and_the_engine_serves_on(start_engine):
    """Step 0 fails while step 1 (its decode, a placeholder token) is queued
    behind it: the request fails once, the queued step's failure is not
    counted against the model, and the next requests complete."""
    engine = await start_engine(FakeRunner(fail_steps={0}), max_num_seqs=1, async_scheduling=True)
    assert engine.async_scheduling
    first = await collect(engine, [3, 4])
    assert first[-1].finish_reason == "error"
    rest = await asyncio.gather(*(collect(engine, [5 + i, 6], max_tokens=4) for i in range(3)))
    assert [r[-1].finish_reason for r in rest] == ["length"] * 3
    assert engine.core.consecutive_failed_steps == 0 and engine.core.num_failed_steps == 1
    assert all_free(engine)


class _FailsAPrefill(FakeRunner):
    """Raises on the step that computes ``rid``'s prompt, after running it as
    a device that failed at the end would (so the step behind it, already
    scheduled on its placeholders, runs)."""

    def __init__(self, rid: str, **kw) -> None:
        super().__init__(**kw)
        self.rid = rid

    def execute_model(self, so):
        if so.num_scheduled_tokens.get(self.rid, 0) <= 1:
            return super().execute_model(so)
        super().execute_model(so)
        raise RuntimeError(f"injected failure of {self.rid}'s prefill")


async def test_a_step_behind_a_failed_one_fails_only_the_requests_that_read_its_kv(start_engine):
    """With async scheduling, ``a``'s prefill fails while the step behind it
    is queued. That step admitted ``b`` on a prefix hit in the blocks ``a``'s
    step was writing (garbage now: ``b`` fails too) and ``c`` on a hit in
    blocks an earlier step wrote (sound: ``c`` gets exactly its tokens)."""
    runner = _FailsAPrefill("a")
    engine = await start_engine(runner, max_num_batched_tokens=8, async_scheduling=True)
    p, a = [21, 22, 23, 24, 25, 26, 27, 28], [31, 32, 33, 34, 35, 36, 37, 38]
    assert (await collect(engine, p, max_tokens=1))[-1].finish_reason == "length"
    got = await asyncio.gather(collect(engine, a, max_tokens=3, request_id="a"),
                               collect(engine, a + [40, 41, 42], max_tokens=3, request_id="b"),
                               collect(engine, p + [50, 51], max_tokens=3, request_id="c"))
    # all three were waiting when a's step was scheduled: a's 8 tokens took its
    # budget, b and c came in the step behind it, on 8 cached tokens each
    behind = next(s for s in runner.steps if "b" in s)
    assert behind == {"a": 1, "b": 3, "c": 2}
    (*_, a_end), (*_, b_end), c_outs = got
    assert a_end.finish_reason == b_end.finish_reason == "error"
    assert "injected failure" in a_end.error and "depended on failed" in b_end.error
    assert c_outs[-1].finish_reason == "length", c_outs[-1].error
    assert [t for o in c_outs for t in o.new_token_ids] == expected(p + [50, 51], 3)
    assert c_outs[-1].num_cached_tokens == 8
    assert all_free(engine)


async def test_aclose_ends_pending_streams_and_is_idempotent(start_engine):
    engine = await start_engine(FakeRunner(delay_s=0.01))
    task = asyncio.create_task(collect(engine, [3, 4], max_tokens=1000))
    await wait_for(lambda: engine.core.scheduler.running)
    await asyncio.gather(engine.aclose(), engine.aclose())
    outs = await task
    assert outs[-1].finish_reason == "abort"
    assert all_free(engine)
    await engine.aclose()
    await engine.abort("anything")
    with pytest.raises(EngineDeadError, match="closed"):
        await collect(engine, [3, 4])


def test_run_uses_uvloop_when_installed():
    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    module = run(loop_module())
    try:
        import uvloop  # noqa: F401
    except ImportError:
        assert module.startswith("asyncio")
    else:
        assert module.startswith("uvloop")


async def test_bad_checkpoint_fails_at_start_naming_the_field(tmp_path):
    from kvstrata.config import EngineConfig, ModelConfig
    from kvstrata.enginecore.async_engine import AsyncEngine

    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    for path in (tmp_path / "missing", tmp_path):
        with pytest.raises(ValueError, match="model|architecture"):
            await AsyncEngine.start(EngineConfig(model=ModelConfig(model=str(path)), device="cpu"))


async def test_async_kv_load_completes_when_the_connector_wakes_the_engine(start_engine):
    from engine_fakes import ScriptedConnector

    from kvstrata.enginecore.request import RequestStatus

    runner = FakeRunner()
    engine = await start_engine(runner, connector=ScriptedConnector(hits={"a": (8, True)}))
    task = asyncio.create_task(collect(engine, list(range(10, 20)), max_tokens=2, request_id="a"))
    await wait_for(lambda: "a" in engine.core.scheduler.transfers.loading)
    assert engine.core.scheduler.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    await asyncio.sleep(0.05)  # the step that started the load, and one bare poll, are done by now
    num_steps = len(runner.steps)
    await asyncio.sleep(0.1)
    assert len(runner.steps) == num_steps  # nothing to do until woken: the loop sleeps, never polls
    runner.finished_recving = ["a"]  # the worker's load completes ...
    await asyncio.to_thread(engine.wakeup)  # ... and the connector says so, from its own thread
    outs = await task
    assert [o.finished for o in outs] == [False, True]
    assert {"a": 2} in runner.steps  # only the last 2 prompt tokens were computed
