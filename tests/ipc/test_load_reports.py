"""The engine's LoadReports to clients that follow its KV events: the work
queued there (every client's requests) and how many of *this* client's
requests it has taken in; sent when that changes and, unchanged, every
LOAD_REPORT_REFRESH_S; a client that did not subscribe gets none."""

from __future__ import annotations

import asyncio
import time

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvstrata.ipc import protocol as P
from kvstrata.ipc.mp_client import MPEngineClient
from kvstrata.types import EngineLoad, SamplingParams

# 32 tokens a step: four 400-token prompts take 50 steps to prefill, so the
# reports (every 20 ms at most) see prefill still queued.
CONFIG = EngineConfig(device="cpu", log_level="WARNING", model=ModelConfig(num_threads=1, max_model_len=512),
                      cache=CacheConfig(block_size=4, num_blocks=512, enable_kv_events=True),
                      scheduler=SchedulerConfig(max_num_batched_tokens=32))


async def test_load_reports_follow_the_work_and_count_this_clients_requests():
    owner = await MPEngineClient.start(CONFIG)
    other = await MPEngineClient.connect(owner.address)
    try:
        reports: list[tuple[float, P.LoadReport]] = []
        await owner.subscribe_kv_events(lambda _m: None, load_listener=lambda m: reports.append((time.monotonic(), m)))
        heard_by_other: list[P.LoadReport] = []
        other._load_listener = heard_by_other.append  # never subscribed: must stay empty

        async def run(client, k: int) -> int:
            prompt = [(31 * k + 7 * j) % 250 + 1 for j in range(400)]
            params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
            return sum([len(o.new_token_ids) async for o in client.generate(prompt, params)])

        jobs = [asyncio.create_task(run(owner, k)) for k in range(3)] + [asyncio.create_task(run(other, 9))]
        async with asyncio.timeout(60):  # all four there: the other client's in the load, not in our count
            while not (full := [m for _, m in reports if m.load.num_running + m.load.num_waiting == 4]):
                await asyncio.sleep(0.01)
        assert full[0].received == 3 and max(m.received for _, m in reports) == 3
        assert all(m.epoch == owner.info.epoch for _, m in reports)
        assert any(m.load.queued_prefill_tokens > 0 for _, m in reports)
        assert await asyncio.gather(*jobs) == [30] * 4
        async with asyncio.timeout(10):
            while reports[-1][1].load != EngineLoad():
                await asyncio.sleep(0.01)
        idle_since = len(reports)
        await asyncio.sleep(2.5)  # idle and unchanged: refreshed about every LOAD_REPORT_REFRESH_S
        refreshed = [t for t, m in reports[idle_since:] if m.load == EngineLoad()]
        assert 2 <= len(refreshed) <= 3, refreshed
        assert heard_by_other == []
    finally:
        await other.aclose()
        await owner.aclose()
