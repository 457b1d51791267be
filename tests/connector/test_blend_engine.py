"""CacheBlend through the engine: segments' own KV stored under keys of
their tokens alone, found again wherever the segments sit, blended within
the step; identical tokens where the blend is exact (ratio 1, or a segment
that is a prefix), clear errors for bad specs."""

from __future__ import annotations

import pytest
from conn_helpers import disk_tier, offload_config, prompt

from kvstrata.enginecore import SamplingParams
from kvstrata.errors import RequestError
from kvstrata.types import BlendSpec

N = 6


def params(segments, ratio) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=N, blend=BlendSpec(segments=segments, recompute_ratio=ratio))


async def gen(engine, p, sp: SamplingParams) -> list[int]:
    return [t async for out in engine.generate(p, sp) for t in out.new_token_ids]


def blend_counts(stats) -> dict[str, float]:
    return {k.split(".", 1)[1]: v for k, v in stats.extra.items() if k.startswith("connector.blend_")}


def rag(order: list[int], passages: list[list[int]], head: list[int], question: list[int]):
    """head + passages in ``order`` + question; returns (tokens, spans)."""
    toks, spans = list(head), []
    for i in order:
        spans.append((len(toks), len(toks) + len(passages[i])))
        toks += passages[i]
    return toks + question, spans


PASSAGES = [prompt(60 + i, 14) for i in range(3)]
HEAD = prompt(70, 5)
QUESTION = prompt(71, 7)


async def test_full_recompute_matches_a_prefill_and_reuses_segments_in_any_order(oracle, make_engine):
    engine = await make_engine(offload_config())
    p1, spans1 = rag([0, 1, 2], PASSAGES, HEAD, QUESTION)
    assert await gen(engine, p1, params(spans1, 1.0)) == oracle.greedy(p1, N)
    after_first = blend_counts(await engine.stats())
    assert after_first["blend_requests"] == 1 and after_first["blend_segment_misses"] == 3
    # The same passages, shuffled: every segment's KV comes from the store.
    p2, spans2 = rag([2, 0, 1], PASSAGES, HEAD, QUESTION)
    assert await gen(engine, p2, params(spans2, 1.0)) == oracle.greedy(p2, N)
    counts = blend_counts(await engine.stats())
    assert counts["blend_segment_hits"] == 3 and counts["blend_segment_misses"] == 3


async def test_a_segment_that_is_the_prefix_blends_exactly_at_ratio_zero(oracle, make_engine):
    engine = await make_engine(offload_config())
    p = PASSAGES[0] + PASSAGES[1] + QUESTION
    sp = params([(0, 28)], 0.0)
    assert await gen(engine, p, sp) == oracle.greedy(p, N)  # computed on its own, then reused
    assert await engine.reset_prefix_cache()
    assert await gen(engine, p, sp) == oracle.greedy(p, N)  # from the store
    assert blend_counts(await engine.stats())["blend_segment_hits"] == 1


async def test_segments_come_back_from_disk(oracle, make_engine, tmp_path):
    engine = await make_engine(offload_config(tiers=(disk_tier(tmp_path / "disk"),)))
    p1, spans1 = rag([0, 1], PASSAGES, HEAD, QUESTION)
    assert await gen(engine, p1, params(spans1, 1.0)) == oracle.greedy(p1, N)
    await engine.flush_kv()
    engine.core.kv_connector.store.l1.clear()
    p2, spans2 = rag([1, 0], PASSAGES, HEAD, QUESTION)
    assert await gen(engine, p2, params(spans2, 1.0)) == oracle.greedy(p2, N)
    assert blend_counts(await engine.stats())["blend_segment_hits"] == 2


async def test_partial_recompute_still_serves_and_plain_requests_never_hit_blended_blocks(oracle, make_engine):
    engine = await make_engine(offload_config())
    p, spans = rag([0, 1, 2], PASSAGES, HEAD, QUESTION)
    await gen(engine, p, params(spans, 1.0))  # stores the segments
    p2, spans2 = rag([1, 2, 0], PASSAGES, HEAD, QUESTION)
    out = await gen(engine, p2, params(spans2, 0.3))
    assert len(out) == N
    # The approximate blocks are salted with the blend spec: a plain prefill of
    # the same prompt computes its own and matches the oracle.
    assert await gen(engine, p2, SamplingParams(temperature=0.0, max_tokens=N)) == oracle.greedy(p2, N)
    # The same blend again reuses its own blocks on the device: same tokens.
    assert await gen(engine, p2, params(spans2, 0.3)) == out


@pytest.mark.parametrize("spec, field", [
    (lambda n: BlendSpec(segments=[(0, 8)], recompute_ratio=1.5), "blend.recompute_ratio"),
    (lambda n: BlendSpec(segments=[(0, 8)], recompute_ratio=-0.1), "blend.recompute_ratio"),
    (lambda n: BlendSpec(segments=[(0, n)]), "blend.segments"),
    (lambda n: BlendSpec(segments=[(4, 12), (8, 16)]), "blend.segments[1]"),
    (lambda n: BlendSpec(segments=[(5, 5)]), "blend.segments[0]"),
    (lambda n: BlendSpec(segments=[]), "blend.segments"),
])
async def test_bad_blend_specs_are_refused_by_name(make_engine, spec, field):
    engine = await make_engine(offload_config())
    p = prompt(80, 30)
    with pytest.raises(RequestError) as e:
        await gen(engine, p, SamplingParams(max_tokens=2, blend=spec(len(p))))
    assert e.value.field == field
    # The engine goes on serving.
    assert len(await gen(engine, p, SamplingParams(temperature=0.0, max_tokens=2))) == 2


async def test_an_engine_without_the_offload_connector_refuses_blend(make_engine):
    engine = await make_engine(None)
    with pytest.raises(RequestError) as e:
        await gen(engine, prompt(81, 30), params([(0, 8)], 0.15))
    assert e.value.field == "blend" and "offload connector" in str(e.value)
