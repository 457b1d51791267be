"""The load driver: start conversations by Poisson arrivals, trace times or
as fast as a fixed concurrency allows; run each conversation's turns in
order, the history growing with the replies; show progress.

Two turn orders (``turn_order``):

    "conversation"  each conversation's turns back to back (a slot of the
                    concurrency limit held for the whole conversation)
    "round"         every conversation's turn k before any turn k + 1, the
                    limit applied per request, the conversations in a seeded
                    shuffled order each round after the first: users who
                    come back after some of the others spoke. A
                    conversation's KV is reused from right away to two
                    rounds later, so a device cache smaller than a round
                    keeps some of it and hands the rest to the CPU and disk
                    tiers (``kvstrata run``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
from collections.abc import AsyncIterator
from typing import Protocol, TextIO

from kvstrata.types import SamplingParams
from kvstrata.bench.targets import LoadTarget, RequestRecord
from kvstrata.bench.workloads import Conversation, build_prompt

TURN_ORDERS = ("conversation", "round")


class LoadResult:
    """Records of every request (with its user message and reply), the
    conversations they came from, and the run's wall-clock window."""

    def __init__(self, records: list[RequestRecord], start: float, end: float,
                 convs: list[Conversation] | None = None) -> None:
        self.records = records
        self.start = start
        self.end = end
        self.convs = convs or []


def arrival_times(convs: list[Conversation], rate: float | None, seed: int) -> list[float]:
    """Start offsets (s): the trace's own, else Poisson at ``rate`` conversations/s,
    else all at 0 (the concurrency limit paces them)."""
    if any(c.arrival_s is not None for c in convs):
        t0 = min(c.arrival_s or 0.0 for c in convs)
        return [(c.arrival_s or 0.0) - t0 for c in convs]
    if rate is None or rate <= 0 or rate == float("inf"):
        return [0.0] * len(convs)
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in convs:
        out.append(t)
        t += rng.expovariate(rate)
    return out


# -- progress -------------------------------------------------------------------------------

class Progress(Protocol):
    def update(self, n: int = 1) -> None: ...

    def close(self) -> None: ...


class _NoProgress:
    def update(self, n: int = 1) -> None:
        return None

    def close(self) -> None:
        return None


class LineProgress:
    """Progress where no terminal redraws it (a pipe, a file, CI logs): one
    line each time another ``every_pct`` percent is done, never a carriage
    return, so log lines around it stay whole."""

    def __init__(self, total: int, desc: str, stream: TextIO, every_pct: int = 10) -> None:
        self.total, self.desc, self.stream, self.every = max(total, 1), desc, stream, every_pct
        self.done = 0
        self._next_pct = every_pct
        self._t0 = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.done += n
        pct = self.done * 100 // self.total
        if pct >= self._next_pct:
            self._next_pct = (pct // self.every + 1) * self.every
            self.stream.write(f"{self.desc}: {self.done}/{self.total} ({pct}%) "
                              f"in {time.perf_counter() - self._t0:.1f} s\n")
            self.stream.flush()

    def close(self) -> None:
        return None


def progress_display(total: int, desc: str, *, enabled: bool, stream: TextIO | None = None) -> Progress:
    """A tqdm bar on a terminal, ``LineProgress`` elsewhere, nothing when disabled."""
    stream = stream if stream is not None else sys.stderr
    if not enabled:
        return _NoProgress()
    if not stream.isatty():
        return LineProgress(total, desc, stream)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=stream, dynamic_ncols=True, mininterval=0.5)


# -- the load -------------------------------------------------------------------------------

class _Replay:
    """Sends turns. Owns: the records and the progress display."""

    def __init__(self, target: LoadTarget, progress: Progress, temperature: float, ignore_eos: bool) -> None:
        self.target, self.progress = target, progress
        self.temperature, self.ignore_eos = temperature, ignore_eos
        self.records: list[RequestRecord] = []

    async def turn(self, conv: Conversation, i: int, history: list[tuple[str, str]]) -> bool:
        """Turn ``i`` of ``conv`` after ``history`` (extended with its reply);
        False when it failed (the rest of the conversation is counted done)."""
        turn = conv.turns[i]
        prompt = build_prompt(conv.system, history, turn.user)
        params = SamplingParams(max_tokens=turn.max_tokens, temperature=self.temperature,
                                ignore_eos=self.ignore_eos and conv.ignore_eos, stop=list(conv.stop))
        rec = RequestRecord(conv_id=conv.conv_id, turn=i, start=time.perf_counter(), user=turn.user)
        rec.reply = await self.target.request(prompt, params, rec)
        self.records.append(rec)
        self.progress.update(1)
        if rec.error is not None:  # the rest would replay a broken history: skip it
            self.progress.update(len(conv.turns) - i - 1)
            return False
        history.append((turn.user, rec.reply.strip() or turn.reference_reply))
        return True


async def run_load(target: LoadTarget, convs: list[Conversation], *, rate: float | None = None,
                   concurrency: int | None = None, temperature: float = 0.0, ignore_eos: bool = True,
                   progress: bool = True, seed: int = 0, desc: str = "requests",
                   turn_order: str = "conversation") -> LoadResult:
    """Run every conversation against ``target``; never raises for a failed
    request (it is recorded with its error). Arrival offsets (``rate``, a
    trace) start the conversations, or in round order the first round."""
    if turn_order not in TURN_ORDERS:
        raise ValueError(f"turn_order must be one of {TURN_ORDERS}, got {turn_order!r}")
    offsets = arrival_times(convs, rate, seed)
    sem = asyncio.Semaphore(concurrency) if concurrency and concurrency > 0 else None
    display = progress_display(sum(len(c.turns) for c in convs), desc, enabled=progress)
    replay = _Replay(target, display, temperature, ignore_eos)
    start = time.perf_counter()

    async def arrive(offset: float) -> None:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)

    async def conversation(conv: Conversation, offset: float) -> None:
        await arrive(offset)
        async with _slot(sem):
            history: list[tuple[str, str]] = []
            for i in range(len(conv.turns)):
                if not await replay.turn(conv, i, history):
                    return

    histories: dict[int, list[tuple[str, str]]] = {k: [] for k in range(len(convs))}
    alive = set(histories)

    async def round_turn(k: int, i: int, offset: float) -> None:
        await arrive(offset)
        async with _slot(sem):
            if not await replay.turn(convs[k], i, histories[k]):
                alive.discard(k)

    try:
        if turn_order == "conversation":
            async with asyncio.TaskGroup() as tg:
                for conv, off in zip(convs, offsets):
                    tg.create_task(conversation(conv, off))
        else:
            rng = random.Random(seed)
            for i in range(max((len(c.turns) for c in convs), default=0)):
                order = sorted(k for k in alive if i < len(convs[k].turns))
                if i > 0:
                    rng.shuffle(order)
                async with asyncio.TaskGroup() as tg:  # tasks start, and take slots, in this order
                    for k in order:
                        tg.create_task(round_turn(k, i, offsets[k] if i == 0 else 0.0))
    finally:
        display.close()
    return LoadResult(replay.records, start, time.perf_counter(), convs)


@contextlib.asynccontextmanager
async def _slot(sem: asyncio.Semaphore | None) -> AsyncIterator[None]:
    if sem is None:
        yield
        return
    async with sem:
        yield
