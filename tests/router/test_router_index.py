"""PrefixIndex: equal to a naive model (a set of hashes per replica and
medium) after any sequence of stored / removed / cleared events and replica
resets; prefix walks equal a naive block-by-block walk; sequence gaps and
epochs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstrata.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvstrata.router.index import CPU, DISK, GPU, MEDIA, REMOTE, PrefixIndex

HASHES = [bytes([i]) * 4 for i in range(10)]
REPLICAS = ["a", "b", "c"]
WIDTH = 4  # a small max_replicas, so the lanes sit next to each other


def stored(hashes, medium=GPU):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=1, medium=medium)


def batch(*events):
    return KVEventBatch(ts=0.0, events=list(events))


def naive_lanes(model, live, h, shared=True):
    """The four cumulative lanes of h as sets of replicas, from per-(replica, medium) sets."""
    lanes, acc = [], set()
    for m in MEDIA:
        acc = acc | {r for r in live if h in model[r][m]}
        lanes.append(set(acc))
    if shared and any(h in model[r][REMOTE] for r in model):
        lanes[3] = set(live)
    return lanes


def naive_prefix(model, live, chain, shared=True):
    """{(replica, lane): leading blocks of chain held on that lane}, walked block by block."""
    out = {}
    for r in live:
        for lane in range(4):
            n = 0
            for h in chain:
                if r not in naive_lanes(model, live, h, shared)[lane]:
                    break
                n += 1
            out[(r, lane)] = n
    return out


def index_prefix(index, live, chain):
    mask = sum(1 << index.slot(r) for r in live)
    got = index.prefix_blocks(chain, mask)
    return {(r, lane): got.get(lane * index.width + index.slot(r), 0) for r in live for lane in range(4)}


medium_st = st.sampled_from(MEDIA + ("device", "cpu"))  # the kv manager's "device" and lower-case tiers too
canon = {"device": GPU, "cpu": CPU}


class IndexMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.index = PrefixIndex(max_replicas=WIDTH)
        self.model = {}  # replica -> medium -> set (as its events report)
        self.credits = {}  # replica -> request key -> hashes credited at dispatch, in flight
        self.epochs = {}
        self.seq = {}

    def effective(self):
        """The model with each replica's in-flight credits on its device."""
        out = {}
        for r, media in self.model.items():
            out[r] = dict(media)
            out[r][GPU] = media[GPU] | {h for hs in self.credits[r].values() for h in hs}
        return out

    @rule(r=st.sampled_from(REPLICAS))
    def reset(self, r):
        self.epochs[r] = self.epochs.get(r, 0) + 1
        self.index.reset_replica(r, self.epochs[r])
        self.model[r] = {m: set() for m in MEDIA}
        self.credits[r] = {}  # a restart drops every credit
        self.seq[r] = 0

    @precondition(lambda self: self.model)
    @rule(data=st.data(), key=st.sampled_from(["q1", "q2", "q3"]), hs=st.lists(st.sampled_from(HASHES), max_size=6))
    def predict(self, data, key, hs):
        r = data.draw(st.sampled_from(sorted(self.model)))
        self.index.predict(r, hs, key)
        if hs:
            self.credits[r][key] = list(hs)  # predicting a key again replaces its credit

    @precondition(lambda self: self.model)
    @rule(data=st.data(), key=st.sampled_from(["q1", "q2", "q3"]))
    def settle(self, data, key):
        r = data.draw(st.sampled_from(sorted(self.model)))
        before = self.effective()[r][GPU]
        withdrawn = self.index.settle(r, key)
        self.credits[r].pop(key, None)
        assert withdrawn == len(before - self.effective()[r][GPU])

    def _send(self, r, *events):
        res = self.index.ingest(r, self.seq[r], batch(*events), epoch=self.epochs[r])
        assert res.action == "applied", res
        self.seq[r] += 1

    @precondition(lambda self: self.model)
    @rule(data=st.data(), medium=medium_st, hs=st.lists(st.sampled_from(HASHES), max_size=6))
    def store(self, data, medium, hs):
        r = data.draw(st.sampled_from(sorted(self.model)))
        self._send(r, stored(hs, medium))
        self.model[r][canon.get(medium, medium)].update(hs)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), medium=medium_st, hs=st.lists(st.sampled_from(HASHES), max_size=6))
    def remove(self, data, medium, hs):
        r = data.draw(st.sampled_from(sorted(self.model)))
        self._send(r, BlockRemoved(block_hashes=hs, medium=medium))
        self.model[r][canon.get(medium, medium)].difference_update(hs)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), medium=medium_st)
    def clear(self, data, medium):
        r = data.draw(st.sampled_from(sorted(self.model)))
        self._send(r, AllBlocksCleared(medium=medium))
        self.model[r][canon.get(medium, medium)].clear()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove_replica(self, data):
        r = data.draw(st.sampled_from(sorted(self.model)))
        self.index.remove_replica(r)
        del self.model[r]
        del self.credits[r]

    @precondition(lambda self: self.model)
    @rule(data=st.data(), chain=st.lists(st.sampled_from(HASHES), max_size=8))
    def prefix_walk_equals_naive(self, data, chain):
        live = data.draw(st.sets(st.sampled_from(sorted(self.model))))
        assert index_prefix(self.index, live, chain) == naive_prefix(self.effective(), live, chain)

    @invariant()
    def equals_model(self):
        for r, media in self.model.items():
            for m, hs in media.items():
                assert self.index.held(r, m) == hs, (r, m)
            assert self.index.provisional(r) == {h for hs in self.credits[r].values() for h in hs}
        live, eff = set(self.model), self.effective()
        for h in HASHES:
            want = naive_lanes(eff, live, h)
            got = [{r for r in live if lane >> self.index.slot(r) & 1} for lane in self.index.lanes_of(h)]
            assert got == want, h
        assert len(self.index) == len({h for media in eff.values() for hs in media.values() for h in hs})


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


