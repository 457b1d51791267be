"""Router decisions: never a dead replica; kv picks the replica with the
largest credited prefix when loads are equal, skips replicas far above the
mean load, breaks ties by the prefix's hash (stable, spread); session and
round-robin; least-loaded (kv with no hit credit); choose changes nothing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.kv.events import BlockStored, KVEventBatch
from kvstrata.kv.hashing import CacheIdentity
from kvstrata.router import CPU, DISK, GPU, MEDIA, REMOTE, NoLiveReplicaError, ReplicaLoad, Router, RouterConfig

BS = 4
IDENTITY = CacheIdentity(model_fingerprint="router-test", kv_dtype="float32", kv_layout="per_layer", block_size=BS)
CHAIN = [bytes([i]) * 8 for i in range(8)]
NAMES = ["r0", "r1", "r2", "r3"]
ALL_POLICIES = ["kv", "least-loaded", "session", "round-robin"]


def make_router(names=NAMES, **cfg) -> Router:
    cfg.setdefault("affinity", 0.0)  # costs below are the prefill work alone unless a test says otherwise
    router = Router(IDENTITY, RouterConfig(**cfg))
    for n in names:
        router.reset_replica(n, epoch=1)
    return router


def store(router: Router, replica: str, hashes, medium=GPU) -> None:
    seq = router.index.expected_seq(replica) or 0
    ev = BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=BS, medium=medium)
    assert router.ingest(replica, seq, KVEventBatch(ts=0.0, events=[ev])).action == "applied"


placement = st.lists(st.tuples(st.sampled_from(NAMES), st.sampled_from(MEDIA), st.integers(0, 8)), max_size=10)


def populate(router: Router, placed) -> dict[str, dict[bytes, set[str]]]:
    held: dict[str, dict[bytes, set[str]]] = {n: {} for n in NAMES}
    for name, medium, n in placed:
        store(router, name, CHAIN[:n], medium)
        for h in CHAIN[:n]:
            held[name].setdefault(h, set()).add(medium)
    return held


@settings(max_examples=150, deadline=None)
@given(placed=placement, dead=st.sets(st.sampled_from(NAMES), max_size=3), policy=st.sampled_from(ALL_POLICIES),
       key=st.one_of(st.none(), st.text(max_size=5)), loads=st.lists(st.integers(0, 10_000), min_size=4, max_size=4))
def test_choose_never_picks_a_dead_replica(placed, dead, policy, key, loads):
    router = make_router()
    populate(router, placed)
    for n, q in zip(NAMES, loads):
        router.set_load(n, ReplicaLoad(queued_prefill_tokens=q))
    for n in dead:
        router.mark_dead(n)
    for _ in range(3):
        d = router.choose(CHAIN, key, policy=policy)
        assert d.replica not in dead and d.policy == policy
        router.note_dispatched(d, len(CHAIN) * BS)


def test_no_live_replica_is_an_error_naming_the_dead():
    router = make_router(["a", "b"])
    router.mark_dead("a")
    router.mark_dead("b")
    with pytest.raises(NoLiveReplicaError, match=r"dead: \['a', 'b'\]"):
        router.choose(CHAIN)
    with pytest.raises(NoLiveReplicaError):
        make_router([]).choose(CHAIN)


@settings(max_examples=200, deadline=None)
@given(placed=placement, shared_stored=st.booleans(), dead=st.sets(st.sampled_from(NAMES), max_size=3))
def test_kv_picks_a_replica_with_the_largest_credited_prefix_when_loads_are_equal(placed, shared_stored, dead):
    router = make_router()
    if shared_stored:
        placed = [*placed, ("r3", REMOTE, 2)]
    held = populate(router, placed)
    for n in dead:
        router.mark_dead(n)
    live = [n for n in NAMES if n not in dead]
    shared = {h for n in NAMES for h, media in held[n].items() if REMOTE in media}
    saved = {}
    for n in live:  # the shared tier: any replica's REMOTE copy counts here too
        view = {h: media | ({REMOTE} if h in shared else set()) for h, media in held[n].items()}
        saved[n] = naive_saved({**{h: {REMOTE} for h in shared}, **view}, router)
    d = router.choose(CHAIN)
    assert saved[d.replica] == pytest.approx(max(saved.values()))
    assert d.cost == pytest.approx(len(CHAIN) * BS - max(saved.values()))


def naive_saved(view: dict[bytes, set[str]], router: Router) -> float:
    """Tokens a replica saves, walking block by block: each block counted on
    its best medium, never better than the block before (the engine's order)."""
    weights = [router.config.medium_weights[m] for m in MEDIA]
    saved, level = 0.0, 0
    for h in CHAIN:
        media = view.get(h, set())
        while level < 4 and not (set(MEDIA[: level + 1]) & media):
            level += 1
        if level == 4:
            break
        saved += weights[level]
    return saved * BS


def test_device_hits_beat_equal_tier_hits_and_a_shared_block_counts_for_all():
    router = make_router(["a", "b", "c"])
    store(router, "a", CHAIN[:6], CPU)
    store(router, "b", CHAIN[:6], GPU)
    store(router, "c", CHAIN[:7], DISK)
    d = router.choose(CHAIN)
    assert (d.replica, d.hit_tokens, d.device_hit_tokens) == ("b", 6 * BS, 6 * BS)
    store(router, "c", CHAIN, REMOTE)  # the whole chain in the shared tier
    d = router.choose(CHAIN)
    assert (d.replica, d.hit_tokens, d.device_hit_tokens) == ("b", 8 * BS, 6 * BS)
    router.mark_dead("b")
    router.mark_dead("c")
    d = router.choose(CHAIN)  # a never stored REMOTE, yet the shared copy counts for it
    assert (d.replica, d.hit_tokens) == ("a", 8 * BS)


def test_kv_skips_a_replica_far_above_the_mean_load():
    router = make_router(load_skip_factor=2.0, load_skip_min_tokens=100)
    store(router, "r0", CHAIN)  # r0 has every block...
    router.set_load("r0", ReplicaLoad(queued_prefill_tokens=10_000))  # ...and a long queue
    for n in NAMES[1:]:
        router.set_load(n, ReplicaLoad(queued_prefill_tokens=10, running_requests=1))
    d = router.choose(CHAIN)
    assert d.replica != "r0" and d.skipped == ("r0",)
    router.set_load("r0", ReplicaLoad(queued_prefill_tokens=20))  # back near the mean
    d = router.choose(CHAIN)
    assert d.replica == "r0" and d.skipped == ()


def test_small_loads_below_the_minimum_are_not_skipped():
    router = make_router(load_skip_factor=1.0, load_skip_min_tokens=2048)
    store(router, "r2", CHAIN)
    router.set_load("r2", ReplicaLoad(queued_prefill_tokens=20))  # 4 times the mean, below 2048
    d = router.choose(CHAIN)  # r2 costs 20 (its load), the others 32 (the prompt)
    assert (d.replica, d.cost, d.skipped) == ("r2", 20.0, ())


@settings(max_examples=100, deadline=None)
@given(first=st.binary(min_size=8, max_size=8), order=st.permutations(NAMES))
def test_ties_are_broken_by_the_prefix_hash_the_same_way_in_any_router(first, order):
    a, b = make_router(NAMES), make_router(order)  # other slots, same names
    chain = [first, *CHAIN[1:]]
    assert a.choose(chain) == b.choose(chain)
    assert a.choose(chain).reason.startswith("least cost, tied by 4")


def test_new_prefixes_spread_over_the_replicas():
    router = make_router()
    counts = dict.fromkeys(NAMES, 0)
    for i in range(400):
        counts[router.choose([i.to_bytes(8, "big")]).replica] += 1
    assert min(counts.values()) >= 60, counts


def test_choose_changes_nothing_and_note_dispatched_adds_the_load():
    router = make_router(["a", "b"])
    store(router, "a", CHAIN[:2])
    before = (router.load("a"), router.load("b"))
    first = router.choose(CHAIN, num_tokens=35)
    assert router.choose(CHAIN, num_tokens=35) == first and (router.load("a"), router.load("b")) == before
    assert first.replica == "a" and first.hit_tokens == 2 * BS
    router.note_dispatched(first, 35)
    assert router.load("a") == ReplicaLoad(queued_prefill_tokens=35 - 2 * BS, running_requests=1)


def test_round_robin_cycles_over_the_live_replicas():
    router = make_router(policy="round-robin")
    router.mark_dead("r2")
    picks = []
    for _ in range(6):
        d = router.choose(CHAIN)
        picks.append(d.replica)
        router.note_dispatched(d, 32)
    assert picks == ["r0", "r1", "r3", "r0", "r1", "r3"]


def test_session_keys_stick_and_fall_back_to_their_next_choice_when_dead():
    router = make_router(policy="session")
    homes = {k: router.choose(CHAIN, k).replica for k in map(str, range(40))}
    assert len(set(homes.values())) == 4  # keys spread
    assert all(router.choose([], k).replica == r for k, r in homes.items())  # the prompt does not matter
    router.mark_dead("r1")
    moved = {k: router.choose(CHAIN, k) for k, r in homes.items() if r == "r1"}
    assert moved and all(d.replica != "r1" and "r1 is dead" in d.reason for d in moved.values())
    assert all(router.choose(CHAIN, k).replica == r for k, r in homes.items() if r != "r1")  # the others stay
    router.mark_alive("r1")
    assert all(router.choose(CHAIN, k).replica == "r1" for k in moved)


def test_session_without_a_key_routes_by_kv():
    router = make_router(policy="session")
    store(router, "r3", CHAIN)
    d = router.choose(CHAIN)
    assert (d.replica, d.policy) == ("r3", "session") and d.reason.startswith("no session key")


def test_a_restarted_replica_is_credited_nothing_from_its_old_epoch():
    router = make_router(["a", "b"])
    store(router, "a", CHAIN)
    assert router.choose(CHAIN).replica == "a"
    router.reset_replica("a", epoch=2)
    assert router.choose(CHAIN).hit_tokens == 0


@pytest.mark.parametrize("cfg, match", [
    ({"policy": "random"}, "router policy must be one of kv, least-loaded, session, round-robin; got 'random'"),
    ({"medium_weights": {"GPU": 1.0}}, "medium_weights must name exactly"),
    ({"medium_weights": {"GPU": 1.0, "CPU": 2.0, "DISK": 0.5, "REMOTE": 0.5}}, r"medium_weights\['CPU'\]"),
    ({"load_skip_factor": 0.5}, "load_skip_factor must be >= 1"),
])
def test_bad_router_config_is_named(cfg, match):
    with pytest.raises(ValueError, match=match):
        RouterConfig(**cfg)


def test_a_dispatched_prompt_is_credited_before_its_events_arrive():
    """A burst sharing a new prefix follows the first request instead of
    spreading the prefix over every replica (``note_dispatched(hashes=)``)."""
    router = make_router(names=["r0", "r1"])
    first = router.choose(CHAIN, num_tokens=len(CHAIN) * BS)
    with pytest.raises(ValueError, match="needs key="):
        router.note_dispatched(first, len(CHAIN) * BS, hashes=CHAIN)
    router.note_dispatched(first, len(CHAIN) * BS, hashes=CHAIN, key="req-1")
    router.set_load(first.replica, ReplicaLoad())  # its load aside: only the credit differs
    again = router.choose(CHAIN, num_tokens=len(CHAIN) * BS)
    assert again.replica == first.replica and again.device_hit_tokens == len(CHAIN) * BS
    assert router.index.counters.predicted == len(CHAIN)
    # the engine's own events confirm (no double count); the request settling leaves the confirmed blocks
    router.index.ingest(first.replica, 0, KVEventBatch(ts=0.0, events=[
        BlockStored(block_hashes=CHAIN[:-1], parent_block_hash=None, token_ids=[], block_size=BS)]))
    assert router.index.held(first.replica, GPU) == frozenset(CHAIN[:-1])
    assert router.note_settled(first.replica, "req-1") == 1  # the one block the engine never reported
    assert router.choose(CHAIN, num_tokens=len(CHAIN) * BS).device_hit_tokens == (len(CHAIN) - 1) * BS


def test_affinity_keeps_a_prefix_home_against_a_little_more_load():
    for affinity, home_wins in ((0.0, False), (1.0, True)):
        router = make_router(names=["r0", "r1"], affinity=affinity, load_skip_min_tokens=1e9)
        store(router, "r0", CHAIN[:4])  # 16 tokens cached on r0
        router.set_load("r0", ReplicaLoad(queued_prefill_tokens=20))  # costs 32 - 16 + 20 = 36 there
        d = router.choose(CHAIN, num_tokens=len(CHAIN) * BS)  # 32 on the idle r1
        assert (d.replica == "r0") == home_wins, (affinity, d)


def test_cli_router_affinity_default_is_the_routers():
    from kvstrata.cli.main import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.router_affinity == RouterConfig().affinity
    assert args.router_shared_fanout == RouterConfig().shared_prefix_fanout


@settings(max_examples=200, deadline=None)
@given(placed=placement, dead=st.sets(st.sampled_from(NAMES), max_size=3),
       loads=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 8)), min_size=4, max_size=4),
       cursor=st.integers(0, 3))
