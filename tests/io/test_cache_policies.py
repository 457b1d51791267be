"""Cache policies: exact victim order for each, the evictable filter, and
that victims() never changes the index."""

from __future__ import annotations

import pytest

from kvstrata.io import POLICIES, make_policy


def _run(name: str, puts: str, hits: str):
    p = make_policy(name)
    for k in puts:
        p.on_put(k)
    for k in hits:
        p.on_hit(k)
    return p


@pytest.mark.parametrize(
    ("name", "order"),
    [
        ("lru", "cdab"),   # least recently used first
        ("mru", "badc"),   # most recently used first
        ("fifo", "abcd"),  # put order; hits do not count
        ("lfu", "cdab"),   # fewest hits first; c and d tie at 1: arrival order
    ],
)
def test_exact_victim_order(name, order):
    p = _run(name, "abcd", "bab")
    # hits: b, a, b -> recency: c d a b ; counts: a=2, b=3, c=1, d=1
    assert "".join(p.victims(4)) == order
    assert "".join(p.victims(2)) == order[:2]
    assert len(p) == 4


def test_lfu_ties_break_by_arrival_at_that_count():
    p = _run("lfu", "abc", "cab")  # all reach count 2: c first, then a, then b
    assert p.victims(3) == ["c", "a", "b"]


@pytest.mark.parametrize(("name", "order"), [("lru", "bd"), ("mru", "db"), ("fifo", "bd"), ("lfu", "bd")])
def test_evictable_filter_skips_but_keeps_order(name, order):
    p = _run(name, "abcd", "")
    assert "".join(p.victims(4, lambda k: k in "bd")) == order


def test_victims_does_not_change_the_index_and_remove_does():
    for name in POLICIES:
        p = _run(name, "abc", "c")
        first = p.victims(3)
        assert p.victims(3) == first
        p.on_remove(first[0])
        p.on_remove("zz")  # unknown: ignored
        assert p.victims(3) == first[1:] and len(p) == 2
        p.on_hit("zz")
        assert len(p) == 2


def test_put_of_a_present_key_counts_as_a_hit():
    lru = _run("lru", "abc", "")
    lru.on_put("a")
    assert lru.victims(3) == ["b", "c", "a"]
    lfu = _run("lfu", "abc", "")
    lfu.on_put("a")
    assert lfu.victims(3) == ["b", "c", "a"]
    fifo = _run("fifo", "abc", "")
    fifo.on_put("a")
    assert fifo.victims(3) == ["a", "b", "c"]


def test_zero_victims_and_unknown_policy():
    assert make_policy("lru").victims(0) == []
    with pytest.raises(ValueError, match="policy must be one of"):
        make_policy("random")
