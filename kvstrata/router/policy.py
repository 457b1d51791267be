"""The router: which replica gets a request, by policy.

    kv           (default) the least work: prefill tokens not cached on the
                 replica (device hits count fully, CPU / disk / remote hits
                 by their weight, shared remote hits for everyone) plus its
                 queued prefill and running decodes; a prefix many prompts
                 continue (a shared system prompt) counts as held by every
                 replica; replicas far above the mean load are skipped; ties
                 go by a stable hash of the prompt's first block, so new
                 prefixes spread deterministically
    least-loaded kv with no hit credit: the least queued prefill and running
                 decodes (the same load kv scores), ties to the first
                 live replica after the last one dispatched to; hashes
                 nothing (the baseline that balances load alone)
    session      a stable hash of a session / user key (rendezvous hashing:
                 when the first choice is dead, the key's next choice)
    round-robin  the next live replica after the last one dispatched to

``Router.choose`` is pure: it returns a :class:`Decision` and changes
nothing but the prompt's own chain. It takes the prompt's hashes, or
better a :class:`PromptChain` (``Router.chain``): then the kv policy hashes
a block only while some live replica still holds the prefix before it, and
the other policies hash nothing; ``chain.finish()`` completes the chain
after the decision (for ``note_dispatched`` and the engine). Each call's
duration, lazy hashing included, is kept in ``Router.decision_ns``. The
caller applies it (``note_dispatched`` adds the request's load and moves
the round-robin cursor) and keeps loads current (``set_load``),
liveness (``mark_dead`` / ``mark_alive``) and the index (``ingest``,
``reset_replica``) fed from the engines.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

import msgspec
import xxhash

from kvstrata.kv.events import KVEventBatch
from kvstrata.kv.hashing import CacheIdentity
from kvstrata.kv.types import BlockHash
from kvstrata.router.hashes import PromptChain, PromptHasher
from kvstrata.router.index import MEDIA, IngestResult, PrefixIndex
from kvstrata.router.load import ReplicaLoad, overloaded
from kvstrata.router.shared import SharedPrefixes

POLICIES = ("kv", "least-loaded", "session", "round-robin")


class NoLiveReplicaError(RuntimeError):
    """Every replica is dead (or none is registered)."""


class RouterConfig(msgspec.Struct, frozen=True, kw_only=True):
    """``medium_weights``: the share of a hit block's prefill saved when it
    sits on that medium (GPU 1.0: nothing to do; a tier hit still costs the
    load). ``load_skip_factor``: skip a replica whose load exceeds this many
    times the mean (and ``load_skip_min_tokens``). ``decode_weight``: prefill
    tokens one running request weighs. ``max_replicas``: the most replicas
    registered at once (each hash's int has 4 x max_replicas bits: wider is
    slower). ``replay_window``: the engines'
    replay ring (``ZmqEventPublisher.buffer_steps``): a wider gap needs a
    snapshot. ``affinity``: how much a cached token outweighs load (kv's
    cost subtracts ``affinity`` x the saved tokens more, keeping a
    conversation where its prefix is rather than caching it twice; 0 scores
    the expected prefill work alone; 2, the default, hit 0.91-0.96 of one big
    cache's rate in ``tools/bench_trace_router.py`` where 1 hit 0.89-0.94,
    with the same load balance and TTFT). ``chain_cache_prompts``: the
    prompts whose chains the hasher remembers (keys: sessions and first
    blocks; 0: none), so a follow-up turn hashes only its new tail.
    ``shared_prefix_fanout``: after this many different continuations of a
    cached prefix were dispatched, kv counts that prefix as held by every
    replica (``kvstrata.router.shared``: a shared system prompt no longer
    ties every new conversation to the replica that cached it first); 0:
    never."""

    policy: str = "kv"
    medium_weights: dict[str, float] = msgspec.field(
        default_factory=lambda: {"GPU": 1.0, "CPU": 0.8, "DISK": 0.5, "REMOTE": 0.5})
    shared_remote: bool = True
    load_skip_factor: float = 4.0
    load_skip_min_tokens: float = 2048.0
    decode_weight: float = 16.0
    max_replicas: int = 16
    replay_window: int = 10_000
    affinity: float = 2.0
    chain_cache_prompts: int = 512
    shared_prefix_fanout: int = 2

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        if set(self.medium_weights) != set(MEDIA):
            raise ValueError(f"medium_weights must name exactly {', '.join(MEDIA)}; got {sorted(self.medium_weights)}")
        for medium, w in self.medium_weights.items():
            if not 0.0 <= w <= 1.0:
                raise ValueError(f"medium_weights[{medium!r}] must be in [0, 1], got {w!r}")
        if not self.load_skip_factor >= 1.0:
            raise ValueError(f"load_skip_factor must be >= 1 (else every replica may be skipped), "
                             f"got {self.load_skip_factor!r}")
        if self.affinity < 0:
            raise ValueError(f"affinity must be >= 0, got {self.affinity!r}")
        if self.decode_weight < 0 or self.load_skip_min_tokens < 0:
            raise ValueError("decode_weight and load_skip_min_tokens must be >= 0")
        if self.chain_cache_prompts < 0:
            raise ValueError(f"chain_cache_prompts must be >= 0, got {self.chain_cache_prompts!r}")
        if self.shared_prefix_fanout < 0:
            raise ValueError(f"shared_prefix_fanout must be >= 0, got {self.shared_prefix_fanout!r}")


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """Where a request goes and why. ``hit_tokens``: the winner's cached
    prefix (any medium, shared included), ``device_hit_tokens`` the part on
    its device; ``cost``: the work scored (kv policy; 0 for the others);
    ``skipped``: live replicas passed over for load; ``cached_blocks``: the
    longest prefix of the prompt any live replica holds (kv), and
    ``shared_blocks`` the leading blocks counted as held everywhere (kv:
    ``kvstrata.router.shared``)."""

    replica: str
    policy: str
    reason: str
    hit_tokens: int = 0
    device_hit_tokens: int = 0
    cost: float = 0.0
    skipped: tuple[str, ...] = ()
    cached_blocks: int = 0
    shared_blocks: int = 0


def _rendezvous(key: bytes, replicas: Sequence[str]) -> list[str]:
    """``replicas`` in the key's stable preference order (highest random weight)."""
    return sorted(replicas, key=lambda r: (xxhash.xxh3_64_intdigest(key, seed=_seed(r)), r), reverse=True)