def test_least_loaded_picks_the_least_load_whatever_is_cached(placed, dead, loads, cursor):
    """The replica with the least queued prefill plus weighted decodes,
    cached prefixes ignored; among equals, the first live one after the
    last dispatch (wrapping)."""
    router = make_router(policy="least-loaded", decode_weight=16.0)
    populate(router, placed)
    for _ in range(cursor + 1):  # the last dispatch went to NAMES[cursor]
        router.note_dispatched(router.choose(CHAIN, policy="round-robin"), 0)
    for n, (q, running) in zip(NAMES, loads):
        router.set_load(n, ReplicaLoad(queued_prefill_tokens=q, running_requests=running))
    for n in dead:
        router.mark_dead(n)
    live = [n for n in NAMES if n not in dead]
    cost = {n: q + 16.0 * running for n, (q, running) in zip(NAMES, loads) if n in live}
    least = min(cost.values())
    tied = [n for n in live if cost[n] == least]
    after = [n for n in tied if NAMES.index(n) > cursor]
    d = router.choose(CHAIN, num_tokens=len(CHAIN) * BS)
    assert d.replica == (after or tied)[0]
    assert (d.policy, d.hit_tokens, d.device_hit_tokens, d.skipped) == ("least-loaded", 0, 0, ())
    assert d.cost == len(CHAIN) * BS + least


