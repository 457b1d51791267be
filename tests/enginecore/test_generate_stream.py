"""The per-request stream behind ``AsyncEngine.generate`` (``_Stream``):
items come out in order; a consumer that fell behind takes everything
pending in one wake-up; a waiting consumer is woken by a put; a cancelled
take leaves the stream usable and nothing lost."""

from __future__ import annotations

import asyncio

from kvstrata.enginecore.async_engine import _Stream


async def test_pending_items_come_out_together_and_in_order():
    s = _Stream(asyncio.get_running_loop())
    for i in range(3):
        s.put(i)
    assert await s.take() == [0, 1, 2]
    s.put(3)
    assert await s.take() == [3]


async def test_a_waiting_take_is_woken_by_a_put():
    s = _Stream(asyncio.get_running_loop())
    task = asyncio.create_task(s.take())
    await asyncio.sleep(0)
    assert not task.done()
    s.put("a")
    s.put(ValueError("b"))  # exceptions travel as items; generate raises them in order
    got = await asyncio.wait_for(task, 1)
    assert got[0] == "a" and isinstance(got[1], ValueError)


async def test_a_cancelled_take_loses_nothing():
    s = _Stream(asyncio.get_running_loop())
    task = asyncio.create_task(s.take())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    s.put(1)  # no waiter left to wake: kept for the next take
    assert await asyncio.wait_for(s.take(), 1) == [1]
