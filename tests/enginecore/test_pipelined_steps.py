"""Pipelined steps (``scheduler.pipelined_steps``): the runner launches step
N+1 before it reads step N's sampled tokens back; N+1's decode inputs are
read from N's tokens on the device. The real model runner on a tiny Llama:
the tokens must be exactly those of one step at a time, whatever the mix of
requests (greedy, seeded random, min_tokens, logprobs, stop tokens), and a
failed step fails only its requests."""

from __future__ import annotations

import asyncio
import os
import time

import msgspec
import pytest
import torch
from hf_utils import build_tiny_llama

from kvstrata.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, SchedulerConfig
from kvstrata.enginecore.async_engine import AsyncEngine
from kvstrata.enginecore.builder import build_engine_core, build_runner
from kvstrata.enginecore.request import EngineRequest
from kvstrata.types import SamplingParams
from kvstrata.worker.pending_step import Failed


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_llama")
    build_tiny_llama(path, seed=5)
    return str(path)


DEVICE = os.environ.get("KVSTRATA_TEST_DEVICE", "cpu")  # tools/gpu_check.sh runs these on CUDA too


def config(path: str, *, pipelined: bool, async_scheduling: bool, cuda_graphs: bool | None = None,
           **sched) -> EngineConfig:
    """``cuda_graphs``: the model's switch (None: the default, on for CUDA)."""
    return EngineConfig(model=ModelConfig(model=path, seed=11, cuda_graphs=cuda_graphs), device=DEVICE,
                        cache=CacheConfig(block_size=4, num_blocks=sched.pop("num_blocks", 128)),
                        scheduler=SchedulerConfig(async_scheduling=async_scheduling, pipelined_steps=pipelined,
                                                  **sched))


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0.9, top_k=20, seed=123, max_tokens=7, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4),
    SamplingParams(temperature=0.7, top_p=0.9, seed=7, max_tokens=8, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
]
PROMPTS = [[5, 9, 13], [40, 41, 42, 43, 44, 45, 46], [100] * 11, [7, 8], list(range(60, 77))]


def _requests(tag: str) -> list[EngineRequest]:
    return [EngineRequest(request_id=f"{tag}{i}", prompt_token_ids=p, sampling_params=params)
            for i, (p, params) in enumerate(zip(PROMPTS, PARAMS, strict=True))]


def _one_at_a_time(path: str, cuda_graphs: bool | None = None,
                   requests: list[EngineRequest] | None = None) -> dict[str, list[int]]:
    """The tokens of one step at a time of ``requests`` (default: all of
    ``_requests``), on CUDA with the graph switch of the run compared with
    it: the same batches, the same shapes."""
    cfg = config(path, pipelined=False, async_scheduling=False, cuda_graphs=cuda_graphs)
    core = build_engine_core(cfg, build_runner(cfg))
    for r in requests or _requests("r"):
        core.add_request(r)
    got: dict[str, list[int]] = {}
    while core.has_work():
        for out in core.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    return got


def _pipelined(core, launch=None) -> dict[str, list[int]]:
    """Run ``core``'s requests in the step thread's order: launch N, launch
    N+1, collect N, update N, launch N+2, collect N+1 ... (``launch``: in
    place of ``core.launch``). Returns each request's tokens."""
    launch = launch or core.launch
    got: dict[str, list[int]] = {}
    inflight = []
    while core.has_work() or inflight:
        if core.has_work():
            so = core.schedule()
            launch(so)
            inflight.append(so)
        if len(inflight) == 2 or (inflight and not core.has_work()):
            so = inflight.pop(0)
            for out in core.update(so, core.collect()):
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
    return got


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_launch_collect_by_hand_gives_the_tokens_of_one_step_at_a_time(tiny, kv_managers, graphs):
    """launch N, launch N+1, collect N, update N, launch N+2, collect N+1 ...
    (the order the engine's step thread runs them in); with decode graphs
    (emulated on a CPU: the padded graph layout, replayed eagerly) the fed
    tokens land in the graph's persistent input rows."""
    expected = _one_at_a_time(tiny, cuda_graphs=graphs)
    cfg = config(tiny, pipelined=True, async_scheduling=True, cuda_graphs=graphs)
    core = build_engine_core(cfg, build_runner(cfg))
    kv_managers.append(core.kv)
    assert core.can_pipeline
    if graphs and DEVICE != "cuda":  # on CUDA the runner captured them at start
        core.runner.capture_decode_graphs([1, 2, 4, 8], emulate=True)
    assert (core.runner.graphs is not None) == graphs
    for r in _requests("r"):
        core.add_request(r)
    assert _pipelined(core) == expected
    assert core.runner.batch.num_fed_tokens > 0  # decode inputs came from tokens not yet read back
    assert not core.runner._launched
    if graphs:
        assert core.runner.graphs.num_replays > 0


