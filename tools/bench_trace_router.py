"""Trace-replay benchmark of the KV-cache-aware router (kvstrata.router)
against N replicas. Prints JSON (and, with ``--plot DIR``, writes the JSON
and a PNG there).

TIMING IS SIMULATED. This machine cannot run 4 or 8 real engine replicas at
a meaningful load, so this is a discrete-event simulation in which everything
except the model's compute is real, in the way NVIDIA Dynamo's ``mocker``
engine simulates workers for its router benchmarks:

* each replica is a real ``kvstrata.kv.KVCacheManager`` (prefix caching on,
  events on, ``--block-size`` tokens a block, a pool of
  ``--blocks-total / N`` blocks), driven by a small continuous-batching step
  loop modelled on the engine's scheduler: running requests first (chunked
  prefill, then one token a step), preempting the latest running request
  (recompute: its blocks are freed and stay cached) when the pool is full;
  then waiting requests in FIFO order (``get_computed_blocks`` +
  ``allocate_slots``) while the step's token budget and the pool allow;
  finished requests are freed (their blocks stay cached for reuse). A step
  costs simulated time ``a + b * prefill_tokens + c * decode_requests``
  (``--step-overhead-s``, ``--prefill-token-s``, ``--decode-req-s``);
* the router is the real ``kvstrata.router.Router``: each replica's KV events
  (``take_events`` at the end of each step, medium renamed GPU as the engine
  publishes them) go to ``Router.ingest`` as a ``KVEventBatch`` with a
  per-replica sequence number; loads go in with ``set_load`` after each step
  and ``note_dispatched`` at each dispatch (``note_settled`` when it
  finishes); each request is placed by the
  real ``choose`` on the real block hashes of its prompt's token ids
  (``Router.hash_prompt``). Decision latency (with and without hashing) and
  event ingest rate are real wall-clock figures, measured on this machine
  inside the simulation loop.

Prompts: each trace hash id (one per 512-token block) becomes a fixed, seeded
block of ``512 / --length-divisor`` token ids (same id, same tokens); the
prompt is the concatenation, cut to ``input_length / divisor``; the output is
``output_length / divisor`` tokens (at least 1). A prompt longer than one
replica's pool (with its output) is cut to fit (counted as ``clipped``).

Load: the first ``--num-requests`` requests of the trace (from
``--offset``); their timestamps are scaled linearly so that the fleet's
offered load is ``--load`` of its simulated capacity, where a request's work
is ``b * prompt_tokens + c * output_tokens + a * prefill_steps`` (no cache
hits assumed; decode steps' overhead, shared by a batch, is not counted).
The same arrival times are replayed for every policy.

Shared tier (``--shared-tier-blocks N``): the fleet's shared remote tier
(Redis / Redis Cluster in a real fleet) as an LRU of N blocks. Every block a
replica caches is written to it (shared tiers get every saved chunk); a
request admitted on any replica loads the tier's blocks that follow its
device hit, as the connector would (at ``--remote-token-s`` simulated seconds
a token, in that step); the saving replica's event stream reports the tier's
``REMOTE`` stores and evictions, which the router counts for every replica.
``hit_rate_with_shared_tier`` is device plus tier hits.

Load sweep (``--sweep-loads 0.6,0.8,1.0``): round-robin, kv and the single
big cache replayed at each offered load, with TTFT p50 / p99, the kv /
round-robin ratios and each policy's ``utilization`` (its simulated busy
time over the arrival span: the load it really put on the fleet, which the
offered load, counted without cache hits, overstates).

Policies: ``round-robin``, ``session``, ``kv`` (the router's three), and the
ideal baseline ``single-big-cache``: ONE replica whose pool is all N pools
together, with the same per-step token budget and an N times faster cost
model (a, b, c divided by N), so the same offered load; its hit rate is the
reference for the others' (``hit_rate_vs_single_big_cache``).

Session key: the synthetic trace and the conversation trace carry no user
id. The key is the request's first hash id that is not a fleet-wide shared
prefix (an id at that position in more than half of the subset's requests is
skipped): in the conversation trace every request starts with hash id 0 (a
shared system prompt), so the first hash id alone would send every request
to one replica; in practice the key is hash id 1 there, hash id 0 in the
synthetic trace. The JSON says which positions were skipped;
``--session-key first`` keys by the first hash id alone.

The router's token-denominated settings are scaled with the lengths
(``decode_weight`` 16 -> 16 / divisor, ``load_skip_min_tokens`` 2048 ->
2048 / divisor); the rest are ``RouterConfig`` defaults.

    python tools/bench_trace_router.py [--replicas 4 --trace both --plot /tmp/out ...]
    python tools/bench_trace_router.py --trace synthetic --shared-tier-blocks 131072 --sweep-loads 0.8,1.0
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import math
import random
import sys
import time
from collections import Counter, OrderedDict, deque
from pathlib import Path

import msgspec

from kvstrata.kv import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheManager, make_block_hasher
from kvstrata.kv.events import BlockRemoved, BlockStored, KVEventBatch
from kvstrata.kv.hashing import CacheIdentity
from kvstrata.router import GPU, REMOTE, ReplicaLoad, Router, RouterConfig

TRACE_BLOCK = 512  # tokens per trace hash id
VOCAB = 32_000
TRACES = {"conversation": "mooncake_conversation_trace.jsonl", "synthetic": "mooncake_synthetic_trace.jsonl"}
DEFAULT_TRACE_DIR = Path(__file__).resolve().parents[2] / "shared" / "traces"
POLICIES = ("round-robin", "session", "kv")
BIG = "single-big-cache"


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(int(q * len(s)), len(s) - 1)]


# -- workload ---------------------------------------------------------------------


class TraceRequest(msgspec.Struct, frozen=True):
    """One trace line after scaling: prompt token ids, output length, arrival (simulated s)."""

    idx: int
    arrival: float
    prompt: list[int]
    output_len: int
    session_key: str
    clipped: bool


def load_trace(path: Path, offset: int, n: int) -> list[dict]:
    rows = []
    with path.open() as f:
        for i, line in enumerate(f):
            if i < offset:
                continue
            if len(rows) >= n:
                break
            rows.append(json.loads(line))
    if not rows:
        raise SystemExit(f"{path}: no requests at offset {offset}")
    return rows


def session_keys(rows: list[dict], first_only: bool = False) -> tuple[list[str], list[int]]:
    """Per request: its first hash id that is not a fleet-wide shared prefix;
    and the skipped positions (ids held by > half the requests there).
    ``first_only``: the first hash id, whatever it is."""
    skipped = []
    pos = 0
    while not first_only:
        c = Counter(r["hash_ids"][pos] for r in rows if len(r["hash_ids"]) > pos)
        if not c or c.most_common(1)[0][1] * 2 <= len(rows):
            break
        skipped.append(pos)
        pos += 1
    keys = []
    for r in rows:
        ids = r["hash_ids"]
        keys.append(str(ids[pos] if len(ids) > pos else ids[-1] if ids else "none"))
    return keys, skipped


def build_workload(rows: list[dict], args: argparse.Namespace, max_tokens: int) -> tuple[list[TraceRequest], dict]:
    div = args.length_divisor
    per_block = TRACE_BLOCK // div
    blocks: dict[int, list[int]] = {}
    population = range(VOCAB)

    def block(h: int) -> list[int]:
        b = blocks.get(h)
        if b is None:
            b = blocks[h] = random.Random(f"{args.seed}:{h}").choices(population, k=per_block)
        return b

    keys, skipped = session_keys(rows, first_only=args.session_key == "first")
    a, b, c, budget = args.step_overhead_s, args.prefill_token_s, args.decode_req_s, args.token_budget
    work = 0.0
    prompts, outs, clipped = [], [], []
    for r in rows:
        n_in = max(1, r["input_length"] // div)
        n_out = max(1, r["output_length"] // div)
        toks: list[int] = []
        for h in r["hash_ids"]:
            if len(toks) >= n_in:
                break
            toks.extend(block(h))
        if len(toks) < n_in:  # more tokens than hash ids cover (not in these traces): unique filler
            toks.extend(random.Random(f"{args.seed}:pad:{len(prompts)}").choices(population, k=n_in - len(toks)))
        toks = toks[:n_in]
        cut = len(toks) + n_out > max_tokens
        if cut:
            toks = toks[: max(1, max_tokens - n_out)]
        prompts.append(toks)
        outs.append(n_out)
        clipped.append(cut)
        work += b * len(toks) + c * n_out + a * math.ceil(len(toks) / budget)
    # Offered load: `work` seconds of compute over N replicas in `span` seconds.
    span = work / (args.replicas * args.load)
    t0 = rows[0]["timestamp"]
    trace_span = max(rows[-1]["timestamp"] - t0, 1)
    scale = span / trace_span
    reqs = [TraceRequest(idx=i, arrival=(r["timestamp"] - t0) * scale, prompt=p, output_len=o, session_key=k,
                         clipped=cl)
            for i, (r, p, o, k, cl) in enumerate(zip(rows, prompts, outs, keys, clipped))]
    info = {
        "requests": len(reqs),
        "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1),
        "output_tokens_mean": round(sum(outs) / len(outs), 1),
        "clipped_prompts": sum(clipped),
        "trace_span_s": round(trace_span / 1000, 1),
        "simulated_arrival_span_s": round(span, 3),
        "time_compression": round(trace_span / 1000 / span, 2),
        "offered_work_s": round(work, 3),
        "session_key": f"first hash id after positions {skipped} (fleet-wide shared prefix)" if skipped
        else "first hash id",
    }
    return reqs, info


# -- one simulated replica ---------------------------------------------------------


class SimRequest:
    """A KVRequest (the fields the KV manager reads) plus the simulation's bookkeeping."""

    __slots__ = ("request_id", "all_token_ids", "num_prompt_tokens", "num_computed_tokens", "block_hashes",
                 "lora_name", "cache_salt", "mm_features", "prompt_embeds_digest", "num_preemptions",
                 "arrival", "output_len", "num_output", "first_token_t", "finish_t", "hit_tokens", "idx",
                 "predicted_hit", "tier_hit_tokens")

    def __init__(self, tr: TraceRequest) -> None:
        self.request_id = f"req-{tr.idx}"
        self.idx = tr.idx
        self.all_token_ids = list(tr.prompt)
        self.num_prompt_tokens = len(tr.prompt)
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []
        self.lora_name = self.cache_salt = self.prompt_embeds_digest = None
        self.mm_features: list = []
        self.num_preemptions = 0
        self.arrival = tr.arrival
        self.output_len = tr.output_len
        self.num_output = 0
        self.first_token_t: float | None = None
        self.finish_t: float | None = None
        self.hit_tokens: int | None = None  # device hit at first admission
        self.tier_hit_tokens = 0  # shared-tier hit beyond it, loaded at first admission
        self.predicted_hit = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class SharedTier:
    """The fleet's shared remote tier (Redis / Redis Cluster in a real
    fleet): an LRU set of block hashes of ``capacity`` blocks that every
    replica writes its cached blocks to (shared tiers get every saved chunk)
    and every replica reads. Each entry remembers the replica that saved it:
    that replica's event stream reports it (``REMOTE`` BlockStored, and
    BlockRemoved when evicted), as the engine's connector reports its saves.
    Owns: the entries and the REMOTE events not yet published."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[bytes, str] = OrderedDict()
        self.pending: dict[str, list] = {}
        self.hits = self.saves = self.evictions = 0

    def save(self, owner: str, hashes: list[bytes]) -> None:
        entries, stored = self.entries, []
        for h in hashes:
            if h in entries:
                entries.move_to_end(h)
                continue
            entries[h] = owner
            stored.append(h)
            self.saves += 1
            if len(entries) > self.capacity:
                old, old_owner = entries.popitem(last=False)
                self.evictions += 1
                self._publish(old_owner, BlockRemoved(block_hashes=[old], medium=REMOTE))
        if stored:
            self._publish(owner, BlockStored(block_hashes=stored, parent_block_hash=None, token_ids=[],
                                             block_size=0, medium=REMOTE))

    def _publish(self, owner: str, event) -> None:
        self.pending.setdefault(owner, []).append(event)

    def match(self, hashes: list[bytes], start: int) -> int:
        """How many of ``hashes[start:]``, in order, the tier holds (they are touched)."""
        entries, n = self.entries, 0
        for h in hashes[start:]:
            if h not in entries:
                break
            entries.move_to_end(h)
            n += 1
        self.hits += n
        return n

    def take(self, owner: str) -> list:
        return self.pending.pop(owner, [])


class Replica:
    """A real KVCacheManager with a simple continuous-batching step loop and
    a linear cost model. Owns its waiting queue and running list."""

    def __init__(self, name: str, num_blocks: int, identity: CacheIdentity, args: argparse.Namespace,
                 speed: float, shared: SharedTier | None = None) -> None:
        bs = identity.block_size
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=8, head_size=128, dtype="bfloat16")
        self.kv = KVCacheManager(
            KVCacheConfig(num_blocks=num_blocks + 1, groups=[KVCacheGroupSpec(layer_names=["l0"], spec=spec)]),
            max_model_len=num_blocks * bs, enable_caching=True, log_stats=True, enable_events=True,
            metrics_sample_rate=0.0, hash_block_size=bs)
        self.hasher = make_block_hasher(identity)
        self.name = name
        self.a = args.step_overhead_s / speed
        self.b = args.prefill_token_s / speed
        self.c = args.decode_req_s / speed
        self.r = args.remote_token_s / speed
        self.shared = shared
        self.loaded_tokens = 0
        self.budget = args.token_budget
        self.max_running = args.max_running
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.busy = False
        self.seq = 0
        self.busy_s = 0.0
        self.prefill_tokens = 0
        self.preemptions = 0
        self.steps = 0
        self.dispatched = 0
        self._sched: list[tuple[SimRequest, int]] = []

    def add(self, req: SimRequest) -> None:
        req.block_hashes.extend(self.hasher(req))  # as the engine does when a request arrives
        self.dispatched += 1
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, req: SimRequest) -> None:
        self.kv.cache_blocks(req, req.num_computed_tokens)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def start_step(self) -> float:
        """Schedule one step (allocations happen now); returns its simulated duration."""
        kv, budget, sched = self.kv, self.budget, []
        kv.new_step_starts()
        running = self.running
        prefill = decodes = 0
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while kv.allocate_slots(req, n) is None:
                preempted = True
                if len(running) - 1 > i:  # the latest request not scheduled in this step
                    self._preempt(running.pop())
                else:
                    running.pop(i)
                    self._preempt(req)
                    req = None
                    break
            if req is None:
                break
            sched.append((req, n))
            budget -= n
            if n == 1 and req.num_output > 0 and req.num_computed_tokens == req.num_tokens - 1:
                decodes += 1
            else:
                prefill += n
            i += 1
        loaded = 0
        if not preempted:
            waiting, shared, bs = self.waiting, self.shared, kv.hash_block_size
            while waiting and budget > 0 and len(running) < self.max_running:
                req = waiting[0]
                hit, num_hit = kv.get_computed_blocks(req)
                ext = 0
                if shared is not None:  # the connector's lookup: the shared tier's blocks after the device hit
                    last = (req.num_tokens - 1) // bs  # the last prompt token is always computed
                    ext = min(shared.match(req.block_hashes, num_hit // bs), max(last - num_hit // bs, 0)) * bs
                n = min(req.num_tokens - num_hit - ext, budget)
                if kv.allocate_slots(req, n, num_hit, hit, num_external_computed_tokens=ext) is None:
                    break  # the pool is full: it stays queued
                waiting.popleft()
                req.num_computed_tokens = num_hit + ext
                loaded += ext
                if req.hit_tokens is None:
                    req.hit_tokens = num_hit
                    req.tier_hit_tokens = ext
                running.append(req)
                sched.append((req, n))
                budget -= n
                prefill += n
        self._sched = sched
        self.prefill_tokens += prefill
        self.loaded_tokens += loaded
        self.steps += 1
        dt = self.a + self.b * prefill + self.c * decodes + self.r * loaded
        self.busy_s += dt
        return dt

    def end_step(self, now: float, finished: list[SimRequest]) -> None:
        """The step's tokens are computed: sample, finish and free."""
        kv = self.kv
        done = []
        for req, n in self._sched:
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk
            if req.first_token_t is None:
                req.first_token_t = now
            req.num_output += 1
            if req.num_output >= req.output_len:
                req.finish_t = now
                done.append(req)
            else:
                req.all_token_ids.append((req.idx * 7919 + req.num_output * 104729) % VOCAB)
                req.block_hashes.extend(self.hasher(req))
        if done:
            ids = {id(r) for r in done}
            self.running = [r for r in self.running if id(r) not in ids]
            for req in done:
                kv.cache_blocks(req, req.num_computed_tokens)
                kv.free(req)
            finished.extend(done)
        self._sched = []

    def load(self) -> ReplicaLoad:
        """Outstanding work as an engine would report it: uncomputed prompt
        tokens (queued and in prefill), requests held."""
        q = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        q += sum(r.num_tokens - r.num_computed_tokens for r in self.running if r.num_computed_tokens < r.num_tokens - 1)
        return ReplicaLoad(queued_prefill_tokens=q, running_requests=len(self.running) + len(self.waiting))


