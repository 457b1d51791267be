"""Timers the kernel benchmarks share (``bench_kernels``, ``bench_attention``,
``bench_fused_kernels``); each returns median seconds per call of ``fn``.

    cpu_time         wall clock, after one warm-up call
    cuda_eager_time  CUDA events around one eager call (host launch cost included)
    cuda_graph_time  replays of one CUDA graph of ``calls`` calls: the device's
                     time alone, as in the engine's captured decode steps
    host_launch_time host seconds per eager call, device work not waited for

and the CPU engine A/Bs (``bench_attention --engine``, ``bench_fused_kernels
--engine``):

    smollm2_decode_core  SmolLM2's engine core (the GGUF, packed) with ``batch``
                         requests past their prefill: the next steps decode
    alternate_steps      ms per decode step of each way of running it, in
                         alternating rounds on the same running requests
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def cpu_time(fn: Callable[[], object], repeat: int) -> float:
    fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _event_samples(run: Callable[[], object], repeat: int, per: int = 1) -> float:
    samples = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / per)
    return statistics.median(samples)


def cuda_eager_time(fn: Callable[[], object], repeat: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return _event_samples(fn, repeat)


def cuda_graph_time(fn: Callable[[], object], calls: int, repeat: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) off the capture
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    try:
        return _event_samples(graph.replay, repeat, per=calls)
    finally:
        del graph


def host_launch_time(fn: Callable[[], object], calls: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return dt


def smollm2_decode_core(batch: int, prompt: int, steps: int, dtype: str = "float32"):
    """(the engine core, its model runner): SmolLM2 (the GGUF, packed) at the
    process's torch threads with ``batch`` greedy requests of ``prompt``
    tokens, prefilled; room for ``steps`` more decode steps. Raises
    FileNotFoundError where the GGUF is not here."""
    from kvstrata.config import CacheConfig, EngineConfig, ModelConfig
    from kvstrata.enginecore.builder import build_engine_core, build_runner
    from kvstrata.enginecore.request import EngineRequest
    from kvstrata.types import SamplingParams
    from kvstrata.worker.model.smollm2 import locate_smollm2

    path = str(locate_smollm2(download=False))
    cfg = EngineConfig(model=ModelConfig(model=path, max_model_len=prompt + steps + 64, dtype=dtype,
                                         num_threads=torch.get_num_threads()),
                       device="cpu", cache=CacheConfig(num_blocks=16 + batch * ((prompt + steps) // 16 + 4)),
                       log_level="WARNING")
    runner = build_runner(cfg)
    core = build_engine_core(cfg, runner)
    params = SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        core.add_request(EngineRequest(request_id=f"r{i}", sampling_params=params,
                                       prompt_token_ids=[1 + (i * 7 + j) % 2000 for j in range(prompt)]))
    while core.scheduler.waiting or any(r.num_computed_tokens < prompt for r in core.scheduler.running):
        core.step()
    return core, runner


def alternate_steps(core, ways: dict[str, Callable[[], object]], steps: int, rounds: int) -> dict[str, float]:
    """Median ms per ``core.step()`` of each way: ``ways[name]()`` sets it up,
    then ``steps`` steps are timed; the ways take turns for ``rounds`` rounds
    (the host's drift and the growing context spread over all of them)."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, setup in ways.items():
            setup()
            t0 = time.perf_counter()
            for _ in range(steps):
                core.step()
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}
