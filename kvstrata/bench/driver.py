"""The load driver: start conversations by Poisson arrivals, trace times or
as fast as a fixed concurrency allows; run each conversation's turns in
order, the history growing with the replies; show a progress bar.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time

from tqdm import tqdm

from kvstrata.types import SamplingParams
from kvstrata.bench.targets import LoadTarget, RequestRecord
from kvstrata.bench.workloads import Conversation, build_prompt


class LoadResult:
    """Records of every request plus the run's wall-clock window."""

    def __init__(self, records: list[RequestRecord], start: float, end: float) -> None:
        self.records = records
        self.start = start
        self.end = end


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


async def run_load(target: LoadTarget, convs: list[Conversation], *, rate: float | None = None,
                   concurrency: int | None = None, temperature: float = 0.0, ignore_eos: bool = True,
                   progress: bool = True, seed: int = 0, desc: str = "requests") -> LoadResult:
    """Run every conversation against ``target``; never raises for a failed
    request (it is recorded with its error)."""
    offsets = arrival_times(convs, rate, seed)
    sem = asyncio.Semaphore(concurrency) if concurrency and concurrency > 0 else None
    total = sum(len(c.turns) for c in convs)
    records: list[RequestRecord] = []
    bar = tqdm(total=total, desc=desc, unit="req", disable=not progress, file=sys.stderr,
               dynamic_ncols=True, mininterval=0.5)
    start = time.perf_counter()

    async def one(conv: Conversation, offset: float) -> None:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is None:
            await _conversation(target, conv, records, bar, temperature, ignore_eos)
        else:
            async with sem:
                await _conversation(target, conv, records, bar, temperature, ignore_eos)

    try:
        async with asyncio.TaskGroup() as tg:
            for conv, off in zip(convs, offsets):
                tg.create_task(one(conv, off))
    finally:
        bar.close()
    return LoadResult(records, start, time.perf_counter())


async def _conversation(target: LoadTarget, conv: Conversation, records: list[RequestRecord], bar: tqdm,
                        temperature: float, ignore_eos: bool) -> None:
    history: list[tuple[str, str]] = []
    for i, turn in enumerate(conv.turns):
        prompt = build_prompt(conv.system, history, turn.user)
        params = SamplingParams(max_tokens=turn.max_tokens, temperature=temperature, ignore_eos=ignore_eos)
        rec = RequestRecord(conv_id=conv.conv_id, turn=i, start=time.perf_counter())
        reply = await target.request(prompt, params, rec)
        records.append(rec)
        bar.update(1)
        if rec.error is not None:  # the rest would replay a broken history: skip it
            bar.update(len(conv.turns) - i - 1)
            return
        history.append((turn.user, reply.strip() or turn.reference_reply))
