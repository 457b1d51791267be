"""CacheBlend (``kvstrata.worker.blend``): re-rotation is exact, the ends of
the ratio range are a full prefill and plain concatenation, the engine's own
paged forward is the oracle, and on the real SmolLM2 a partial recompute
brings shuffled passages closer to the full prefill than concatenation."""

from __future__ import annotations

import pytest
import torch

from kvstrata.worker.blend import (
    SegmentKV,
    blend_prefill,
    compute_segment_kv,
    full_prefill,
    greedy_decode,
    rerotate,
)
from kvstrata.worker.model import AttentionMetadata, LlamaForCausalLM, RopeConfig, parse_arch_config
from kvstrata.worker.model.rope import RotaryEmbedding, apply_rotary

TINY = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100,
            max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
FAMILIES = {
    "llama": {},
    "qwen3": dict(architectures=["Qwen3ForCausalLM"]),  # q/k norm
    "mistral": dict(architectures=["MistralForCausalLM"], sliding_window=7),  # every layer windowed
}
ATOL = 2e-5


def tiny_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A random fp32 model with a wide init (well separated logits) and norm weights off 1."""
    cfg = parse_arch_config({**TINY, **overrides}, "tiny")
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(cfg, torch.float32)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        else:
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    return model.eval()


def paged_prefill(model: LlamaForCausalLM, ids: list[int], block_size: int = 8):
    """The engine's path: the model's paged forward into a fresh cache.
    Returns (last-token logits, kv (layers, 2, tokens, kv_heads, head_dim))."""
    cfg, n = model.config, len(ids)
    blocks = 1 + -(-n // block_size)
    caches = [(torch.zeros(blocks, block_size, cfg.num_key_value_heads, cfg.head_dim),
               torch.zeros(blocks, block_size, cfg.num_key_value_heads, cfg.head_dim))
              for _ in range(cfg.num_hidden_layers)]
    meta = AttentionMetadata(slot_mapping=torch.arange(block_size, block_size + n),
                             block_tables=torch.arange(1, blocks, dtype=torch.int32)[None, :],
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32))
    hidden = model(torch.tensor(ids), torch.arange(n), meta, caches)
    kv = torch.stack([torch.stack([c.flatten(0, 1)[block_size:block_size + n] for c in pair]) for pair in caches])
    return model.compute_logits(hidden[-1:])[0], kv


def random_ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_model()


ROPES = {
    "default": RopeConfig(),
    "yarn": RopeConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    "llama3": RopeConfig(rope_type="llama3", factor=8.0, original_max_position_embeddings=64),
}


@pytest.mark.parametrize("rope", list(ROPES.values()), ids=list(ROPES))
def test_rerotate_equals_k_rotated_at_the_shifted_position(rope):
    """Also for a scaled RoPE: yarn's attention factor is applied once, not again."""
    emb = RotaryEmbedding(rope, 32)
    k = torch.randn(20, 3, 32, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(20)
    for delta in (1, 37, 300):
        at_p = apply_rotary(k, *emb.cos_sin(pos, torch.float32))
        at_shifted = apply_rotary(k, *emb.cos_sin(pos + delta, torch.float32))
        torch.testing.assert_close(rerotate(at_p, delta, emb), at_shifted, atol=1e-4, rtol=0)
        assert not torch.allclose(at_p, at_shifted, atol=1e-2)


def test_a_cached_segment_rerotated_equals_its_layer0_k_in_a_longer_context(model):
    """Layer 0 sees only the token: a segment's standalone K moved to its new
    place is the full prefill's K there; V needs no change."""
    ids = random_ids(30)
    seg = compute_segment_kv(model, ids[11:25])
    full = full_prefill(model, ids)
    torch.testing.assert_close(rerotate(seg.kv[0, 0], 11, model.rotary), full.kv[0, 0, 11:25], atol=ATOL, rtol=0)
    torch.testing.assert_close(seg.kv[0, 1], full.kv[0, 1, 11:25], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ratio_one_is_the_models_paged_prefill(family):
    model = tiny_model(**FAMILIES[family])
    ids = random_ids(40)
    segments = [(3, 12), (12, 30), (31, 38)]
    cached = [compute_segment_kv(model, ids[s:e]) for s, e in segments]
    want_logits, want_kv = paged_prefill(model, ids)
    got = blend_prefill(model, ids, segments, cached, 1.0)
    torch.testing.assert_close(got.logits, want_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(got.kv, want_kv, atol=ATOL, rtol=0)
    assert got.recomputed.tolist() == list(range(40))
    assert got.selected.tolist() == [*range(3, 30), *range(31, 38)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_queries_in_blocks_give_the_blend_of_one_call(family, monkeypatch):
    """_attend runs ATTEND_BLOCK queries per SDPA call (bounded temporaries on
    long prompts): blocks of 7 give exactly the result of one call."""
    from kvstrata.worker import blend

    model = tiny_model(**FAMILIES[family])
    ids = random_ids(40)
    segments = [(3, 12), (12, 30)]
    cached = [compute_segment_kv(model, ids[s:e]) for s, e in segments]
    whole = blend_prefill(model, ids, segments, cached, 0.5)
    monkeypatch.setattr(blend, "ATTEND_BLOCK", 7)
    blocks = blend_prefill(model, ids, segments, cached, 0.5)
    assert torch.equal(blocks.kv, whole.kv) and torch.equal(blocks.logits, whole.logits)


def test_ratio_zero_with_one_segment_at_position_zero_is_exact_reuse(model):
    ids = random_ids(30)
    cached = [compute_segment_kv(model, ids[:22])]
    got = blend_prefill(model, ids, [(0, 22)], cached, 0.0)
    want_logits, want_kv = paged_prefill(model, ids)
    torch.testing.assert_close(got.logits, want_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(got.kv, want_kv, atol=ATOL, rtol=0)
    assert got.recomputed.tolist() == list(range(22, 30)) and got.selected.numel() == 0


def test_ratio_zero_keeps_the_cached_kv_of_every_covered_token_from_the_select_layer_on(model):
    ids = random_ids(30)
    segments = [(2, 12), (12, 25)]
    cached = [compute_segment_kv(model, ids[s:e]) for s, e in segments]
    got = blend_prefill(model, ids, segments, cached, 0.0, select_layer=2)
    assert got.recomputed.tolist() == [0, 1, *range(25, 30)]
    full = full_prefill(model, ids)
    torch.testing.assert_close(got.kv[:2], full.kv[:2], atol=ATOL, rtol=0)  # below select_layer: all fresh
    for (s, e), seg in zip(segments, cached):
        assert torch.equal(got.kv[2:, 1, s:e], seg.kv[2:, 1])
        torch.testing.assert_close(got.kv[2:, 0, s:e], rerotate(seg.kv[2:, 0], s, model.rotary), atol=0, rtol=0)
    assert not torch.allclose(got.logits, full.logits, atol=1e-2)  # concatenation is not a full prefill


@pytest.mark.parametrize("deviation", ["key", "value"])
@pytest.mark.parametrize("ratio, count", [(0.1, 2), (0.3, 7), (0.5, 12)])
def test_the_ratio_picks_that_share_of_the_cached_tokens_by_deviation(model, ratio, count, deviation):
    """24 cached tokens: round(ratio * 24) picked, those whose fresh K (V) at
    the select layer is furthest from the cached, re-rotated K (V)."""
    ids = random_ids(30)
    segments = [(2, 12), (12, 26)]
    cached = [compute_segment_kv(model, ids[s:e]) for s, e in segments]
    got = blend_prefill(model, ids, segments, cached, ratio, deviation=deviation)
    assert len(got.selected) == count
    assert got.recomputed.tolist() == sorted([0, 1, *got.selected.tolist(), 26, 27, 28, 29])
    which = {"key": 0, "value": 1}[deviation]
    fresh = full_prefill(model, ids).kv[1, which, 2:26]  # layer 1's inputs are a full prefill's
    stale = torch.cat([seg.kv[1, which] for seg in cached])
    if deviation == "key":
        stale = torch.cat([rerotate(seg.kv[1, 0], s, model.rotary) for (s, _), seg in zip(segments, cached)])
    dev = (fresh - stale).flatten(1).norm(dim=1)
    assert sorted((dev.topk(count).indices + 2).tolist()) == got.selected.tolist()
    other = blend_prefill(model, ids, segments, cached, ratio, deviation=("value" if which == 0 else "key"))
    if count < 12:  # the two criteria pick different tokens on this input
        assert other.selected.tolist() != got.selected.tolist()


def test_greedy_decode_from_a_prefill_equals_recomputing_every_step(model):
    ids = random_ids(25)
    segments = [(0, 10), (10, 20)]
    cached = [compute_segment_kv(model, ids[s:e]) for s, e in segments]
    tokens = greedy_decode(model, blend_prefill(model, ids, segments, cached, 1.0), 6)
    want, ctx = [], list(ids)
    for _ in range(6):
        want.append(int(full_prefill(model, ctx).logits.argmax()))
        ctx.append(want[-1])
    assert tokens == want
    assert greedy_decode(model, full_prefill(model, ids), 6, stop_ids=[want[2]]) == want[:3]


@pytest.mark.parametrize("kwargs, match", [
    (dict(recompute_ratio=1.5), r"recompute_ratio must be a number in \[0, 1\], got 1.5"),
    (dict(recompute_ratio=-0.1), r"recompute_ratio must be a number in \[0, 1\], got -0.1"),
    (dict(recompute_ratio=float("nan")), r"recompute_ratio must be a number in \[0, 1\], got nan"),
    (dict(select_layer=3), r"select_layer must be an int in \[1, 2\] for a 3-layer model, got 3"),
    (dict(select_layer=0), r"select_layer must be an int in \[1, 2\] for a 3-layer model, got 0"),
    (dict(segments=[(2, 12), (12, 31)]), r"segments\[1\] = \(12, 31\) is not a non-empty span in \[0, 30\]"),
    (dict(segments=[(2, 2), (12, 25)]), r"segments\[0\] = \(2, 2\) is not a non-empty span"),
    (dict(segments=[(2, 13), (12, 25)]), r"segments\[1\] = \(12, 25\) overlaps or precedes segments\[0\]"),
    (dict(segments=[(12, 25), (2, 12)]), r"segments\[1\] = \(2, 12\) overlaps or precedes segments\[0\]"),
    (dict(segments=[(2, 12), (12, 24)]), r"cached\[1\] holds 13 tokens but segments\[1\] = \(12, 24\) spans 12"),
    (dict(segments=[(2, 12)]), r"segments has 1 spans but cached has 2 SegmentKVs"),
    (dict(token_ids=[]), r"token_ids must not be empty"),
    (dict(deviation="kv"), r"deviation must be one of \['key', 'value'\], got 'kv'"),
])
def test_bad_arguments_are_named(model, kwargs, match):
    ids = random_ids(30)
    args = dict(token_ids=ids, segments=[(2, 12), (12, 25)],
                cached=[compute_segment_kv(model, ids[2:12]), compute_segment_kv(model, ids[12:25])],
                recompute_ratio=0.3)
    with pytest.raises(ValueError, match=match):
        blend_prefill(model, **{**args, **kwargs})


def test_cached_kv_of_another_model_or_other_tokens_is_named(model):
    ids = random_ids(30)
    deeper = tiny_model(num_hidden_layers=4)
    with pytest.raises(ValueError, match=r"cached\[0\].kv has shape \(4, 2, 10, 2, 16\) .* the model needs "
                                         r"\(3, 2, 10, 2, 16\)"):
        blend_prefill(model, ids, [(2, 12)], [compute_segment_kv(deeper, ids[2:12])], 0.3)
    with pytest.raises(ValueError, match=r"cached\[0\] was computed for other tokens than segments\[0\] = \(2, 12\)"):
        blend_prefill(model, ids, [(2, 12)], [compute_segment_kv(model, ids[3:13])], 0.3)
    with pytest.raises(ValueError, match=r"SegmentKV.kv must be \(layers, 2, 3, kv_heads, head_dim\)"):
        SegmentKV((1, 2, 3), torch.zeros(3, 2, 4, 2, 16))


# --- the real model -----------------------------------------------------------------------------------------

SYSTEM = "You are a helpful assistant. Answer the question using only the passages."
PASSAGES = [
    "The capital of Veloria is Marnek. Marnek lies on the banks of the river Ost.\n",
    "The Drellan fox has silver fur and lives only on the island of Kespa.\n",
    "Lake Quorra is the deepest lake in Veloria, at 912 meters.\n",
    "The currency of Pellaria is the crown. One crown is worth ten pennets.\n",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    from kvstrata.text.tokenizer import load_tokenizer
    from kvstrata.worker.model import load_checkpoint

    ckpt = load_checkpoint(str(smollm2_gguf))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a shared 2-core machine, 2 threads beside another busy process run ~4x slower
    yield ckpt.model, load_tokenizer(str(smollm2_gguf), gguf_metadata=ckpt.gguf_metadata)
    torch.set_num_threads(threads)


def test_on_smollm2_a_partial_recompute_of_shuffled_passages_is_closer_to_full_prefill(smollm2):
    model, tok = smollm2
    head = tok.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nPassages:\n",
                      add_special_tokens=False)
    pieces = [tok.encode(p, add_special_tokens=False) for p in PASSAGES]
    tail = tok.encode("Question: What is the capital of Veloria?<|im_end|>\n<|im_start|>assistant\n",
                      add_special_tokens=False)
    cached = [compute_segment_kv(model, p) for p in pieces]
    kls = {0.0: [], 0.3: [], 1.0: []}
    for order in ([2, 0, 3, 1], [3, 1, 0, 2]):
        ids, segments = list(head), []
        for i in order:
            segments.append((len(ids), len(ids) + len(pieces[i])))
            ids += pieces[i]
        ids += tail
        full = torch.log_softmax(full_prefill(model, ids).logits.double(), -1)
        for ratio in kls:
            got = torch.log_softmax(blend_prefill(model, ids, segments, [cached[i] for i in order], ratio).logits
                                    .double(), -1)
            kls[ratio].append(float((full.exp() * (full - got)).sum()))
    assert max(kls[1.0]) < 1e-6
    for at_03, at_0 in zip(kls[0.3], kls[0.0], strict=True):
        assert at_03 < at_0 * 0.7, kls
