"""Allocators: first-fit (alignment, coalescing, batched allocate/free) and
fixed slots (O(1)), plus hypothesis state machines over both."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstrata.io import FirstFitAllocator, SlotAllocator
from kvstrata.io.memory import release_all

P = 4096
F32 = torch.float32


def test_first_fit_aligns_every_object_to_4k(tracker):
    a = tracker.add(FirstFitAllocator(16 * P))
    objs = [a.allocate((n,), torch.uint8) for n in (1, 4097, 100, P)]
    assert [o.address for o in objs] == [0, P, 3 * P, 4 * P]
    assert [o.alloc_size for o in objs] == [P, 2 * P, P, P]
    assert [o.nbytes for o in objs] == [1, 4097, 100, P]
    assert all(o.raw.data_ptr() % P == 0 for o in objs)
    release_all(objs)


def test_allocation_that_does_not_fit_returns_none_and_changes_nothing(tracker):
    a = tracker.add(FirstFitAllocator(4 * P))
    x = a.allocate((3 * P,), torch.uint8)
    before = a.free_regions()
    assert a.allocate((2 * P,), torch.uint8) is None
    assert a.batched_allocate(2, (P,), torch.uint8) is None
    assert a.free_regions() == before and a.used_bytes == 3 * P
    assert not a.can_ever_fit(5 * P) and a.can_ever_fit(4 * P)
    x.release()


def test_first_fit_takes_the_lowest_hole_that_fits(tracker):
    a = tracker.add(FirstFitAllocator(10 * P))
    o = [a.allocate((P,), torch.uint8) for _ in range(6)]
    o[1].release()                         # hole of 1 page at P
    o[3].release()
    o[4].release()                         # hole of 2 pages at 3P (coalesced)
    assert a.free_regions() == [(P, P), (3 * P, 2 * P), (6 * P, 4 * P)]
    two = a.allocate((2 * P,), torch.uint8)
    assert two.address == 3 * P
    one = a.allocate((P,), torch.uint8)
    assert one.address == P
    release_all([o[0], o[2], o[5], two, one])
    assert a.free_regions() == [(0, 10 * P)]


def test_freeing_coalesces_with_both_neighbours(tracker):
    a = tracker.add(FirstFitAllocator(3 * P))
    x, y, z = (a.allocate((P,), torch.uint8) for _ in range(3))
    x.release()
    z.release()
    assert a.free_regions() == [(0, P), (2 * P, P)]
    y.release()
    assert a.free_regions() == [(0, 3 * P)]


def test_batched_allocate_carves_one_region(tracker):
    a = tracker.add(FirstFitAllocator(8 * P))
    gap = a.allocate((P,), torch.uint8)
    objs = a.batched_allocate(3, (2, 1024), F32, "kv")
    assert [o.address for o in objs] == [P, 3 * P, 5 * P]
    assert all(o.shape == (2, 1024) and o.dtype == F32 and o.layout == "kv" for o in objs)
    for i, o in enumerate(objs):
        o.tensor.fill_(i)
    assert [float(o.tensor.sum()) for o in objs] == [0.0, 2048.0, 4096.0]
    release_all([*objs, gap])
    assert a.free_regions() == [(0, 8 * P)]


def test_batched_free_merges_runs_in_address_order(tracker):
    a = tracker.add(FirstFitAllocator(6 * P))
    objs = [a.allocate((P,), torch.uint8) for _ in range(6)]
    release_all([objs[4], objs[1], objs[2], objs[0]])  # unsorted; 0-2 one run, 4 alone
    assert a.free_regions() == [(0, 3 * P), (4 * P, P)]
    release_all([objs[3], objs[5]])
    assert a.free_regions() == [(0, 6 * P)]


def test_double_free_is_refused(tracker):
    a = tracker.add(FirstFitAllocator(2 * P))
    x = a.allocate((P,), torch.uint8)
    x.release()
    with pytest.raises(RuntimeError, match="released more times"):
        x.release()
    with pytest.raises(RuntimeError, match="does not hold"):
        a.free(x)


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="capacity"):
        FirstFitAllocator(100)
    a = FirstFitAllocator(P)
    with pytest.raises(ValueError, match="shape"):
        a.allocate((0, 4), F32)
    with pytest.raises(TypeError, match="dtype"):
        a.allocate((4,), "float32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be"):
        a.batched_allocate(0, (4,), F32)
    with pytest.raises(ValueError, match="slot_bytes"):
        SlotAllocator(P, 0)


def test_slots_allocate_and_free_in_constant_time_order(tracker):
    s = tracker.add(SlotAllocator(4 * P + 100, 5000))
    assert (s.slot_bytes, s.num_slots, s.capacity) == (2 * P, 2, 4 * P)
    x = s.allocate((1000,), F32)
    y = s.allocate((10,), torch.uint8)
    assert (x.address, y.address, x.alloc_size) == (0, 2 * P, 2 * P)
    assert s.allocate((1,), torch.uint8) is None
    x.release()
    z = s.allocate((1,), torch.uint8)
    assert z.address == 0
    release_all([y, z])
    assert s.num_free_slots == 2 and s.used_bytes == 0


def test_slots_refuse_objects_larger_than_a_slot(tracker):
    s = tracker.add(SlotAllocator(4 * P, P))
    assert s.allocate((P + 1,), torch.uint8) is None
    assert not s.can_ever_fit(P + 1)
    assert s.num_free_slots == 4


def test_slots_batched_is_all_or_nothing(tracker):
    s = tracker.add(SlotAllocator(3 * P, P))
    assert s.batched_allocate(4, (P,), torch.uint8) is None
    assert s.num_free_slots == 3
    objs = s.batched_allocate(3, (P,), torch.uint8)
    assert [o.address for o in objs] == [0, P, 2 * P]
    release_all(list(reversed(objs)))
    assert [o.address for o in s.batched_allocate(3, (P,), torch.uint8)] == [0, P, 2 * P]
    release_all(s.live_objects())


class FirstFitMachine(RuleBasedStateMachine):
    """No two live objects overlap; live + free = capacity; free regions are
    sorted and coalesced; everything freed leaves one region."""

    CAP = 64 * P

    def __init__(self) -> None:
        super().__init__()
        self.a = FirstFitAllocator(self.CAP)
        self.live: list = []

    @rule(nbytes=st.integers(1, 9 * P))
    def allocate(self, nbytes):
        free_before = self.a.free_regions()
        obj = self.a.allocate((nbytes,), torch.uint8)
        if obj is None:
            assert self.a.free_regions() == free_before
            assert all(size < -(-nbytes // P) * P for _, size in free_before)
        else:
            self.live.append(obj)

    @rule(n=st.integers(1, 5), nbytes=st.integers(1, 3 * P))
    def batched_allocate(self, n, nbytes):
        objs = self.a.batched_allocate(n, (nbytes,), torch.uint8)
        if objs is not None:
            size = objs[0].alloc_size
            assert [o.address for o in objs] == [objs[0].address + i * size for i in range(n)]
            self.live.extend(objs)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10**6))
    def free_one(self, i):
        self.live.pop(i % len(self.live)).release()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def batched_free(self, data):
        picks = data.draw(st.lists(st.sampled_from(self.live), unique_by=id, min_size=1))
        for o in picks:
            self.live.remove(o)
        release_all(picks)

    @invariant()
    def no_overlap_and_accounting(self):
        spans = sorted((o.address, o.address + o.alloc_size) for o in self.live)
        spans += [(s, s + n) for s, n in self.a.free_regions()]
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
        assert sum(e - s for s, e in spans) == self.CAP
        assert all(o.address % P == 0 for o in self.live)
        free = self.a.free_regions()
        assert all(s1 + n1 < s2 for (s1, n1), (s2, _) in zip(free, free[1:])), "not coalesced"
        assert self.a.used_bytes == sum(o.alloc_size for o in self.live)

    def teardown(self):
        release_all(self.live)
        assert self.a.free_regions() == [(0, self.CAP)]
        assert self.a.num_live == 0


class SlotMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.a = SlotAllocator(8 * P, P)
        self.live: list = []

    @rule(nbytes=st.integers(1, P + 10))
    def allocate(self, nbytes):
        free = self.a.num_free_slots
        obj = self.a.allocate((nbytes,), torch.uint8)
        assert (obj is None) == (nbytes > P or free == 0)
        if obj is not None:
            self.live.append(obj)

    @rule(n=st.integers(1, 4))
    def batched_allocate(self, n):
        objs = self.a.batched_allocate(n, (P,), torch.uint8)
        assert (objs is None) == (self.a.num_free_slots + (0 if objs is None else n) < n)
        self.live.extend(objs or [])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_some(self, data):
        picks = data.draw(st.lists(st.sampled_from(self.live), unique_by=id, min_size=1))
        for o in picks:
            self.live.remove(o)
        release_all(picks)

    @invariant()
    def slots_are_disjoint(self):
        addrs = [o.address for o in self.live]
        assert len(set(addrs)) == len(addrs)
        assert self.a.num_free_slots + len(self.live) == 8

    def teardown(self):
        release_all(self.live)
        assert self.a.num_free_slots == 8 and self.a.num_live == 0


TestFirstFitMachine = FirstFitMachine.TestCase
TestFirstFitMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestSlotMachine = SlotMachine.TestCase
TestSlotMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
