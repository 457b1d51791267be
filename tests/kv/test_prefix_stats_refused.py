"""Prefix-cache stats count a lookup only when its allocation succeeds: a
refused allocate_slots (no room) changes no counter, and the retry that
succeeds counts the query once (issue 16 item 12, vLLM's rule)."""

from __future__ import annotations

from .builders import make_manager, make_request

BS = 16


def test_a_refused_allocation_is_not_counted_and_the_retry_counts_once():
    m = make_manager(6, BS)  # 5 usable blocks
    shared = list(range(2 * BS))
    r0 = make_request("r0", shared + [7])
    hit, n_hit = m.get_computed_blocks(r0)
    assert m.allocate_slots(r0, len(r0.all_token_ids), n_hit, hit) is not None
    m.cache_blocks(r0, len(r0.all_token_ids))
    holder = make_request("holder", list(range(50_000, 50_000 + 2 * BS)))
    assert m.allocate_slots(holder, 2 * BS) is not None  # 5 of 5 blocks now held
    before = m.prefix_cache_totals()
    assert (before.requests, before.queries, before.hits) == (1, 2 * BS + 1, 0)

    r1 = make_request("r1", shared + list(range(900, 900 + 2 * BS)))  # 2 hit blocks + 2 new needed
    hit, n_hit = m.get_computed_blocks(r1)
    assert n_hit == 2 * BS
    assert m.allocate_slots(r1, 2 * BS, n_hit, hit) is None  # no room: refused
    assert m.prefix_cache_totals() == before  # nothing counted

    m.free(holder)
    hit, n_hit = m.get_computed_blocks(r1)
    assert m.allocate_slots(r1, 2 * BS, n_hit, hit) is not None
    after = m.prefix_cache_totals()
    assert (after.requests, after.queries, after.hits) == (2, 2 * BS + 1 + 4 * BS, 2 * BS)