@pytest.mark.skipif(DEVICE != "cuda", reason="a host sync is a CUDA notion (tools/gpu_check.sh runs this file on "
                                            "CUDA: KVSTRATA_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_launch_never_waits_for_the_device(tiny, kv_managers, graphs):
    """Issue 22: a step's only host sync is the read of its sampled ids,
    which ``collect`` does after the next launch. Every launch (prefill,
    mixed, decode; graph replay or eager) runs under torch's sync debug
    mode set to "error", so any synchronizing call in it (``.item()``,
    ``.tolist()``, a pageable copy, a stream sync) fails the launch."""
    import torch

    cfg = config(tiny, pipelined=True, async_scheduling=True, cuda_graphs=graphs)
    core = build_engine_core(cfg, build_runner(cfg))
    kv_managers.append(core.kv)
    runner = core.runner
    assert (runner.graphs is not None) == graphs
    requests = [r for r in _requests("r") if r.sampling_params.logprobs is None]  # logprobs: read at once, by design
    expected = _one_at_a_time(tiny, cuda_graphs=graphs, requests=requests)
    for r in requests:
        core.add_request(r)
    launches = []

    def launch(so):
        torch.cuda.set_sync_debug_mode("error")
        try:
            core.launch(so)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        failed = runner._launched[-1]
        assert not isinstance(failed, Failed), f"launch {len(launches)} synchronized: {failed.error!r}"
        launches.append(so)

    assert _pipelined(core, launch) == expected
    assert runner.batch.num_fed_tokens > 0
    if graphs:
        assert runner.graphs.num_replays > 0


async def _engine_tokens(path: str, **kw) -> tuple[dict[str, list[int]], AsyncEngine]:
    engine = await AsyncEngine.start(config(path, **kw))
    try:
        async def one(r: EngineRequest) -> tuple[str, list[int]]:
            toks = [t async for o in engine.generate(r.prompt_token_ids, r.sampling_params, request_id=r.request_id)
                    for t in o.new_token_ids]
            return r.request_id, toks
        return dict(await asyncio.gather(*(one(r) for r in _requests("r")))), engine
    finally:
        await engine.aclose()


async def test_the_async_engine_pipelined_gives_the_tokens_of_serial_steps(tiny):
    serial, _ = await _engine_tokens(tiny, pipelined=False, async_scheduling=False)
    piped, engine = await _engine_tokens(tiny, pipelined=True, async_scheduling=True)
    assert engine.pipelined and engine.num_overlapped_steps > 0
    assert engine.core.runner.batch.num_fed_tokens > 0
    assert piped == serial
    assert serial == _one_at_a_time(tiny)


async def test_pipelined_needs_async_scheduling_and_is_on_by_default_for_cuda_only(tiny):
    engine = await AsyncEngine.start(config(tiny, pipelined=True, async_scheduling=False))
    try:
        assert not engine.pipelined
    finally:
        await engine.aclose()
    assert SchedulerConfig().pipelined_steps is None  # on for CUDA (the oracle there: tests/enginecore/test_oracle.py)
    engine = await AsyncEngine.start(config(tiny, pipelined=None, async_scheduling=True))
    try:
        on_cuda = torch.device(DEVICE).type == "cuda"
        assert engine.async_scheduling and engine.pipelined == on_cuda  # a CPU's device is its host
    finally:
        await engine.aclose()


async def test_a_failed_launch_fails_its_requests_and_the_engine_serves_on(tiny, kv_managers):
    engine = await AsyncEngine.start(config(tiny, pipelined=True, async_scheduling=True, max_num_seqs=2))
    kv_managers.append(engine.core.kv)
    runner = engine.core.runner
    forward = runner._forward  # graph replay or eager: every step's forward
    calls = {"n": 0}

    def flaky(step):
        calls["n"] += 1
        if calls["n"] == 6:  # a decode step, with the step after it already launched
            raise RuntimeError("injected device failure")
        return forward(step)

    runner._forward = flaky
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

        async def one(i: int):
            return [o async for o in engine.generate([3 + i, 4, 5], params, request_id=f"f{i}")]

        first = await asyncio.gather(*(one(i) for i in range(2)))
        assert {outs[-1].finish_reason for outs in first} == {"error"}
        assert any("injected device failure" in (outs[-1].error or "") for outs in first)
        runner._forward = forward
        rest = await asyncio.gather(*(one(10 + i) for i in range(3)))
        assert [outs[-1].finish_reason for outs in rest] == ["length"] * 3
        assert all(sum(len(o.new_token_ids) for o in outs) == 10 for outs in rest)
        async with asyncio.timeout(10):  # the step telling the runner of the finished ones may still run
            while runner._launched or engine.core.has_work():
                await asyncio.sleep(0.01)
        kv = engine.core.kv
        assert kv.num_free_blocks == kv.num_blocks - 1
    finally:
        await engine.aclose()


@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
def test_a_stop_id_past_the_vocabulary_bans_nothing_and_fails_no_one(tiny, kv_managers, pipelined):
    """Under min_tokens a request's stop ids are banned from sampling; one the
    model cannot produce (past its vocabulary) is left out of the ban, so the
    step, and the other requests in it, run as without it."""
    cfg = config(tiny, pipelined=pipelined, async_scheduling=pipelined)
    core = build_engine_core(cfg, build_runner(cfg))
    kv_managers.append(core.kv)
    vocab = core.vocab_size
    odd = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4, stop_token_ids=[vocab + 7])
    plain = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4, ignore_eos=True)
    for rid, params in (("odd", odd), ("other", plain)):
        core.add_request(EngineRequest(request_id=rid, prompt_token_ids=[5, 9, 13], sampling_params=params))
    got: dict[str, list] = {}
    while core.has_work():
        for out in core.step():
            got.setdefault(out.request_id, []).append(out)
    assert {rid: outs[-1].finish_reason for rid, outs in got.items()} == {"odd": "length", "other": "length"}
    assert [t for o in got["odd"] for t in o.new_token_ids] == [t for o in got["other"] for t in o.new_token_ids]


