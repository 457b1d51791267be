"""Speculative decoding: the n-gram proposer, the drafts' limits, the
rejection sampler's exactness (chi-square against the model's own
distribution), and the KV cache: rejected positions are rolled back and a
block holding rejected KV is never a prefix hit."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from hf_utils import build_tiny_family, hf_greedy
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from kvstrata.enginecore.async_engine import AsyncEngine
from kvstrata.enginecore.request import Request
from kvstrata.enginecore.spec_decode import NgramProposer, drafts_allowed, ngram_lookup
from kvstrata.types import SamplingParams
from kvstrata.worker.sampler import Sampler, SamplingMetadata


def naive_lookup(tokens, min_n, max_n, k):
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == tail:
                return tokens[i + n:i + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 5), min_size=0, max_size=40), min_n=st.integers(1, 3),
       extra=st.integers(0, 3), k=st.integers(1, 5))
def test_ngram_lookup_equals_the_obvious_search(tokens, min_n, extra, k):
    assert ngram_lookup(tokens, min_n, min_n + extra, k) == naive_lookup(tokens, min_n, min_n + extra, k)


def test_big_token_ids_do_not_match_across_token_boundaries():
    # as u32 bytes, [0x01000000, 0x00000001] contains the bytes of 1 at an odd offset
    toks = [0x01000000, 0x00000001, 7, 1]
    assert ngram_lookup(toks, 1, 1, 2) == [7, 1]  # the earlier 1 at index 1, never a byte-shifted match


def _req(prompt, **params) -> Request:
    return Request("r", prompt, SamplingParams(**params))


def test_drafts_stop_at_max_tokens_and_skip_requests_that_need_one_token_at_a_time():
    r = _req([1, 2, 3], max_tokens=5)
    r.all_token_ids += [4, 5, 6]  # 3 outputs: 2 more allowed, one of them the model's own
    assert drafts_allowed(r, 100) == 1
    assert drafts_allowed(_req([1, 2], max_tokens=50), 4) == 1  # max_model_len 4: room for 2 tokens
    assert drafts_allowed(_req([1, 2], max_tokens=50, logprobs=1), 100) == 0
    assert drafts_allowed(_req([1, 2], max_tokens=50, temperature=1.0, seed=3), 100) == 0
    assert drafts_allowed(_req([1, 2], max_tokens=50, min_tokens=2), 100) == 0
    proposer = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2),
                             max_model_len=100)
    rep = _req([1, 2, 3, 1, 2], max_tokens=50)
    assert proposer.propose([rep]) == {"r": [3, 1, 2]}


# --- the rejection sampler ------------------------------------------------------------

def _chi2_stat(counts, probs, n):
    return sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(probs) if p > 0)


def test_rejection_sampling_keeps_the_models_distribution():
    """One position, draft = the most likely token, and a second position
    conditioned on the first: the kept/resampled tokens follow p exactly
    (chi-square, 20,000 draws per case; a 2% shift of mass is far beyond
    the 0.001 critical value)."""
    torch.manual_seed(0)
    vocab = 6
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0],
                           [0.0, 1.5, 1.5, 0.2, -0.5, 0.0]])
    probs = torch.softmax(logits, dim=-1)
    meta = SamplingMetadata(temperature=torch.ones(2), all_greedy=False, all_random=True)
    sampler = Sampler(torch.Generator().manual_seed(1234))
    n = 20_000
    first = [0] * vocab
    second_given_kept = [0] * vocab
    kept = 0
    for _ in range(n):
        out = sampler.verify_drafts(logits, meta, [(0, [0])])[0]  # draft token 0 at position 0
        first[out[0]] += 1
        if len(out) == 2:
            kept += 1
            second_given_kept[out[1]] += 1
    # chi-square critical value, 5 degrees of freedom, p = 0.001: 20.5
    assert _chi2_stat(first, probs[0].tolist(), n) < 20.5
    assert _chi2_stat(second_given_kept, probs[1].tolist(), kept) < 20.5
    assert abs(kept / n - float(probs[0, 0])) < 0.015
    # the same test notices a 2% shift: against a distribution moved by 0.02
    shifted = probs[0].tolist()
    shifted[0] -= 0.02
    shifted[1] += 0.02
    assert _chi2_stat(first, shifted, n) > 20.5


def test_greedy_keeps_drafts_while_they_equal_the_argmax():
    logits = torch.tensor([[0.0, 5.0, 0.0], [4.0, 0.0, 0.0], [0.0, 0.0, 3.0], [1.0, 0.0, 0.0]])
    meta = SamplingMetadata(temperature=torch.zeros(4), all_greedy=True, all_random=False)
    s = Sampler()
    assert s.verify_drafts(logits, meta, [(0, [1, 0, 2])]) == [[1, 0, 2, 0]]  # all kept + bonus
    assert s.verify_drafts(logits, meta, [(0, [1, 2, 2])]) == [[1, 0]]  # second rejected: argmax instead
    assert s.verify_drafts(logits, meta, [(0, [2, 0, 2])]) == [[1]]


# --- the engine -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_spec")
    return str(path), build_tiny_family(path, "llama", seed=5)


async def _engine(path, kv_managers, *, spec: bool, num_blocks=256, **sched) -> AsyncEngine:
    config = EngineConfig(model=ModelConfig(model=path), device="cpu",
                          cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                          scheduler=SchedulerConfig(**sched),
                          speculative=SpeculativeConfig(method="ngram" if spec else None,
                                                        num_speculative_tokens=4, prompt_lookup_min=1))
    engine = await AsyncEngine.start(config)
    kv_managers.append(engine.core.kv)
    return engine


async def _gen(engine, prompt, params):
    return [t async for o in engine.generate(prompt, params) for t in o.new_token_ids]


async def test_a_block_holding_rejected_kv_is_never_a_prefix_hit(tiny, kv_managers):
    """Drafts rejected at a position leave wrong KV in that slot until it is
    recomputed. Every full block of the committed sequence is then served
    to a second request from the prefix cache: its tokens must still equal
    HF's (a cached block with a rejected draft's KV would change them)."""
    path, model = tiny
    engine = await _engine(path, kv_managers, spec=True)
    try:
        rng = random.Random(11)
        motif = [rng.randrange(2, 256) for _ in range(3)]
        prompt = motif * 4 + [rng.randrange(2, 256) for _ in range(5)]
        params = SamplingParams(temperature=0.0, max_tokens=24)
        out = await _gen(engine, prompt, params)
        assert out == hf_greedy(model, prompt, 24)
        extra = (await engine.stats()).extra
        assert extra["spec.num_draft_tokens"] > extra["spec.num_accepted_tokens"]  # some were rejected
        follow = prompt + out + [9]
        hits_before = (await engine.stats()).prefix_cache_hits
        got = await _gen(engine, follow, SamplingParams(temperature=0.0, max_tokens=6))
        assert (await engine.stats()).prefix_cache_hits - hits_before >= (len(prompt) + len(out) - 4) // 4 * 4
        assert got == hf_greedy(model, follow, 6)
    finally:
        await engine.aclose()


async def test_sampling_with_drafts_keeps_the_token_distribution(tiny, kv_managers):
    """Engine level: the first three tokens of 600 sampled continuations of a
    repetitive prompt, with speculative decoding on and off, have the same
    distribution (chi-square on the first token, and on the pair counts
    pooled; fixed sampler seed per engine)."""
    path, model = tiny
    seed_prompt = [17, 42, 99, 3, 250]
    # the prompt repeats itself after its own greedy continuation: the proposer
    # drafts that continuation whenever a sample starts the same way
    prompt = seed_prompt + hf_greedy(model, seed_prompt, 6) + seed_prompt
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=3)
    results = {}
    for spec in (False, True):
        engine = await _engine(path, kv_managers, spec=spec)
        try:
            outs = []
            for _ in range(12):
                outs += await asyncio.gather(*(_gen(engine, prompt, params) for _ in range(50)))
            results[spec] = outs
            if spec:
                assert (await engine.stats()).extra["spec.num_draft_tokens"] > 0
        finally:
            await engine.aclose()
    from collections import Counter

    for pos in range(3):
        a = Counter(o[pos] for o in results[False])
        b = Counter(o[pos] for o in results[True])
        stat, df = _two_sample_chi2(a, b)
        assert stat < _chi2_critical(df), (pos, stat, df, a, b)


def _two_sample_chi2(a, b):
    """Two-sample chi-square on token counts; tokens seen fewer than 10 times
    in both samples together are pooled into one bin."""
    na, nb = sum(a.values()), sum(b.values())
    bins, rare = [], [0, 0]
    for k in set(a) | set(b):
        if a[k] + b[k] >= 10:
            bins.append((a[k], b[k]))
        else:
            rare[0] += a[k]
            rare[1] += b[k]
    if sum(rare):
        bins.append(tuple(rare))
    stat = 0.0
    for ca, cb in bins:
        tot = ca + cb
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb
    return stat, max(len(bins) - 1, 1)


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability 0.001 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


async def test_preempted_requests_with_drafts_match_and_free_everything(tiny, kv_managers):
    path, model = tiny
    engine = await _engine(path, kv_managers, spec=True, num_blocks=14)
    try:
        rng = random.Random(3)
        prompts = [[rng.randrange(2, 256) for _ in range(3)] * 5 for _ in range(4)]
        params = SamplingParams(temperature=0.0, max_tokens=12)
        outs = await asyncio.gather(*(_gen(engine, p, params) for p in prompts))
        for p, o in zip(prompts, outs):
            assert o == hf_greedy(model, p, 12)
        st_ = await engine.stats()
        assert st_.num_preemptions > 0 and st_.extra["spec.num_draft_tokens"] > 0
    finally:
        await engine.aclose()
