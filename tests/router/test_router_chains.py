"""The router's chains: an incremental chain (a remembered prompt's prefix
reused, by session or by first block) equals the full chain for any pair of
prompts; a lazy walk (blocks hashed only while some live replica holds the
prefix) decides as a walk over the whole chain; a cold prompt hashes one
block; int hashes (vLLM's low 64 bits) route as bytes hashes do."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.kv.events import BlockRemoved, BlockStored, KVEventBatch, low64
from kvstrata.kv.hashing import BlockHasher, CacheIdentity
from kvstrata.router import CPU, GPU, MEDIA, REMOTE, Router, RouterConfig
from kvstrata.router.hashes import PromptHasher, _Prompt

BS = 4
NAMES = ["r0", "r1", "r2"]


def identity(algo: str = "xxhash") -> CacheIdentity:
    return CacheIdentity(model_fingerprint="chains", kv_dtype="float32", kv_layout="per_layer", block_size=BS,
                         hash_algo=algo)


def full_chain(ident: CacheIdentity, tokens, lora=None, salt=None) -> list[bytes]:
    return BlockHasher(ident)(_Prompt(tokens, lora, salt)) if len(tokens) >= BS else []


tokens_st = st.lists(st.integers(0, 70_000), max_size=40)  # ids past 2**16 too: msgpack widths 1, 3, 5


@settings(max_examples=60, deadline=None)
@given(a=tokens_st, b=tokens_st, shared=st.integers(0, 40), same_session=st.booleans(),
       extra=st.sampled_from([(None, None), ("lora-a", None), (None, "salt")]))
def test_incremental_chain_equals_the_full_chain(a, b, shared, same_session, extra):
    ident = identity()
    hasher = PromptHasher(ident, max_prompts=8)
    lora, salt = extra
    b = a[:shared] + b  # b shares some prefix with a (any length, block-aligned or not)
    assert hasher.hash_prompt(a, lora_name=lora, cache_salt=salt, session="u") == full_chain(ident, a, lora, salt)
    chain = hasher.chain(b, lora_name=lora, cache_salt=salt, session="u" if same_session else None)
    assert chain.finish() == full_chain(ident, b, lora, salt)
    assert chain.reused_blocks <= min(len(a), len(b)) // BS


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash"])
def test_a_follow_up_turn_hashes_only_its_tail(algo):
    ident = identity(algo)
    hasher = PromptHasher(ident)
    turn1 = list(range(1000, 1042))  # 10 full blocks and 2 tokens
    assert hasher.hash_prompt(turn1, session="user-1") == full_chain(ident, turn1)
    turn2 = turn1 + list(range(7, 20))
    chain = hasher.chain(turn2, session="user-1")
    assert chain.start() == full_chain(ident, turn2)[:10] and chain.reused_blocks == 10
    assert chain.finish() == full_chain(ident, turn2)
    # another session with the same first block finds it too (keyed by first block)
    other = turn1[:20] + [5] * 30
    chain = hasher.chain(other, session="user-2")
    assert chain.start() == full_chain(ident, other)[:5] and chain.reused_blocks == 5


def store(router: Router, replica: str, hashes, medium=GPU) -> None:
    seq = router.index.expected_seq(replica) or 0
    ev = BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=BS, medium=medium)
    assert router.ingest(replica, seq, KVEventBatch(ts=0.0, events=[ev])).action == "applied"


def make_router(**cfg) -> Router:
    router = Router(identity(), RouterConfig(**cfg))
    for n in NAMES:
        router.reset_replica(n, epoch=1)
    return router


@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(st.integers(0, 50), min_size=0, max_size=48),
       placed=st.lists(st.tuples(st.sampled_from(NAMES), st.sampled_from(MEDIA), st.integers(0, 12)), max_size=8),
       dead=st.sets(st.sampled_from(NAMES), max_size=2), num_extra=st.integers(0, 3))
def test_the_lazy_walk_decides_as_the_full_walk(prompt, placed, dead, num_extra):
    a, b = make_router(chain_cache_prompts=0), make_router()
    chain = full_chain(identity(), prompt)
    for router in (a, b):
        for replica, medium, n in placed:
            store(router, replica, chain[:n], medium)
        for r in dead:
            router.mark_dead(r)
    n_tokens = len(prompt) + num_extra
    lazy = b.chain(prompt)
    assert b.choose(lazy, num_tokens=n_tokens) == a.choose(chain, num_tokens=n_tokens)
    # a REMOTE block is in the shared tier: every live replica can read it, whoever stored it
    held = max((n for r, medium, n in placed if r not in dead or medium == REMOTE), default=0)
    assert len(lazy.known) <= max(min(held, len(chain)) + 1, 1 if chain else 0)  # hashed only as far as needed
    assert lazy.finish() == chain


def test_a_cold_prompt_hashes_one_block_before_the_decision():
    router = make_router()
    store(router, "r1", full_chain(identity(), list(range(100, 140))))
    chain = router.chain(list(range(400)))
    d = router.choose(chain)
    assert len(chain.known) == 1 and d.hit_tokens == 0 and len(router.decision_ns) == 1
    router.note_dispatched(d, 400, chain, key="req-1")  # finished here
    assert chain.known == full_chain(identity(), list(range(400)))
    assert router.index.provisional(d.replica) == frozenset(chain.known)


def test_int_hashes_route_as_bytes_hashes():
    router = make_router()
    prompt = list(range(40))
    chain = full_chain(identity(), prompt)
    store(router, "r0", chain[:3])  # bytes from one engine, then ints (low 64 bits) from another
    store(router, "r2", [low64(h) for h in chain[:7]])
    store(router, "r1", chain[:6], CPU)
    assert router.index.low64
    d = router.choose(router.chain(prompt))
    assert (d.replica, d.device_hit_tokens) == ("r2", 7 * BS)
    assert router.choose(chain) == d
    seq = router.index.expected_seq("r2")
    router.ingest("r2", seq, KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[low64(chain[1])])]))
    assert router.choose(chain).replica == "r1"  # r2 now holds one block; r1 six on CPU
