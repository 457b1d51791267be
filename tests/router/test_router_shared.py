"""Shared prefixes (kvstrata.router.shared) and how kv places around them:
a prefix becomes shared after ``min_fanout`` different continuations, a
conversation's own growing history never does, and once a system prompt is
shared new conversations go by load while each conversation stays home."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.kv.events import BlockStored, KVEventBatch
from kvstrata.kv.hashing import CacheIdentity
from kvstrata.router import GPU, ReplicaLoad, Router, RouterConfig
from kvstrata.router.shared import SharedPrefixes

BS = 4
IDENTITY = CacheIdentity(model_fingerprint="shared-test", kv_dtype="float32", kv_layout="per_layer", block_size=BS)
SYSTEM = [0] * 20  # a 20-token system prompt: 5 full blocks


def chain(*tails: list[int]) -> list[bytes]:
    """Fake chains: a block's hash is its path (no zero byte in a path)."""
    path = b""
    out = []
    for t in tails:
        for x in t:
            path += bytes([x])
            out.append(path.rjust(8, b"\0"))
    return out


def test_a_prefix_is_shared_after_min_fanout_continuations():
    sp = SharedPrefixes(min_fanout=2)
    prefix = chain([1, 2, 3])
    a, b, c = (chain([1, 2, 3], [x, x + 1]) for x in (10, 20, 30))
    assert sp.depth(a) == 0
    assert not sp.note_branch(a, 3)  # the first continuation of the cached [1, 2, 3]
    assert sp.depth(b) == 0
    assert sp.note_branch(b, 3)  # the second: shared
    assert sp.depth(c) == 3 and sp.depth(prefix) == 3 and len(sp) == 3
    assert sp.depth(chain([1, 2, 4])) == 2  # shares two of its blocks
    assert sp.depth(chain([9])) == 0
    assert not sp.note_branch(c, 3)  # already shared: nothing changes
    assert len(sp) == 3


def test_a_conversation_growing_turn_by_turn_never_becomes_shared():
    sp = SharedPrefixes(min_fanout=2)
    turns = [chain(list(range(1, 4 * k + 1))) for k in range(1, 8)]  # each turn re-sends the last and adds 4
    for prev, turn in zip(turns, turns[1:]):
        assert not sp.note_branch(turn, len(prev))  # cached: the previous turn's prompt
    assert len(sp) == 0 and sp.depth(turns[-1]) == 0


def test_nothing_to_count_when_nothing_is_cached_or_the_prompt_ends_there():
    sp = SharedPrefixes(min_fanout=1)
    c = chain([1, 2, 3])
    assert not sp.note_branch(c, 0)  # nothing cached: no prefix to continue
    assert not sp.note_branch(c, 3)  # the whole prompt cached: a repeat, not a continuation
    assert len(sp) == 0
    assert sp.note_branch(c, 2)  # min_fanout 1: the first continuation shares it
    assert sp.depth(c) == 2


def test_bad_sizes_are_refused_by_name():
    with pytest.raises(ValueError, match="min_fanout"):
        SharedPrefixes(min_fanout=0)
    with pytest.raises(ValueError, match="max_blocks"):
        SharedPrefixes(min_fanout=1, max_blocks=0)
    with pytest.raises(ValueError, match="shared_prefix_fanout"):
        RouterConfig(shared_prefix_fanout=-1)


@settings(max_examples=100, deadline=None)
@given(branches=st.lists(st.tuples(st.lists(st.integers(1, 4), min_size=1, max_size=6), st.integers(0, 6)),
                         max_size=40),
       fanout=st.integers(1, 3), cap=st.integers(1, 12))
def test_shared_blocks_are_prefixes_that_branched_and_stay_bounded(branches, fanout, cap):
    sp = SharedPrefixes(min_fanout=fanout, max_blocks=cap)
    continued: dict[bytes, set[bytes]] = {}  # a prefix's last block -> the blocks that continued it
    for path, cached in branches:
        c = chain(path)
        sp.note_branch(c, cached)
        if 0 < cached < len(c):
            continued.setdefault(c[cached - 1], set()).add(c[cached])
        assert len(sp) <= cap + cap // 10  # trimmed a tenth below the cap when it overflows
        assert len(sp._fanout) <= cap + cap // 10
    for h in sp._shared:
        # every shared block is on the path to a prefix end that was continued at least once
        assert any(end.lstrip(b"\0").startswith(h.lstrip(b"\0")) for end in continued), h


# -- kv placement ---------------------------------------------------------------


def make_router(**cfg) -> Router:
    cfg.setdefault("load_skip_min_tokens", 1e9)
    router = Router(IDENTITY, RouterConfig(**cfg))
    for n in ("r0", "r1"):
        router.reset_replica(n, epoch=1)
    return router


def store(router: Router, replica: str, hashes) -> None:
    seq = router.index.expected_seq(replica) or 0
    ev = BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=BS, medium=GPU)
    assert router.ingest(replica, seq, KVEventBatch(ts=0.0, events=[ev])).action == "applied"


def conversation(k: int, turns: int = 1) -> list[int]:
    """The system prompt and ``turns`` user messages of conversation k (24 tokens each)."""
    msgs = [100 + 16 * k + t * 2 for t in range(turns)]
    return SYSTEM + [x for m in msgs for x in [m] * 12 + [m + 1] * 12]


def dispatch(router: Router, tokens: list[int], key: str):
    c = router.chain(tokens)
    d = router.choose(c)
    router.note_dispatched(d, len(tokens), c, key=key)
    return d


def test_a_shared_system_prompt_stops_pulling_new_conversations_to_its_first_replica():
    for fanout, spreads in ((0, False), (2, True)):
        router = make_router(shared_prefix_fanout=fanout)
        store(router, "r0", router.hash_prompt(SYSTEM))  # the system prompt cached on r0 only
        for k in range(2):  # two conversations under way on r0 (each continues the system prompt)
            assert dispatch(router, conversation(k), f"c{k}").replica == "r0"
        router.set_load("r0", ReplicaLoad(running_requests=3))  # 48 tokens of load against 20 + 2 x 20 of credit
        d = dispatch(router, conversation(2), "c2")
        assert (d.replica == "r1") == spreads, (fanout, d)
        if spreads:
            assert d.shared_blocks == len(SYSTEM) // BS and d.cached_blocks == len(SYSTEM) // BS
            assert d.hit_tokens == 0  # what r1 really holds: it prefills the system prompt once


def test_a_conversation_stays_home_once_its_system_prompt_is_shared():
    router = make_router(shared_prefix_fanout=2)
    store(router, "r0", router.hash_prompt(SYSTEM))
    for k in range(2):
        assert dispatch(router, conversation(k), f"c{k}").replica == "r0"
    assert len(router.shared) == len(SYSTEM) // BS
    router.set_load("r0", ReplicaLoad(running_requests=3))
    d = dispatch(router, conversation(1, turns=2), "c1-turn2")  # its history: on r0, 6 blocks past the system prompt
    assert d.replica == "r0" and d.hit_tokens == len(conversation(1))
