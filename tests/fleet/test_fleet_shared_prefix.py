"""A shared system prompt through real engine subprocesses: the first
conversations go where the prompt is cached, the fleet counts them as
continuations of it (``Router.shared``, fed by every dispatch), and once it
is shared a new conversation goes to the idle engine instead of queueing
behind the busy one that cached the prompt first."""

from __future__ import annotations

import asyncio

from kvstrata.types import SamplingParams
from tests.fleet.fleet_helpers import Engines, open_fleet, tiny_config

SYSTEM = [(5 * i) % 200 + 3 for i in range(12)]  # 3 full blocks of 4 tokens


def conversation(k: int, extra: int = 0) -> list[int]:
    return SYSTEM + [(7 * k + i) % 250 + 1 for i in range(10 + extra)]


async def _finish(fleet, prompt: list[int], rid: str, max_tokens: int = 4) -> None:
    async for _ in fleet.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                                  request_id=rid):
        pass


async def test_a_shared_system_prompt_lets_new_conversations_go_to_the_idle_engine():
    engines = Engines(tiny_config(), 2)
    fleet = None
    try:
        fleet = await open_fleet(engines)
        router = fleet.router
        assert router is not None and router.shared is not None
        for k in range(3):  # one after another: each continues the system prompt where it is cached
            await _finish(fleet, conversation(k), f"c{k}")
        sent = dict(router.dispatch_log)
        home = sent["c0"]
        assert sent["c1"] == sent["c2"] == home
        assert router.shared.depth(router.hash_prompt(SYSTEM)) == len(SYSTEM) // 4  # c1, c2: two continuations

        # c0's next turn runs long at home; meanwhile a new conversation arrives
        first = asyncio.Event()

        async def long_turn() -> None:
            params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
            async for o in fleet.generate(conversation(0, extra=8), params, request_id="c0-turn2"):
                if o.new_token_ids:
                    first.set()

        task = asyncio.create_task(long_turn())
        await asyncio.wait_for(first.wait(), 60)
        assert not task.done()
        chain = router.chain(conversation(3))
        d = router.choose(chain, num_tokens=len(conversation(3)))  # what the fleet is about to decide
        assert d.shared_blocks == len(SYSTEM) // 4 and d.replica != home, d
        await task
        assert dict(router.dispatch_log)["c0-turn2"] == home  # its history stays home
    finally:
        if fleet is not None:
            await fleet.aclose()
        engines.close()