def test_the_launch_after_a_failed_one_runs_its_other_requests(tiny, kv_managers):
    """launch N raises; N+1 was launched behind it (pipelined) with N's
    requests and one admitted since. N's requests have no token from N, so
    N+1 cannot run them, but the newcomer did not depend on N: it must get
    its tokens, not the failure (the engine's recovery, by hand: fail N,
    then apply N+1)."""
    cfg = config(tiny, pipelined=True, async_scheduling=True, cuda_graphs=False)
    core = build_engine_core(cfg, build_runner(cfg))
    kv_managers.append(core.kv)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    expected = _one_at_a_time(tiny, cuda_graphs=False, requests=[
        EngineRequest(request_id="new", prompt_token_ids=[7, 8, 9, 10], sampling_params=params)])["new"]
    core.add_request(EngineRequest(request_id="old", prompt_token_ids=[5, 9, 13], sampling_params=params))
    so = core.schedule()
    core.launch(so)
    core.update(so, core.collect())  # old's prefill: it decodes from here on
    runner = core.runner
    forward = runner._forward

    def broken(step):
        raise RuntimeError("injected device failure")

    runner._forward = broken
    failed = core.schedule()
    core.launch(failed)
    runner._forward = forward
    core.add_request(EngineRequest(request_id="new", prompt_token_ids=[7, 8, 9, 10], sampling_params=params))
    behind = core.schedule()
    assert set(behind.num_scheduled_tokens) == {"old", "new"}
    core.launch(behind)
    with pytest.raises(RuntimeError, match="injected"):
        core.collect()
    outs = core.fail_step(failed, RuntimeError("injected device failure"))
    assert [(o.request_id, o.finish_reason) for o in outs] == [("old", "error")]
    got = {o.request_id: o.new_token_ids for o in core.update(behind, core.collect())}
    assert got == {"new": expected[:1]}
    tokens = list(got["new"])
    while core.has_work():
        for out in core.step():
            tokens.extend(out.new_token_ids)
    assert tokens == expected
    assert core.kv.num_free_blocks == core.kv.num_blocks - 1