def _seed(replica: str) -> int:
    return xxhash.xxh3_64_intdigest(replica.encode("utf-8"))


class Router:
    """Owns: the prefix index, each replica's load and liveness, the
    round-robin cursor, the hasher's LRU of recent chains, the shared
    prefixes (``shared``, None when off), the recent
    decision times, the recent dispatches (``dispatch_log``: request key and
    replica, for benchmarks' per-replica figures). Single-threaded (the
    server's event loop)."""

    def __init__(self, identity: CacheIdentity, config: RouterConfig | None = None) -> None:
        self.config = config = config if config is not None else RouterConfig()
        self.hasher = PromptHasher(identity, max_prompts=config.chain_cache_prompts)
        self.decision_ns: deque[int] = deque(maxlen=4096)  # each choose(), lazy hashing included
        self.dispatch_log: deque[tuple[str, str]] = deque(maxlen=65536)  # (key, replica) per keyed dispatch
        self.block_size = identity.block_size
        self.index = PrefixIndex(max_replicas=config.max_replicas, shared_remote=config.shared_remote,
                                 replay_window=config.replay_window)
        self.shared = SharedPrefixes(config.shared_prefix_fanout) if config.shared_prefix_fanout else None
        w = config.medium_weights
        self._weights = tuple(w[m] for m in MEDIA)
        self._loads: dict[str, ReplicaLoad] = {}
        self._dead: set[str] = set()
        self._live_mask = 0
        self._live: list[tuple[str, int]] = []  # (replica, slot) of the live ones, slot order
        self._rr_last = -1  # slot of the last dispatch
        self._policies: dict[str, Callable[[list[BlockHash] | PromptChain, str | None, int], Decision]] = {
            "kv": self._choose_kv, "least-loaded": self._choose_least_loaded, "session": self._choose_session,
            "round-robin": self._choose_round_robin,
        }

    # -- membership, load, events -------------------------------------------------

    def reset_replica(self, replica: str, epoch: int) -> None:
        """A replica (re)started with ``epoch``: its old blocks are dropped,
        it is live, its load is zero."""
        self.index.reset_replica(replica, epoch)
        self._dead.discard(replica)
        self._loads[replica] = ReplicaLoad()
        self._refresh_live()

    def remove_replica(self, replica: str) -> None:
        self.index.remove_replica(replica)
        self._dead.discard(replica)
        self._loads.pop(replica, None)
        self._refresh_live()

    def mark_dead(self, replica: str) -> None:
        self.index.slot(replica)  # KeyError naming it when unknown
        self._dead.add(replica)
        self._refresh_live()

    def mark_alive(self, replica: str) -> None:
        self.index.slot(replica)
        self._dead.discard(replica)
        self._refresh_live()

    def set_load(self, replica: str, load: ReplicaLoad) -> None:
        self.index.slot(replica)
        self._loads[replica] = load

    def load(self, replica: str) -> ReplicaLoad:
        return self._loads[replica]

    def ingest(self, replica: str, seq: int, batch: KVEventBatch, *, epoch: int | None = None) -> IngestResult:
        return self.index.ingest(replica, seq, batch, epoch=epoch)

    def _refresh_live(self) -> None:
        self._live = [(r, self.index.slot(r)) for r in self.index.replicas if r not in self._dead]
        self._live_mask = sum(1 << slot for _, slot in self._live)

    def live_replicas(self) -> list[str]:
        """Live replicas in slot order."""
        return [r for r, _ in self._live]

    # -- decisions ------------------------------------------------------------------

    def hash_prompt(self, token_ids: Sequence[int], *, lora_name: str | None = None,
                    cache_salt: str | None = None, session: str | None = None) -> list[BlockHash]:
        """The prompt's whole chain at once (reusing a remembered prefix of
        ``session``'s last prompt or of a prompt with the same first block)."""
        return self.hasher.hash_prompt(token_ids, lora_name=lora_name, cache_salt=cache_salt, session=session)

    def chain(self, token_ids: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None,
              session: str | None = None) -> PromptChain:
        """The prompt's chain, hashed on demand: give it to :meth:`choose`,
        then ``finish()`` it (after the decision) for ``note_dispatched``."""
        return self.hasher.chain(token_ids, lora_name=lora_name, cache_salt=cache_salt, session=session)

    def choose(self, request_hashes: list[BlockHash] | PromptChain, session_key: str | None = None, *,
               num_tokens: int | None = None, policy: str | None = None) -> Decision:
        """The replica for a request whose prompt has ``request_hashes`` (a
        list, or a :class:`PromptChain` hashed only as far as the decision
        needs; ``num_tokens`` long, by default its full blocks, or the
        chain's prompt). Changes nothing but the chain. Raises
        NoLiveReplicaError when no replica is live."""
        t0 = time.perf_counter_ns()
        if not self._live_mask:
            raise NoLiveReplicaError(f"no live replica (known: {self.index.replicas}, dead: {sorted(self._dead)})")
        name = self.config.policy if policy is None else policy
        choose = self._policies.get(name)
        if choose is None:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}; got {name!r}")
        if num_tokens is None:
            num_tokens = (request_hashes.num_tokens if isinstance(request_hashes, PromptChain)
                          else len(request_hashes) * self.block_size)
        d = choose(request_hashes, session_key, num_tokens)
        self.decision_ns.append(time.perf_counter_ns() - t0)
        return d

    def note_dispatched(self, decision: Decision, num_tokens: int,
                        hashes: list[BlockHash] | PromptChain | None = None, *,
                        key: str | None = None) -> None:
        """Apply a decision: the request's uncached prompt joins the replica's
        queued prefill, one more request runs there, round-robin moves on;
        with ``hashes`` (the prompt's; a PromptChain is finished here) and ``key`` (the request's id), the
        replica is credited with them ahead of its events until
        :meth:`note_settled` (``PrefixIndex.predict``), and a prompt that
        goes on past its cached prefix counts as one more continuation of
        it (``SharedPrefixes.note_branch``)."""
        if isinstance(hashes, PromptChain):
            hashes = hashes.finish()
        if key is not None:
            self.dispatch_log.append((key, decision.replica))
        if hashes and self.shared is not None:
            self.shared.note_branch(hashes, decision.cached_blocks)
        if hashes:
            if key is None:
                raise ValueError("note_dispatched(hashes=...) needs key=: the request's id, "
                                 "to withdraw the credit when the request settles (note_settled)")
            self.index.predict(decision.replica, hashes, key)
        load = self._loads[decision.replica]
        self._loads[decision.replica] = ReplicaLoad(
            queued_prefill_tokens=load.queued_prefill_tokens + max(num_tokens - decision.hit_tokens, 0),
            running_requests=load.running_requests + 1,
        )
        self._rr_last = self.index.slot(decision.replica)

    def note_settled(self, replica: str, key: str) -> int:
        """Request ``key`` on ``replica`` finished, failed or was aborted:
        its dispatch credit is withdrawn where the engine's events have not
        confirmed it (``PrefixIndex.settle``). Returns the hashes withdrawn."""
        return self.index.settle(replica, key)

    def _choose_round_robin(self, hashes: list[BlockHash] | PromptChain, session_key: str | None, num_tokens: int) -> Decision:
        live = self._live_mask
        after = live >> (self._rr_last + 1)  # live slots after the cursor, else wrap to the lowest
        slot = (self._rr_last + 1 + ((after & -after).bit_length() - 1)) if after else (live & -live).bit_length() - 1
        return Decision(replica=self.index.replica_at(slot), policy="round-robin", reason="next live replica")

    def _choose_least_loaded(self, hashes: list[BlockHash] | PromptChain, session_key: str | None,
                             num_tokens: int) -> Decision:
        """kv's cost with every hit counted as a miss: the prompt plus the
        load, so the least load wins; among equals, the first live slot
        after the round-robin cursor (idle replicas take turns)."""
        decode_weight, loads, last = self.config.decode_weight, self._loads, self._rr_last
        best_key, best = None, ""
        for name, slot in self._live:
            key = (loads[name].cost(decode_weight), slot <= last, slot)  # after the cursor first, then wrap
            if best_key is None or key < best_key:
                best_key, best = key, name
        assert best_key is not None  # choose() checked that some replica is live
        return Decision(replica=best, policy="least-loaded", reason="least load", cost=num_tokens + best_key[0])

    def _choose_session(self, hashes: list[BlockHash] | PromptChain, session_key: str | None, num_tokens: int) -> Decision:
        if session_key is None:
            d = self._choose_kv(hashes, None, num_tokens)
            return msgspec.structs.replace(d, policy="session", reason=f"no session key; {d.reason}")
        order = _rendezvous(session_key.encode("utf-8"), self.index.replicas)
        first = order[0]
        pick = next(r for r in order if r not in self._dead)
        reason = "session key's replica" if pick == first else f"session key's replica {first} is dead: its next choice"
        return Decision(replica=pick, policy="session", reason=reason)

    def _choose_kv(self, hashes: list[BlockHash] | PromptChain, session_key: str | None,
                   num_tokens: int) -> Decision:
        index, w = self.index, self.index.width
        if isinstance(hashes, PromptChain):
            hits = index.prefix_blocks_lazy(hashes, self._live_mask)
            hashes = hashes.known  # block 0 at least, when the prompt has a full block
        else:
            hits = index.prefix_blocks(hashes, self._live_mask)
        s = self.shared.depth(hashes) if self.shared is not None else 0  # held everywhere, for the cost
        w0, w1, w2, w3 = self._weights
        bs, decode_weight, affinity = self.block_size, self.config.decode_weight, self.config.affinity
        live, all_loads = self._live, self._loads
        loads = [all_loads[r].cost(decode_weight) for r, _ in live]
        skip = overloaded(loads, self.config.load_skip_factor, self.config.load_skip_min_tokens)
        best_cost, best = None, []
        skipped = []
        cached = 0
        for (name, slot), load, skipped_it in zip(live, loads, skip):
            a = hits.get(3 * w + slot, 0)
            if a > cached:
                cached = a
            if skipped_it:
                skipped.append(name)
                continue
            g = hits.get(slot, 0)
            c = hits.get(w + slot, 0)
            d = hits.get(2 * w + slot, 0)
            gs, cs, ds, as_ = g, c, d, a  # the lanes scored: a shared prefix counts as on the device
            if s > g:
                gs, cs, ds, as_ = s, max(c, s), max(d, s), max(a, s)
            saved = bs * (gs * w0 + (cs - gs) * w1 + (ds - cs) * w2 + (as_ - ds) * w3)
            cost = max(num_tokens - saved, 0.0) + load - affinity * saved
            if best_cost is None or cost < best_cost:
                best_cost, best = cost, [(name, a, g)]
            elif cost == best_cost:
                best.append((name, a, g))
        assert best_cost is not None  # the least-loaded replica is never skipped
        if len(best) == 1:
            (name, a, g), reason = best[0], "least cost"
        else:
            key = bytes(hashes[0]) if hashes else b""
            pick = _rendezvous(key, [b[0] for b in best])[0]
            (name, a, g) = next(b for b in best if b[0] == pick)
            reason = f"least cost, tied by {len(best)}: prefix hash"
        return Decision(replica=name, policy="kv", reason=reason, hit_tokens=a * bs, device_hit_tokens=g * bs,
                        cost=best_cost, skipped=tuple(skipped), cached_blocks=cached, shared_blocks=s)
