"""The TinyLFU frequency sketch and admission policy: count-min never
under-counts within a window, a reset halves, the doorkeeper holds one-hit
wonders, admission is monotonic in frequency, memory is fixed."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.io import ChunkKey
from kvstrata.io.admission import MAX_COUNT, AdmissionPolicy, FrequencySketch, key_hashes


def key(i: int, *, n: int = 256, digest: int = 32) -> ChunkKey:
    return ChunkKey("ident", hashlib.sha256(i.to_bytes(8, "little")).digest()[:digest], n)


records = st.lists(st.integers(0, 200), max_size=300)


@settings(max_examples=60, deadline=None)
@given(records, st.sampled_from([1, 2, 4]), st.sampled_from([32, 8]))
def test_estimate_never_undercounts_within_a_window(ids, depth, digest):
    sketch = FrequencySketch(64, depth=depth, sample_factor=100)  # a window longer than the records
    true = Counter(ids)
    for i in ids:
        sketch.record(key(i, digest=digest))
    assert sketch.resets == 0
    for i in range(201):
        assert sketch.estimate(key(i, digest=digest)) >= min(true[i], MAX_COUNT + 1)


@settings(max_examples=40, deadline=None)
@given(records)
def test_estimate_is_exact_without_collisions(ids):
    sketch = FrequencySketch(1 << 16, sample_factor=100)  # wide enough that 201 keys do not collide
    for i in ids:
        sketch.record(key(i))
    true = Counter(ids)
    assert all(sketch.estimate(key(i)) == min(true[i], MAX_COUNT + 1) for i in range(201))


@settings(max_examples=40, deadline=None)
@given(records)
def test_reset_halves_the_counters_and_clears_the_doorkeeper(ids):
    sketch = FrequencySketch(64, sample_factor=100)
    for i in ids:
        sketch.record(key(i))
    before = {i: sketch.estimate(key(i)) for i in range(201)}
    door = {i: sketch._in_door(*key_hashes(key(i))) for i in range(201)}
    sketch.reset()
    for i in range(201):
        assert sketch.estimate(key(i)) == (before[i] - door[i]) // 2


def test_the_window_resets_after_sample_size_records():
    sketch = FrequencySketch(16, sample_factor=2)  # width 16: a reset every 32 records
    assert sketch.sample_size == 32
    for _ in range(31):
        sketch.record(key(1))
    assert sketch.resets == 0 and sketch.estimate(key(1)) == MAX_COUNT + 1
    sketch.record(key(1))
    assert sketch.resets == 1 and sketch.estimate(key(1)) == MAX_COUNT // 2  # halved, doorkeeper cleared


def test_the_doorkeeper_keeps_one_hit_wonders_out_of_the_counters():
    sketch = FrequencySketch(1024, sample_factor=100)
    for i in range(100):
        sketch.record(key(i))
    assert all(sketch.estimate(key(i)) == 1 for i in range(100))
    assert not any(any(row) for row in sketch._rows)  # nothing reached the count-min rows
    sketch.record(key(7))
    assert sketch.estimate(key(7)) == 2
    assert sketch.estimate(key(1000)) == 0


def test_layer_and_partial_keys_are_not_their_chunk():
    sketch = FrequencySketch(1 << 16)
    k = key(3)
    sketch.record(k)
    sketch.record(k)
    assert sketch.estimate(k) == 2
    assert sketch.estimate(k.for_layer(0)) == 0
    assert sketch.estimate(ChunkKey(k.identity, k.prefix_hash, 128)) == 0


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 20), st.integers(0, 20), st.integers(0, 20))
def test_admit_is_monotonic_in_frequency(fa, fb, fv):
    pol = AdmissionPolicy(1 << 16, min_seen=2, sample_factor=100)
    a, b, v = key(1), key(2), key(3)
    for k, f in ((a, fa), (b, fb), (v, fv)):
        for _ in range(f):
            pol.record(k)
    if fa >= fb:  # a seen at least as often as b: whenever b is admitted, a is too
        assert pol.admit(a, v) or not pol.admit(b, v)
        assert pol.admit(a) or not pol.admit(b)
    assert pol.admit(a) == (min(fa, MAX_COUNT + 1) >= 2)
    assert pol.admit(a, v) == (min(fa, MAX_COUNT + 1) >= min(fv, MAX_COUNT + 1))


def test_inherited_frequency_is_a_floor():
    pol = AdmissionPolicy(1024, min_seen=2)
    new, victim = key(1), key(2)
    assert not pol.admit(new)
    assert pol.admit(new, inherited=2)
    for _ in range(3):
        pol.record(victim)
    assert not pol.admit(new, victim, inherited=2)  # 2 does not reach 3
    assert pol.admit(new, victim, inherited=3)  # a tie goes to the newer chunk
    assert (pol.admitted, pol.rejected) == (2, 2)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 5000), st.lists(st.integers(0, 10**6), max_size=500))
def test_memory_is_bounded_by_capacity_not_by_records(capacity, ids):
    sketch = FrequencySketch(capacity)
    size = sketch.nbytes
    assert size <= 4 * 2 * max(16, capacity) + 2 * max(16, capacity)  # 4 rows + 8 doorkeeper bits per cell
    for i in ids:
        sketch.record(key(i))
    assert sketch.nbytes == size and all(len(r) == sketch.width for r in sketch._rows)


def test_bad_arguments():
    with pytest.raises(ValueError):
        FrequencySketch(0)
    with pytest.raises(ValueError):
        FrequencySketch(8, depth=0)
    with pytest.raises(ValueError):
        AdmissionPolicy(8, min_seen=-1)