# -- one simulation ----------------------------------------------------------------


def simulate(trace: list[TraceRequest], policy: str, args: argparse.Namespace, identity: CacheIdentity) -> dict:
    big = policy == BIG
    n = 1 if big else args.replicas
    pool = args.blocks_total if big else args.blocks_total // args.replicas
    div = args.length_divisor
    router = Router(identity, RouterConfig(policy="kv" if big else policy, decode_weight=16.0 / div,
                                           load_skip_min_tokens=2048.0 / div, affinity=args.affinity,
                                           load_skip_factor=args.load_skip_factor))
    shared = SharedTier(args.shared_tier_blocks) if args.shared_tier_blocks > 0 else None
    replicas = [Replica(f"replica-{i}", pool, identity, args, speed=args.replicas if big else 1.0, shared=shared)
                for i in range(n)]
    by_name = {r.name: r for r in replicas}
    for r in replicas:
        router.reset_replica(r.name, epoch=1)
    reqs = [SimRequest(tr) for tr in trace]
    keys = [tr.session_key for tr in trace]
    heap: list[tuple[float, int, int, object]] = []  # (time, 0 = step end / 1 = arrival, tie, payload)
    tie = 0
    for req in reqs:
        heap.append((req.arrival, 1, tie, req))
        tie += 1
    heapq.heapify(heap)
    with_hash, without_hash = [], []
    ingest_ns = 0
    batches = 0
    finished: list[SimRequest] = []
    now = 0.0
    events_before = router.index.counters.block_events

    def start(rep: Replica, t: float) -> None:
        nonlocal tie
        rep.busy = True
        heapq.heappush(heap, (t + rep.start_step(), 0, tie, rep))
        tie += 1

    gc.collect()
    gc.disable()  # latency figures without collector pauses (the heap is small)
    try:
        while heap:
            now, kind, _, obj = heapq.heappop(heap)
            if kind == 1:
                req = obj
                assert isinstance(req, SimRequest)
                t0 = time.perf_counter_ns()
                hashes = router.hash_prompt(req.all_token_ids)
                t1 = time.perf_counter_ns()
                d = router.choose(hashes, keys[req.idx], num_tokens=req.num_tokens)
                t2 = time.perf_counter_ns()
                with_hash.append((t2 - t0) / 1e3)
                without_hash.append((t2 - t1) / 1e3)
                router.note_dispatched(d, req.num_tokens, hashes if args.predict else None, key=req.request_id)
                req.predicted_hit = d.device_hit_tokens
                rep = by_name[d.replica]
                rep.add(req)
                if not rep.busy:
                    start(rep, now)
            else:
                rep = obj
                assert isinstance(rep, Replica)
                done_before = len(finished)
                rep.end_step(now, finished)
                events = [e if e.medium == GPU else msgspec.structs.replace(e, medium=GPU)
                          for e in rep.kv.take_events()]
                if shared is not None:  # write-through of the newly cached blocks, then the tier's REMOTE events
                    for e in events:
                        if type(e) is BlockStored:
                            shared.save(rep.name, e.block_hashes)
                    events += shared.take(rep.name)
                publish = [(rep, events)]
                if shared is not None:  # other replicas' saves evicted from the tier: their streams report it
                    publish += [(o, shared.take(o.name)) for o in replicas if o is not rep and o.name in shared.pending]
                for owner, evs in publish:
                    if not evs:
                        continue
                    t0 = time.perf_counter_ns()
                    res = router.ingest(owner.name, owner.seq, KVEventBatch(ts=now, events=evs), epoch=1)
                    ingest_ns += time.perf_counter_ns() - t0
                    assert res.action == "applied", res
                    owner.seq += 1
                    batches += 1
                for req in finished[done_before:]:  # as the fleet client does when a request's stream ends
                    router.note_settled(rep.name, req.request_id)
                router.set_load(rep.name, rep.load())
                if rep.has_work():
                    start(rep, now)
                else:
                    rep.busy = False
    finally:
        gc.enable()
    assert len(finished) == len(reqs), (len(finished), len(reqs))
    block_events = router.index.counters.block_events - events_before
    leaks = {r.name: (r.kv.num_blocks - 1 - r.kv.num_free_blocks, r.kv.num_requests) for r in replicas}
    prompt_tokens = sum(r.num_prompt_tokens for r in reqs)
    output_tokens = sum(r.output_len for r in reqs)
    hit = sum(r.hit_tokens or 0 for r in reqs)
    tier_hit = sum(r.tier_hit_tokens for r in reqs)
    ttft = [r.first_token_t - r.arrival for r in reqs]  # type: ignore[operator]
    makespan = max(r.finish_t for r in reqs) - min(r.arrival for r in reqs)  # type: ignore[type-var]
    pf = [r.prefill_tokens for r in replicas]
    busy = [r.busy_s for r in replicas]
    arrival_span = max(r.arrival for r in reqs) - min(r.arrival for r in reqs)
    out = {
        "replicas": n,
        "pool_blocks_per_replica": pool,
        "prefix_hit_rate": round(hit / prompt_tokens, 4),
        "shared_tier_hit_rate": round(tier_hit / prompt_tokens, 4) if shared is not None else None,
        "hit_rate_with_shared_tier": round((hit + tier_hit) / prompt_tokens, 4) if shared is not None else None,
        "shared_tier": ({"capacity_blocks": shared.capacity, "saved_blocks": shared.saves, "evictions": shared.evictions,
                         "loaded_tokens": sum(r.loaded_tokens for r in replicas)} if shared is not None else None),
        # The device hit the kv policy expected from its index at dispatch (the other policies score no hits).
        "router_predicted_hit_rate": (round(sum(r.predicted_hit for r in reqs) / prompt_tokens, 4)
                                      if policy in ("kv", BIG) else None),
        "ttft_p50_s": round(percentile(ttft, 0.5), 4),
        "ttft_p99_s": round(percentile(ttft, 0.99), 4),
        "ttft_mean_s": round(sum(ttft) / len(ttft), 4),
        "throughput_tokens_per_s": round((prompt_tokens + output_tokens) / makespan, 1),
        "output_tokens_per_s": round(output_tokens / makespan, 1),
        "makespan_s": round(makespan, 3),
        "prefill_tokens_computed": sum(pf),
        "replica_load_prefill_tokens": {"max": max(pf), "mean": round(sum(pf) / n, 1),
                                        "max_over_mean": round(max(pf) / (sum(pf) / n), 3) if sum(pf) else None},
        "replica_load_busy_s": {"max": round(max(busy), 3), "mean": round(sum(busy) / n, 3),
                                "max_over_mean": round(max(busy) / (sum(busy) / n), 3) if sum(busy) else None},
        # The load this policy really put on the fleet: simulated busy time over the arrival span.
        "utilization": round(sum(busy) / n / arrival_span, 3) if arrival_span > 0 else None,
        "requests_per_replica": [r.dispatched for r in replicas],
        "preemptions": sum(r.preemptions for r in replicas),
        "steps": sum(r.steps for r in replicas),
        "leaked_blocks": sum(v[0] for v in leaks.values()),
        "requests_holding_blocks_at_end": sum(v[1] for v in leaks.values()),
        "router_real": {
            "decision_with_hashing_p50_us": round(percentile(with_hash, 0.5), 1),
            "decision_with_hashing_p99_us": round(percentile(with_hash, 0.99), 1),
            "decision_without_hashing_p50_us": round(percentile(without_hash, 0.5), 1),
            "decision_without_hashing_p99_us": round(percentile(without_hash, 0.99), 1),
            "ingest_batches": batches,
            "ingest_block_events": block_events,
            "ingest_block_events_per_s": round(block_events / (ingest_ns / 1e9)) if ingest_ns else None,
        },
        "_ttft": ttft,
    }
    return out


