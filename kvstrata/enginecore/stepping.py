"""How the engine loop hands steps to its single step thread (the
strategies ``AsyncEngine`` picks from the scheduler config):

    SerialSteps       one at a time: schedule, execute, update, then the next
    OverlappedSteps   async scheduling: step N+1 is scheduled and queued
                      behind N while N runs
    PipelinedSteps    and N+1 is launched before N's sampled tokens are read
                      back (``ModelRunner.launch`` / ``collect``)

Each gives the loop a future of a step's output (``submit``), queues what
follows a step (``after``), and hands over the step queued behind the one
that just ended (``take_queued``). Only the loop calls them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

from kvstrata.enginecore.engine_core import EngineCore
from kvstrata.types import ModelRunnerOutput, SchedulerOutput

Step = tuple[SchedulerOutput, "asyncio.Future[ModelRunnerOutput]"]  # a step handed to the step thread


class SerialSteps:
    """Steps one at a time: schedule, execute, update, then the next.

    Owns: the step queued behind the running one (``queued``; never here)
    and the count of steps scheduled while the one before them ran."""

    def __init__(self, core: EngineCore, executor: ThreadPoolExecutor) -> None:
        self._core = core
        self._executor = executor
        self.queued: Step | None = None  # never: nothing is queued behind a step
        self.num_overlapped = 0

    def submit(self, so: SchedulerOutput) -> asyncio.Future[ModelRunnerOutput]:
        """Hand ``so`` to the step thread (steps run there one at a time, in order)."""
        return asyncio.get_running_loop().run_in_executor(self._executor, self._core.execute, so)

    def after(self, so: SchedulerOutput, *, more: bool) -> None:
        """``so`` was handed to the step thread: nothing more to do now
        (``more``: whether a step may be queued behind it)."""

    def take_queued(self) -> Step | None:
        queued, self.queued = self.queued, None
        return queued


class OverlappedSteps(SerialSteps):
    """Async scheduling: while step N runs, step N+1 is scheduled and queued
    behind it. The scheduler counts a placeholder for each token N samples;
    the runner finds that token in its own copy of the request when N+1
    starts (one step thread: N+1 starts after N ends); N's output is applied
    while N+1 runs, and a request that stopped at N gets nothing from N+1."""

    def after(self, so: SchedulerOutput, *, more: bool) -> None:
        """Queue the step after ``so`` (which computes tokens) while it runs."""
        if not more or not so.total_num_scheduled_tokens:
            return  # closing, or a bare poll: what follows waits for its answer
        nxt = self._core.schedule()
        if self._core.should_execute(nxt):
            self.queued = (nxt, self.submit(nxt))
            self.num_overlapped += 1


class PipelinedSteps(OverlappedSteps):
    """Async scheduling with pipelined steps (``scheduler.pipelined_steps``):
    the step thread launches step N+1 before it reads N's sampled tokens
    back (N+1's decode inputs come from N's tokens on the device), so the
    host's work on a step hides behind the device's work on the one before.
    The step thread's jobs, in order: launch N, launch N+1, collect N,
    launch N+2, collect N+1, ... (``ModelRunner.launch``/``collect``).
    A step that must read its tokens at once (a KV connector, drafts,
    logprobs) runs whole in its launch: its output reaches the loop when
    that launch ends, so the loop applies it while N+1 runs.

    Owns also: the output futures of launched steps not yet being collected,
    oldest first (each launch gets exactly one collect, in order)."""

    def __init__(self, core: EngineCore, executor: ThreadPoolExecutor) -> None:
        super().__init__(core, executor)
        self._uncollected: deque[asyncio.Future[ModelRunnerOutput]] = deque()

    def submit(self, so: SchedulerOutput) -> asyncio.Future[ModelRunnerOutput]:
        # a plain job: launch never raises (collect does) and nobody waits for
        # it, so no loop future and no wake-up of the loop when it ends, unless
        # the launch ran the whole step (a connector, drafts, logprobs): then
        # its output goes to the loop at once, not after the launch queued
        # behind it (its collect only finds the future settled)
        loop = asyncio.get_running_loop()
        out: asyncio.Future[ModelRunnerOutput] = loop.create_future()
        self._executor.submit(self._core.launch, so).add_done_callback(partial(_hand_whole_to_loop, loop, out))
        self._uncollected.append(out)
        return out

    def after(self, so: SchedulerOutput, *, more: bool) -> None:
        """Launch the step after ``so`` (when there is one), then collect the
        oldest launched step: ``so``'s output is read after the next launch."""
        super().after(so, more=more)
        out = self._uncollected.popleft()
        loop = asyncio.get_running_loop()
        collected = self._executor.submit(self._core.collect)
        collected.add_done_callback(partial(_hand_to_loop, loop, out))


def _hand_to_loop(loop: asyncio.AbstractEventLoop, out: asyncio.Future[ModelRunnerOutput],
                  done: Future[ModelRunnerOutput]) -> None:
    """In the step thread: settle ``out`` on its loop (gone at interpreter exit: dropped)."""
    try:
        loop.call_soon_threadsafe(_settle_future, out, done)
    except RuntimeError:  # the loop is closed
        pass


def _hand_whole_to_loop(loop: asyncio.AbstractEventLoop, out: asyncio.Future[ModelRunnerOutput],
                        launched: Future[ModelRunnerOutput | None]) -> None:
    """In the step thread, when a launch ends: a step it ran whole settles
    ``out`` now (a launch never raises; one that queued its step returns None)."""
    if launched.cancelled() or launched.exception() is not None or launched.result() is None:
        return
    _hand_to_loop(loop, out, launched)


def _settle_future(out: asyncio.Future[ModelRunnerOutput], done: Future[ModelRunnerOutput]) -> None:
    """On the loop: ``out`` takes the outcome of the step thread's ``done``."""
    if out.done():
        return
    if done.cancelled():
        out.cancel()
    elif (exc := done.exception()) is not None:
        out.set_exception(exc)
    else:
        out.set_result(done.result())
