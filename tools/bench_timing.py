"""Timers the kernel benchmarks share (``bench_kernels``, ``bench_attention``,
``bench_fused_kernels``); each returns median seconds per call of ``fn``.

    cpu_time         wall clock, after one warm-up call
    cuda_eager_time  CUDA events around one eager call (host launch cost included)
    cuda_graph_time  replays of one CUDA graph of ``calls`` calls: the device's
                     time alone, as in the engine's captured decode steps
    host_launch_time host seconds per eager call, device work not waited for
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