@settings(max_examples=100, deadline=None)
@given(chain=st.lists(st.sampled_from(HASHES), max_size=10),
       held=st.lists(st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(MEDIA), st.sampled_from(HASHES))))
def test_without_a_shared_tier_remote_hits_count_only_for_their_replica(chain, held):
    index = PrefixIndex(max_replicas=2, shared_remote=False)
    model = {r: {m: set() for m in MEDIA} for r in ("a", "b")}
    for r in ("a", "b"):
        index.reset_replica(r, 1)
    seq = {"a": 0, "b": 0}
    for r, m, h in held:
        assert index.ingest(r, seq[r], batch(stored([h], m))).action == "applied"
        seq[r] += 1
        model[r][m].add(h)
    assert index_prefix(index, {"a", "b"}, chain) == naive_prefix(model, {"a", "b"}, chain, shared=False)


def test_a_shared_remote_block_counts_for_every_replica_but_not_the_device_lane():
    index = PrefixIndex()
    for r in ("a", "b"):
        index.reset_replica(r, 1)
    index.ingest("a", 0, batch(stored(HASHES[:3], REMOTE)))
    index.ingest("b", 0, batch(stored(HASHES[:1], GPU)))
    hits = index_prefix(index, {"a", "b"}, HASHES[:4])
    assert hits[("b", 0)] == 1 and hits[("b", 3)] == 3 and hits[("a", 3)] == 3 and hits[("a", 0)] == 0


def test_prefix_semantics_stop_at_the_first_miss():
    index = PrefixIndex()
    index.reset_replica("a", 1)
    index.ingest("a", 0, batch(stored([HASHES[0], HASHES[2], HASHES[3]])))  # HASHES[1] missing
    assert index_prefix(index, {"a"}, HASHES[:4])[("a", 0)] == 1


# -- sequence numbers ---------------------------------------------------------


def test_a_gap_is_not_applied_and_asks_for_a_replay_from_the_expected_number():
    index = PrefixIndex(replay_window=100)
    index.reset_replica("a", 1)
    assert index.ingest("a", 0, batch(stored(HASHES[:1]))).action == "applied"
    res = index.ingest("a", 3, batch(stored(HASHES[1:2])))
    assert (res.action, res.expected_seq, res.rebuild) == ("gap", 1, "replay")
    assert index.held("a", GPU) == {HASHES[0]}  # the batch after the gap waits for the missed ones
    # the replay: 1, 2, then 3 again; then the duplicate of an old one is ignored
    for seq in (1, 2, 3):
        assert index.ingest("a", seq, batch(stored(HASHES[seq + 1: seq + 2]))).action == "applied"
    assert index.ingest("a", 2, batch(BlockRemoved(block_hashes=HASHES[:4]))).action == "duplicate"
    assert index.held("a", GPU) == set(HASHES[:1] + HASHES[2:5])
    assert index.counters.gaps == 1 and index.counters.duplicates == 1


def test_a_gap_wider_than_the_replay_ring_asks_for_a_snapshot():
    index = PrefixIndex(replay_window=100)
    index.reset_replica("a", 1)
    res = index.ingest("a", 101, batch())  # a router that starts while the engine has sent 101 batches
    assert (res.action, res.expected_seq, res.rebuild) == ("gap", 0, "snapshot")
    assert index.ingest("a", 100, batch()).rebuild == "replay"
    index.load_snapshot("a", 1, 102, batch(stored(HASHES[:2]), stored(HASHES[5:6], DISK)))
    assert index.held("a", GPU) == set(HASHES[:2]) and index.held("a", DISK) == {HASHES[5]}
    assert index.ingest("a", 102, batch()).action == "applied"