# -- driver ------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--trace", choices=("conversation", "synthetic", "both"), default="both")
    ap.add_argument("--trace-dir", type=Path, default=DEFAULT_TRACE_DIR)
    ap.add_argument("--num-requests", type=int, default=600, help="the first N requests (after --offset)")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--load", type=float, default=0.8, help="offered load, fraction of the fleet's simulated capacity")
    ap.add_argument("--blocks-total", type=int, default=8192, help="KV blocks of all replicas together")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--length-divisor", type=int, default=16,
                    help="lengths / this; a trace block (512 tokens) becomes 512 / divisor tokens")
    ap.add_argument("--token-budget", type=int, default=512, help="tokens computed per step per replica")
    ap.add_argument("--max-running", type=int, default=64, help="requests running at once per replica")
    ap.add_argument("--step-overhead-s", type=float, default=0.004, help="a: simulated seconds per step")
    ap.add_argument("--prefill-token-s", type=float, default=0.0002, help="b: simulated seconds per prefill token")
    ap.add_argument("--decode-req-s", type=float, default=0.0004, help="c: simulated seconds per decoding request")
    ap.add_argument("--shared-tier-blocks", type=int, default=0,
                    help="a shared remote tier (Redis in a real fleet) of this many blocks that every replica "
                         "writes its cached blocks to and reads after its device hit (0: none)")
    ap.add_argument("--remote-token-s", type=float, default=0.000025,
                    help="r: simulated seconds to load one token's KV from the shared tier (in the step: a + b * "
                         "prefill + c * decodes + r * loaded; default b / 8)")
    ap.add_argument("--session-key", choices=("first-unshared", "first"), default="first-unshared",
                    help="the session policy's key: the first hash id that is not a fleet-wide shared prefix "
                         "(default), or the first hash id (in the conversation trace: 0 for every request)")
    ap.add_argument("--hash-algo", default="sha256")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--predict", type=int, default=1, choices=(0, 1),
                    help="credit a replica with a prompt's blocks when the request is sent there (note_dispatched hashes; default 1)")
    ap.add_argument("--load-skip-factor", type=float, default=4.0,
                    help="RouterConfig.load_skip_factor (default 4.0, the router's)")
    ap.add_argument("--affinity", type=float, default=RouterConfig().affinity,
                    help="RouterConfig.affinity of the kv policy (default: the router's default)")
    ap.add_argument("--plot", type=Path, default=None, metavar="DIR",
                    help="write bench_trace_router.json and bench_trace_router.png there")
    ap.add_argument("--sweep-loads", default="", metavar="L1,L2,...",
                    help="also replay round-robin, kv and the single big cache at each of these offered loads "
                         "and report TTFT p50 / p99, their kv / round-robin ratios and each policy's utilization "
                         "(\"load_sweep\")")
    args = ap.parse_args(argv)
    try:
        args.sweep_loads = [float(x) for x in args.sweep_loads.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--sweep-loads must be comma-separated numbers, got {args.sweep_loads!r}")
    if any(x <= 0 for x in args.sweep_loads) or args.load <= 0:
        ap.error("loads must be > 0")
    if TRACE_BLOCK % args.length_divisor:
        ap.error("--length-divisor must divide 512")
    if args.replicas < 1 or args.blocks_total // args.replicas < 2:
        ap.error("need at least one replica and 2 blocks per replica")
    return args


def plot(results: dict, ttfts: dict, out_dir: Path) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not importable: no plot"
    traces = list(ttfts)
    fig, axes = plt.subplots(2, len(traces), figsize=(6 * len(traces), 8), squeeze=False)
    for j, tr in enumerate(traces):
        ax = axes[0][j]
        for pol, xs in ttfts[tr].items():
            s = sorted(xs)
            ax.plot(s, [(i + 1) / len(s) for i in range(len(s))], label=pol)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (simulated s)")
        ax.set_ylabel("CDF")
        ax.set_title(f"{tr}: TTFT CDF")
        ax.legend()
        ax = axes[1][j]
        pols = list(results["traces"][tr]["policies"])
        rates = [results["traces"][tr]["policies"][p]["prefix_hit_rate"] for p in pols]
        ax.bar(pols, rates, color=["C0", "C1", "C2", "C3"][: len(pols)])
        ax.set_ylabel("device prefix hit rate")
        ax.set_title(f"{tr}: hit rate ({results['config']['replicas']} replicas)")
    fig.tight_layout()
    png = out_dir / "bench_trace_router.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return str(png)


def load_sweep(rows: list[dict], args: argparse.Namespace, identity: CacheIdentity, max_tokens: int) -> list[dict]:
    """TTFT of round-robin, kv and the single big cache at each of ``--sweep-loads``."""
    out = []
    for load in args.sweep_loads:
        trace, _ = build_workload(rows, argparse.Namespace(**{**vars(args), "load": load}), max_tokens)
        res = {p: simulate(trace, p, args, identity) for p in ("round-robin", "kv", BIG)}
        row: dict = {"offered_load": load}
        for p, r in res.items():
            row[p] = {"ttft_p50_s": r["ttft_p50_s"], "ttft_p99_s": r["ttft_p99_s"], "utilization": r["utilization"],
                      "prefix_hit_rate": r["prefix_hit_rate"]}
        rr, kv, big = res["round-robin"], res["kv"], res[BIG]
        row["kv_over_round_robin"] = {"ttft_p50": round(kv["ttft_p50_s"] / rr["ttft_p50_s"], 3),
                                      "ttft_p99": round(kv["ttft_p99_s"] / rr["ttft_p99_s"], 3)}
        row["big_over_round_robin"] = {"ttft_p50": round(big["ttft_p50_s"] / rr["ttft_p50_s"], 3),
                                       "ttft_p99": round(big["ttft_p99_s"] / rr["ttft_p99_s"], 3)}
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    wall0 = time.perf_counter()
    identity = CacheIdentity(model_fingerprint="bench-trace-router", kv_dtype="bfloat16", kv_layout="per_layer",
                             block_size=args.block_size, hash_algo=args.hash_algo)
    max_tokens = (args.blocks_total // args.replicas) * args.block_size - args.block_size
    names = ["conversation", "synthetic"] if args.trace == "both" else [args.trace]
    results: dict = {
        "timing": ("simulated: per-step compute time from the linear cost model step_s = a + b * prefill_tokens + "
                   "c * decode_requests; the KV cache managers, their events, the router's hashing, index and "
                   "decisions are real code (router_real figures are wall-clock on this machine)"),
        "config": {k.replace("_", "-"): (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "baseline": (f"{BIG}: one replica with all {args.blocks_total} blocks, the same token budget, "
                     f"{args.replicas}x faster cost model; routed by nothing"),
        "traces": {},
    }
    ttfts: dict[str, dict[str, list[float]]] = {}
    for name in names:
        rows = load_trace(args.trace_dir / TRACES[name], args.offset, args.num_requests)
        trace, info = build_workload(rows, args, max_tokens)
        pol_out: dict[str, dict] = {}
        ttfts[name] = {}
        for policy in (*POLICIES, BIG):
            r = simulate(trace, policy, args, identity)
            ttfts[name][policy] = r.pop("_ttft")
            pol_out[policy] = r
        ref = pol_out[BIG]["prefix_hit_rate"]
        for policy in POLICIES:
            pol_out[policy]["hit_rate_vs_single_big_cache"] = (
                round(pol_out[policy]["prefix_hit_rate"] / ref, 3) if ref else None)
        results["traces"][name] = {"workload": info, "policies": pol_out}
        if args.sweep_loads:
            results["traces"][name]["load_sweep"] = load_sweep(rows, args, identity, max_tokens)
    results["wall_s"] = round(time.perf_counter() - wall0, 1)
    if args.plot is not None:
        args.plot.mkdir(parents=True, exist_ok=True)
        results["plot"] = plot(results, ttfts, args.plot)
        (args.plot / "bench_trace_router.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