def test_least_loaded_ignores_a_cached_prefix_that_kv_follows():
    router = make_router(["a", "b"], policy="least-loaded")
    store(router, "a", CHAIN)  # a holds the whole prompt
    router.set_load("a", ReplicaLoad(queued_prefill_tokens=1))
    assert router.choose(CHAIN).replica == "b"
    assert router.choose(CHAIN, policy="kv").replica == "a"


def test_least_loaded_idle_replicas_take_turns_and_its_queue_grows():
    router = make_router(policy="least-loaded")
    router.mark_dead("r1")
    picks = []
    for _ in range(6):
        d = router.choose(CHAIN, num_tokens=32)
        picks.append(d.replica)
        router.note_dispatched(d, 32)
    assert picks == ["r0", "r2", "r3", "r0", "r2", "r3"]  # equal loads at each turn: the cursor's order
    assert router.load("r0") == ReplicaLoad(queued_prefill_tokens=64, running_requests=2)  # no hit credit
    router.set_load("r2", ReplicaLoad())  # r2 finished its work: it is the least loaded
    assert router.choose(CHAIN).replica == "r2"


def test_least_loaded_hashes_nothing_of_a_lazy_chain():
    router = make_router(policy="least-loaded")
    tokens = list(range(len(CHAIN) * BS))
    chain = router.chain(tokens)
    d = router.choose(chain)
    assert chain.known == [] and d.replica == "r0"
    router.note_dispatched(d, len(tokens), chain, key="req-1")  # finished here, then credited
    assert len(chain.known) == len(CHAIN) and router.index.counters.predicted == len(CHAIN)


def test_keyed_dispatches_are_logged_with_their_replica():
    router = make_router(["a", "b"], policy="round-robin")
    for i in range(3):
        router.note_dispatched(router.choose(CHAIN), 32, key=f"req-{i}")
    router.note_dispatched(router.choose(CHAIN), 32)  # no key: nothing to name it by
    assert list(router.dispatch_log) == [("req-0", "a"), ("req-1", "b"), ("req-2", "a")]
