"""One hash pass per request, through real engine subprocesses: the fleet's
router hashes a prompt lazily for its decision, finishes the chain after
it, and sends it with the request; the engine takes that chain instead of
hashing the prompt (``engine.given_chains``), refuses none, and serves the
same greedy tokens and the same prefix hits as when it hashes itself."""

from __future__ import annotations

from kvstrata.types import SamplingParams
from tests.fleet.fleet_helpers import Engines, open_fleet, tiny_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=5)


async def _run(client, prompt, **kw) -> tuple[list[int], int]:
    out, cached = [], 0
    async for o in client.generate(prompt, GREEDY, **kw):
        out += o.new_token_ids
        cached = max(cached, o.num_cached_tokens)
    return out, cached


async def _chains(fleet) -> dict[str, tuple[float, float]]:
    stats = (await fleet.fleet_stats()).replicas
    return {n: (s.extra["engine.given_chains"], s.extra["engine.given_chains_refused"]) for n, s in stats.items()}


async def test_the_fleets_chain_reaches_the_engine_which_does_not_hash_again():
    engines = Engines(tiny_config(), 2)
    fleet = None
    try:
        fleet = await open_fleet(engines)
        before = await _chains(fleet)
        assert all(refused == 0 for _, refused in before.values())
        prompts = [[(13 * k + i) % 250 + 1 for i in range(22)] for k in range(4)]  # 5 full blocks each
        got = [await _run(fleet, p) for p in prompts]
        # Salted prompts: the router's chain carries the salt as the engine's does.
        salted = [await _run(fleet, prompts[0], cache_salt="tenant-a") for _ in range(2)]
        session = await _run(fleet, prompts[1] + [7, 7, 7, 7], session_key="user-1")
        after = await _chains(fleet)
        given = sum(after[n][0] - before[n][0] for n in after)
        assert given == len(prompts) + len(salted) + 1  # every request came with its chain...
        assert all(after[n][1] == 0 for n in after)  # ...and the engines took every one

        for k, p in enumerate(prompts):  # the same tokens as the engine hashing the prompt itself
            home = fleet.router.choose(fleet.router.hash_prompt(p), num_tokens=len(p)).replica
            own, cached = await _run(fleet.replicas[home].client, p)
            assert own == got[k][0]
            assert cached == 20  # the blocks cached under the fleet's chain are the engine's own hashes
        assert salted[0][0] == got[0][0] and salted[0][1] == 0  # another tenant's salt: no hit on it
        assert salted[1][1] == 20  # ...and its second request hits the first's blocks
        home = fleet.router.choose(fleet.router.hash_prompt(prompts[0], cache_salt="tenant-a"),
                                   num_tokens=len(prompts[0])).replica
        own, cached = await _run(fleet.replicas[home].client, prompts[0], cache_salt="tenant-a")
        assert (own, cached) == (got[0][0], 20)  # the engine's own salted hashes: the fleet's chain
        assert session[1] == 20  # a session's follow-up: a hit past the remembered prefix
        status = fleet.fleet_status()
        assert status["decision_us"]["p50"] > 0 and status["hash_after_decision_us"]["p50"] > 0
        assert len(fleet.router.decision_ns) == len(prompts) + len(salted) + 1 + len(prompts) + 1  # the choose() calls
    finally:
        if fleet is not None:
            await fleet.aclose()
        engines.close()
