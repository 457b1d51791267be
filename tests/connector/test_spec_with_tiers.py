"""Speculative decoding with the tiers: a request whose prefix comes back
from the CPU and disk tiers, decoding with n-gram drafts, gets HF's greedy
tokens; the chunks saved never hold a rejected draft's KV (a later request
loading them still matches HF)."""

from __future__ import annotations

from conn_helpers import disk_tier, offload_config, prompt

from kvstrata.config import SpeculativeConfig
from kvstrata.enginecore import SamplingParams

N = 16
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)


async def gen(engine, p, n=N) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=n)
    return [t async for out in engine.generate(p, params) for t in out.new_token_ids]


async def test_drafts_with_tier_loads_and_saves_match_hf(oracle, make_engine, tmp_path):
    kvt = offload_config(tiers=(disk_tier(tmp_path / "disk"),), save_partial=False)
    engine = await make_engine(kvt, speculative=NGRAM)
    base = prompt(5, 6)
    p = base * 5 + prompt(6, 7)  # repetitive: the proposer drafts from it
    out = await gen(engine, p)
    assert out == oracle.greedy(p, N)
    await engine.flush_kv()
    follow = p + out + [3]
    assert await engine.reset_prefix_cache()  # the device cache empty: the prefix comes from the tiers
    assert await gen(engine, follow) == oracle.greedy(follow, N)
    extra = (await engine.stats()).extra
    assert extra["spec.num_draft_tokens"] > 0
    assert extra["connector.cpu.hit_tokens"] + extra.get("connector.disk.hit_tokens", 0) > 0
