"""CUDA graphs for decode steps, in the design of vLLM's model runner.

A decode-only step (one new token per request) launches the same kernels
with the same shapes for a given batch size; only the data differ. So the
forward is captured once per batch size at start and replayed:

    decode step of n requests ─► size = smallest captured size >= n
        InputBatch writes the step's inputs at size's layout in its
        persistent buffer (rows n..size are padding: slot -1, null block)
        ─► graphs[size].replay() ─► hidden[:n]

Everything the captured kernels read is at a fixed address: the batch's
packed step buffer (``step_buffers.StepLayout``), the weights and the KV
cache. Prefill, mixed batches, batches larger than the largest size and
steps with a KV connector's layer hooks run eagerly. Sizes are captured
largest first into one memory pool, so the smaller graphs reuse the
largest one's activation memory.

``emulate=True`` (any device) replays by running the forward eagerly on the
padded inputs: what the CPU tests use to check padding and buffer reuse
without a GPU.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable

import structlog
import torch

from kvstrata.worker.input_batch import InputBatch, StepInputs

log = structlog.get_logger(__name__)

MAX_GRAPH_SIZE = 512


class _NoCollector:
    """The cyclic garbage collector off while any thread of the process
    captures (``gc.disable`` is process-wide: a count of the captures in
    progress, so the last one to end turns it back on, and only if it was on
    when the first began)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._was_enabled = False

    def __enter__(self) -> None:
        with self._lock:
            if self._active == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._active += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0 and self._was_enabled:
                gc.enable()


_NO_COLLECTOR = _NoCollector()


def graph_sizes(max_num_seqs: int, configured: list[int] | None = None) -> list[int]:
    """The batch sizes to capture: ``configured`` (sorted, deduplicated), else
    1, 2, 4, then every 8 up to ``max_num_seqs`` (at most 512); never above
    ``max_num_seqs``. A batch between two sizes is padded to the larger."""
    cap = min(max_num_seqs, MAX_GRAPH_SIZE)
    if configured is None:
        wanted = [1, 2, 4, *range(8, cap + 1, 8)]
        if cap not in wanted:
            wanted.append(cap)
    else:
        wanted = list(configured)
    return sorted({n for n in wanted if 1 <= n <= max_num_seqs})


class DecodeGraphs:
    """Owns: one captured graph per batch size, their shared memory pool and
    the hidden-state tensor each graph writes. The step buffers it reads are
    the batch's (``InputBatch.buffers``), whose layout per size is fixed."""

    def __init__(self, forward: Callable[[StepInputs], torch.Tensor], batch: InputBatch, sizes: list[int],
                 *, emulate: bool = False) -> None:
        self._forward = forward
        self._batch = batch
        self.sizes = sorted(sizes)
        self.emulate = emulate
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.memory_bytes = 0
        self.capture_s = 0.0
        self.num_replays = 0

    def capture(self) -> None:
        """Capture every size (largest first, one pool), then let the batch pad
        decode steps to them. Each size runs eagerly once before its capture,
        so every kernel is compiled outside the graph.

        No garbage is collected while capturing: the collector, run by
        whichever allocation triggers it, can free what an engine closed
        earlier in this process left in reference cycles (its CUDA graphs
        among them, whose memory pool goes back with cudaFree), and an unsafe
        call mid-capture invalidates the capture (seen once on an H200 in 300
        oracle engine starts: "operation failed due to a previous error during
        capture"). So the collector runs first and is off until the captures
        end; and the capture mode is thread-local, so only this thread's
        calls can invalidate it, not another thread's (the loop's, a KV
        connector's)."""
        t0 = time.perf_counter()
        batch = self._batch
        if not self.emulate:
            torch.cuda.synchronize()
            reserved_before = torch.cuda.memory_reserved()
            pool = torch.cuda.graph_pool_handle()
            with _NO_COLLECTOR:
                gc.collect()
                for size in reversed(self.sizes):
                    step = batch.dummy_inputs([1] * size, graph=True)
                    self._forward(step)  # warm-up: compiles, and settles the allocator
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                        self._outputs[size] = self._forward(step)
                    self._graphs[size] = graph
            torch.cuda.synchronize()
            self.memory_bytes = max(0, torch.cuda.memory_reserved() - reserved_before)
        batch.graph_sizes = list(self.sizes)
        self.capture_s = time.perf_counter() - t0
        log.info("decode_graphs_captured", sizes=len(self.sizes), largest=self.sizes[-1] if self.sizes else 0,
                 seconds=round(self.capture_s, 2), mib=round(self.memory_bytes / 2**20, 1), emulated=self.emulate)

    def can_run(self, step: StepInputs) -> bool:
        """Whether ``step`` was laid out for one of these graphs (and the batch
        has not grown its buffers since: then it pads to nothing)."""
        return step.graph_size is not None and step.graph_size in self.sizes and bool(self._batch.graph_sizes)

    def run(self, step: StepInputs) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of the real rows of ``step``."""
        size = step.graph_size
        assert size is not None
        self.num_replays += 1
        if self.emulate:
            return self._forward(step)[: step.num_tokens]
        self._graphs[size].replay()
        return self._outputs[size][: step.num_tokens]

    def release(self) -> None:
        """Drop the graphs and their memory; decode steps run eagerly from now on."""
        self._batch.graph_sizes = []
        self._graphs.clear()
        self._outputs.clear()
