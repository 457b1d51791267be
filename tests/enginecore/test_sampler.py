"""Sampler: greedy, temperature, top-k / top-p / min-p masks, seeds, logprobs, bans."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.worker.input_batch import RequestState, SamplingMetadataCache, sampling_metadata, step_seed
from kvstrata.worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_top_k_top_p,
    gather_logprobs,
)
from kvstrata.types import NewRequestData, SamplingParams

NEG = float("-inf")


def meta(temps, **kw) -> SamplingMetadata:
    t = torch.tensor(temps, dtype=torch.float32)
    return SamplingMetadata(temperature=t, all_greedy=bool((t == 0).all()), all_random=bool((t != 0).all()), **kw)


def distinct_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab, generator=g).float() * 0.37 for _ in range(rows)])


def test_greedy_is_argmax():
    logits = distinct_logits(5, 50)
    tokens, lps = Sampler()(logits, meta([0.0] * 5))
    assert tokens == logits.argmax(-1).tolist() and lps is None


def test_mixed_batch_greedy_rows_stay_greedy():
    logits = distinct_logits(4, 30)
    tokens, _ = Sampler(torch.Generator().manual_seed(0))(logits, meta([0.0, 5.0, 0.0, 5.0]))
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())


@given(st.integers(1, 40), st.integers(0, 1000))
@settings(max_examples=40, deadline=None)
def test_top_k_keeps_exactly_k(k, seed):
    logits = distinct_logits(3, 40, seed)
    out = apply_top_k_top_p(logits, torch.tensor([k, 0, 100]), None)
    for row, kk in enumerate([k, 40, 40]):
        kept = torch.isfinite(out[row])
        assert int(kept.sum()) == kk
        assert set(kept.nonzero().flatten().tolist()) == set(logits[row].topk(kk).indices.tolist())
        assert torch.equal(out[row][kept], logits[row][kept])


@given(st.floats(0.01, 1.0), st.integers(0, 1000))
@settings(max_examples=40, deadline=None)
def test_top_p_keeps_the_smallest_set_reaching_p(p, seed):
    logits = distinct_logits(2, 25, seed) * 0.2
    out = apply_top_k_top_p(logits, None, torch.tensor([p, 1.0]))
    probs = torch.softmax(logits[0].double(), -1)
    order = probs.argsort(descending=True)
    cum = probs[order].cumsum(0)
    n = int((cum < p - 1e-6).sum()) + 1  # brute force: first prefix whose mass reaches p
    kept = set(torch.isfinite(out[0]).nonzero().flatten().tolist())
    near_boundary = abs(float(cum[n - 1]) - p) < 1e-5 or (n > 1 and abs(float(cum[n - 2]) - p) < 1e-5)
    if not near_boundary:
        assert kept == set(order[:n].tolist())
    assert bool(torch.isfinite(out[1]).all())


def test_top_k_and_top_p_compose():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    out = apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([0.7]))
    # top-k 3 leaves {0.4, 0.3, 0.2}; renormalised 0.44, 0.33, 0.22: top-p 0.7 keeps the first two
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]


def test_min_p_mask_is_exact():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04], [0.5, 0.3, 0.1, 0.06, 0.04]]))
    out = apply_min_p(logits, torch.tensor([0.15, 0.0]))  # threshold 0.075
    assert torch.isfinite(out).tolist() == [[True, True, True, False, False], [True] * 5]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    logits = probs.log().expand(4000, 4).contiguous()
    tokens, _ = Sampler(torch.Generator().manual_seed(1))(logits, meta([1.0] * 4000))
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_low_temperature_concentrates_and_top_k_1_is_greedy():
    logits = distinct_logits(200, 20)
    s = Sampler(torch.Generator().manual_seed(2))
    cold, _ = s(logits, meta([1e-3] * 200))
    top1, _ = s(logits, meta([1.0] * 200, top_k=torch.ones(200, dtype=torch.int64)))
    assert cold == top1 == logits.argmax(-1).tolist()


def test_seeded_rows_reproduce_and_differ_by_seed():
    logits = torch.zeros(3, 1000)

    def draw(seeds):
        gens = {i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds) if s is not None}
        return Sampler(torch.Generator().manual_seed(99))(logits, meta([1.0] * 3, generators=gens))[0]

    first = draw([7, None, 8])
    again = draw([7, 123, 8])
    assert first[0] == again[0] and first[2] == again[2]
    assert draw([8, None, 7])[0] == first[2]  # the seed, not the row, decides


def test_banned_tokens_are_never_sampled():
    logits = torch.tensor([[10.0, 0.0, 0.0], [10.0, 0.0, 0.0]])
    tokens, _ = Sampler()(logits, meta([0.0, 0.0], banned_token_ids={0: [0]}))
    assert tokens == [1, 0] or tokens == [2, 0]


def test_logprobs_sampled_first_then_top_n_with_rank():
    raw = torch.log_softmax(torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 1.0, 2.0, 3.0]]), -1)
    out = gather_logprobs(raw, torch.tensor([1, 3]), [2, None])
    assert out[1] is None
    lp = out[0]
    assert lp.token_ids == [1, 0, 2] and lp.sampled_rank == 2
    assert lp.logprobs == pytest.approx([raw[0, 1].item(), raw[0, 0].item(), raw[0, 2].item()])
    zero = gather_logprobs(raw, torch.tensor([0, 3]), [0, 0])
    assert [z.token_ids for z in zero] == [[0], [3]] and [z.sampled_rank for z in zero] == [0, 0]


def test_logprobs_come_from_raw_logits_not_processed_ones():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    _, lps = Sampler()(logits, meta([0.0], num_logprobs=[1], banned_token_ids={0: [0]}))
    assert lps[0].token_ids == [1, 0]
    assert lps[0].logprobs == pytest.approx(torch.log_softmax(logits[0], -1)[[1, 0]].tolist())
    assert lps[0].sampled_rank == 1


def _state(params, prompt_len=3, outputs=0):
    data = NewRequestData(req_id="r", token_ids=list(range(prompt_len + outputs)), num_prompt_tokens=prompt_len,
                          sampling_params=params, block_ids=([1],), num_computed_tokens=0)
    return RequestState(data, 0, torch.device("cpu"))


def test_metadata_bans_stop_tokens_until_min_tokens():
    p = SamplingParams(min_tokens=2, stop_token_ids=[5], temperature=0.0)
    m = sampling_metadata([_state(p, outputs=1), _state(p, outputs=2),
                           _state(SamplingParams(min_tokens=2, ignore_eos=True), outputs=0)], (257,), torch.device("cpu"))
    assert m.banned_token_ids == {0: [5, 257]}
    assert m.top_k is None and m.top_p is None and m.min_p is None


def test_metadata_seeds_generators_by_position():
    p = SamplingParams(seed=5, temperature=1.0, top_p=0.9)
    s1, s2 = _state(p, outputs=0), _state(p, outputs=0)
    m = sampling_metadata([s1, s2], (), torch.device("cpu"))
    assert m.top_p.tolist() == pytest.approx([0.9, 0.9]) and set(m.generators) == {0, 1}
    assert m.generators[0].initial_seed() == m.generators[1].initial_seed() == step_seed(5, 3)
    assert step_seed(5, 3) != step_seed(5, 4) and step_seed(5, 3) != step_seed(6, 3)
    assert _state(SamplingParams(seed=5, temperature=0.0)).generator is None  # greedy: no generator


def test_the_metadata_cache_reuses_row_tensors_only_for_the_same_requests_and_redoes_per_step_work():
    """A decode batch samples the same states step after step: their row
    tensors are built once. Seeds follow each step's position and min_tokens
    bans lift as tokens come, as without the cache; another state object
    (the same id re-added, or a different request) rebuilds."""
    cpu = torch.device("cpu")
    seeded = _state(SamplingParams(seed=5, temperature=1.0, top_k=4))
    banned = _state(SamplingParams(min_tokens=2, stop_token_ids=[5], temperature=0.5))
    plain = _state(SamplingParams(temperature=0.0))
    cache = SamplingMetadataCache((257,), cpu)
    for step in range(3):
        states = [seeded, banned, plain]
        got, want = cache(states), sampling_metadata(states, (257,), cpu)
        assert cache.num_builds == 1
        assert got.temperature.tolist() == want.temperature.tolist() and got.top_k.tolist() == want.top_k.tolist()
        assert (got.all_greedy, got.all_random, got.top_p, got.min_p) == (want.all_greedy, want.all_random, None, None)
        assert got.generators[0].initial_seed() == step_seed(5, 3 + step) == want.generators[0].initial_seed()
        assert got.banned_token_ids == want.banned_token_ids == ({1: [5, 257]} if step < 2 else {})
        for s in states:
            s.token_ids.append(9)
    first = cache([seeded, banned, plain]).temperature
    assert cache([seeded, banned, plain]).temperature is first  # reused, not rebuilt
    again = _state(SamplingParams(temperature=0.7))  # same req id "r", another state: new params
    m = cache([seeded, banned, again])
    assert cache.num_builds == 2 and m.temperature.tolist() == pytest.approx([1.0, 0.5, 0.7])
    m = cache([seeded, banned])
    assert cache.num_builds == 3 and m.temperature.tolist() == pytest.approx([1.0, 0.5])


@pytest.mark.parametrize("mixed", [False, True], ids=["all-tiny", "with-a-greedy-row"])
def test_a_temperature_too_small_to_divide_by_samples_greedily(mixed):
    """1e-46 is 0 in float32 and 1e-40 makes the logits overflow: such rows
    are greedy (flags and device temperatures agree), never token 0 of a
    NaN distribution. 1e-3 still samples, and from a near-argmax distribution."""
    tiny = [1e-46, 1e-40, 1e-6] + ([0.0] if mixed else [])
    states = [_state(SamplingParams(temperature=t)) for t in tiny] + [_state(SamplingParams(temperature=1e-3))]
    m = sampling_metadata(states, (), torch.device("cpu"))
    assert m.temperature.tolist()[:len(tiny)] == [0.0] * len(tiny) and not m.all_greedy and not m.all_random
    logits = distinct_logits(len(states), 50, seed=4) * 30
    tokens, _ = Sampler(torch.Generator().manual_seed(0))(logits, m)
    assert tokens == logits.argmax(-1).tolist()
    alone = sampling_metadata(states[:3], (), torch.device("cpu"))
    assert alone.all_greedy and Sampler()(logits[:3], alone)[0] == logits[:3].argmax(-1).tolist()
    assert SamplingParams(temperature=1e-46).greedy and not SamplingParams(temperature=1e-3).greedy


def test_random_draws_stay_inside_the_masks():
    logits = distinct_logits(500, 40, seed=3) * 0.05  # flat: every token would be likely
    m = meta([1.0] * 500, top_k=torch.full((500,), 3), min_p=torch.zeros(500),
             banned_token_ids={i: logits[i].topk(1).indices.tolist() for i in range(0, 500, 2)})
    tokens, _ = Sampler(torch.Generator().manual_seed(4))(logits, m)
    for i, tok in enumerate(tokens):
        ranked = logits[i].topk(4).indices.tolist()
        # Even rows ban their best token first, so top-k keeps the next three.
        assert tok in (ranked[1:] if i % 2 == 0 else ranked[:3])
    assert len(set(tokens)) > 10


def test_banned_ids_past_the_vocabulary_are_left_out():
    """A stop id (or EOS) the model cannot produce bans nothing: indexing past
    the vocabulary would fail the step on a CPU and end the engine on a GPU."""
    logits = torch.tensor([[10.0, 0.0, 0.0], [10.0, 0.0, 0.0]])
    tokens, _ = Sampler()(logits, meta([0.0, 0.0], banned_token_ids={0: [3, 0, 1 << 40], 1: [7]}))
    assert tokens == [1, 0] or tokens == [2, 0]
    assert Sampler().sample(logits, meta([0.0, 0.0], banned_token_ids={1: [3]})).tolist() == [0, 0]