def test_a_new_epoch_fences_the_old_blocks_and_the_old_engines_late_batches():
    index = PrefixIndex()
    index.reset_replica("a", 7)
    index.ingest("a", 0, batch(stored(HASHES[:3]), stored(HASHES[:3], CPU)), epoch=7)
    index.reset_replica("a", 8)  # the engine restarted
    assert index.held("a", GPU) == set() and index.held("a", CPU) == set() and len(index) == 0
    late = index.ingest("a", 1, batch(stored(HASHES[3:4])), epoch=7)
    assert late.action == "stale_epoch" and len(index) == 0
    assert index.ingest("a", 0, batch(stored(HASHES[4:5])), epoch=8).action == "applied"  # numbering restarts
    assert index.held("a", GPU) == {HASHES[4]}


def test_batches_from_an_unknown_replica_are_refused_and_counted():
    index = PrefixIndex()
    assert index.ingest("ghost", 0, batch(stored(HASHES[:1]))).action == "unknown_replica"
    assert len(index) == 0 and index.counters.unknown_replica == 1


def test_events_of_other_groups_and_unknown_media_are_ignored_and_counted():
    index = PrefixIndex()
    index.reset_replica("a", 1)
    index.ingest("a", 0, batch(BlockStored(block_hashes=HASHES[:1], parent_block_hash=None, token_ids=[],
                                            block_size=1, group_idx=1), stored(HASHES[:1], "TAPE")))
    assert len(index) == 0 and index.counters.ignored_events == 2


def test_more_replicas_than_max_replicas_is_refused_by_name():
    index = PrefixIndex(max_replicas=2)
    index.reset_replica("a", 1)
    index.reset_replica("b", 1)
    with pytest.raises(ValueError, match="cannot add replica 'c'"):
        index.reset_replica("c", 1)
    index.remove_replica("a")
    assert index.reset_replica("c", 1) == 0  # a's slot, reused


def test_the_media_are_the_connectors():
    from kvstrata.connector import events as ce

    assert (GPU, CPU, DISK, REMOTE) == (ce.GPU, ce.CPU, ce.DISK, ce.REMOTE)


# -- dispatch credits ------------------------------------------------------------


def test_a_credit_the_engine_never_confirms_is_withdrawn_when_its_request_settles():
    """An aborted request, or an engine without prefix caching: no BlockStored
    ever comes, and the replica must not keep the prompt forever."""
    index = PrefixIndex()
    index.reset_replica("a", 1)
    index.predict("a", HASHES[:4], "req-1")
    assert index_prefix(index, {"a"}, HASHES[:4])[("a", 0)] == 4
    assert index.settle("a", "req-1") == 4
    assert index_prefix(index, {"a"}, HASHES[:4])[("a", 0)] == 0
    assert len(index) == 0 and index.provisional("a") == frozenset()
    assert index.counters.withdrawn == 4
    assert index.settle("a", "req-1") == 0  # settling twice, or an unknown key, changes nothing


def test_confirmed_blocks_stay_and_a_shared_credit_lasts_until_its_last_request():
    index = PrefixIndex()
    index.reset_replica("a", 1)
    index.predict("a", HASHES[:4], "req-1")
    index.predict("a", HASHES[:2], "req-2")
    index.ingest("a", 0, batch(stored(HASHES[:3])))  # the engine cached three of req-1's blocks
    assert index.settle("a", "req-1") == 1  # HASHES[3] only: 0-1 are still req-2's, 0-2 confirmed
    assert index_prefix(index, {"a"}, HASHES[:4])[("a", 0)] == 3
    # the engine evicts HASHES[0..1] while req-2 is in flight: its credit keeps them until it settles
    index.ingest("a", 1, batch(BlockRemoved(block_hashes=HASHES[:2], medium=GPU)))
    assert index_prefix(index, {"a"}, HASHES[:4])[("a", 0)] == 3
    assert index.settle("a", "req-2") == 2
    assert index_prefix(index, {"a"}, HASHES[:4])[("a", 0)] == 0
    assert index.held("a", GPU) == {HASHES[2]}


def test_a_restart_drops_the_credits_of_the_old_engines_requests():
    index = PrefixIndex()
    index.reset_replica("a", 1)
    index.predict("a", HASHES[:3], "req-1")
    index.reset_replica("a", 2)
    assert len(index) == 0 and index.provisional("a") == frozenset()
    assert index.settle("a", "req-1") == 0