async def test_closing_the_engine_drops_its_decode_graphs_in_the_step_thread(tiny):
    """Graphs (and their memory pool) go when their engine closes, as the step
    thread's last job: not whenever the collector reaches the engine, which
    could be in the middle of another engine's capture."""
    engine = await AsyncEngine.start(config(tiny, pipelined=False, async_scheduling=False))
    runner = engine.core.runner
    await asyncio.get_running_loop().run_in_executor(
        engine._executor, lambda: runner.capture_decode_graphs([1, 2], emulate=True))
    assert runner.graphs is not None and runner.batch.graph_sizes == [1, 2]
    await engine.aclose()  # returns once that last job is done
    assert runner.graphs is None and runner.batch.graph_sizes == []


@pytest.mark.parametrize("why", ["logprobs", "connector"])
async def test_a_step_that_runs_whole_reaches_the_loop_before_the_next_launch_ends(tiny, why):
    """A launch that must read its tokens at once (logprobs, drafts, a KV
    connector) runs the whole step: its output is final when the launch
    ends. It must reach the loop then, not after the launch queued behind
    it (collect N runs after launch N+1): else every such step's tokens come
    one step late, and the step thread idles while the loop applies them
    (issue 22: a CPU-tier hit's first token waited for the next step)."""
    cfg = config(tiny, pipelined=True, async_scheduling=True, cuda_graphs=False)
    if why == "connector":  # the CPU tier of the offload connector
        store = {"cpu": {"capacity_bytes": 1 << 20, "pin_memory": False}}
        cfg = msgspec.structs.replace(cfg, kv_transfer=KVTransferConfig(
            connector="offload", options={"store": store, "chunk_size": 4, "save_admission": "all"}))
    engine = await AsyncEngine.start(cfg)
    runner = engine.core.runner
    assert engine.pipelined and (runner.kv_connector is not None) == (why == "connector")
    launch, ended = runner.launch, []

    def slow_launch(so):
        time.sleep(0.05)  # the device's time on the step
        try:
            return launch(so)
        finally:
            ended.append(time.monotonic())

    runner.launch = slow_launch
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1 if why == "logprobs" else None)
    try:
        arrived = []
        async for out in engine.generate([5, 9, 13], params, request_id="w"):
            arrived.append((time.monotonic(), len(out.new_token_ids)))
        assert sum(n for _, n in arrived) == 5
        # output k is step k's (one token a step); step k+1 was launched behind it
        late = [k for k, (t, _) in enumerate(arrived) if k + 1 < len(ended) and t >= ended[k + 1]]
        assert not late, f"outputs {late} reached the loop only after the launch behind their step ended"
    finally:
        runner.launch = launch
        await engine.aclose()

