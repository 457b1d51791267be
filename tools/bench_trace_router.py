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
offered load is each of ``--loads`` of its simulated capacity, where a
request's work is ``b * prompt_tokens + c * output_tokens + a *
prefill_steps`` (no cache hits assumed; decode steps' overhead, shared by a
batch, is not counted). Every policy replays the same arrival times at each
load. ``utilization``: a policy's simulated busy time over the arrival span
(the load it really put on the fleet, which the offered load, counted
without cache hits, overstates).

Shared tier (``--shared-tier-blocks N``): the fleet's shared remote tier
(Redis / Redis Cluster in a real fleet) as an LRU of N blocks. Every block a
replica caches is written to it (shared tiers get every saved chunk); a
request admitted on any replica loads the tier's blocks that follow its
device hit, as the connector would (at ``--remote-token-s`` simulated seconds
a token, in that step); the saving replica's event stream reports the tier's
``REMOTE`` stores and evictions, which the router counts for every replica.
``hit_rate_with_shared_tier`` is device plus tier hits.

Policies: ``round-robin``, ``least-loaded`` (kv with no hit credit),
``session``, ``kv`` (the router's four), and the ideal baseline
``single-big-cache``: ONE pool of all N pools' blocks and one waiting queue,
served by N lanes (step loops), each with a replica's token budget and cost
model: the fleet's compute with perfect sharing and one queue (not one
replica N times faster, which made each request's own prefill N times
shorter); its hit rate and wait are the references for kv's.

Per policy and load: TTFT, **wait** = TTFT less the request's own prefill
(``own_prefill_s``: alone on an idle replica with nothing cached, ``a *
ceil(prompt / budget) + b * prompt``) and **slowdown** = TTFT / own prefill,
p50 / p99; **balance**: the worst ``--balance-window-s`` window (of the
trace's clock, scaled as the arrivals) of max / mean prefill tokens
dispatched per replica (prompt less its hits at admission;
``kvstrata.router.load.worst_window_balance``); and the issue 24 §1 goals
(``kvstrata.router.load.routing_goals``), with ``goals_missed`` listing
the misses.

The defaults are the named configuration (``NAMED``, printed as
``configuration.name``): its figures reproduce from the bare command.

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

    python tools/bench_trace_router.py [--replicas 4 --trace both --loads 0.8,1.0 --plot /tmp/out ...]
    python tools/bench_trace_router.py --trace synthetic --shared-tier-blocks 131072
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
from kvstrata.router.load import percentile, routing_goals, wait_summary, worst_window_balance

TRACE_BLOCK = 512  # tokens per trace hash id
VOCAB = 32_000
TRACES = {"conversation": "mooncake_conversation_trace.jsonl", "synthetic": "mooncake_synthetic_trace.jsonl"}
DEFAULT_TRACE_DIR = Path(__file__).resolve().parents[2] / "shared" / "traces"
POLICIES = ("round-robin", "least-loaded", "session", "kv")
BIG = "single-big-cache"
NAMED = "route-goals-1"  # the defaults: the configuration the issue 24 §1 goals are checked in


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


def build_workload(rows: list[dict], args: argparse.Namespace, max_tokens: int,
                   load: float) -> tuple[list[TraceRequest], dict]:
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
    span = work / (args.replicas * load)
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
        "balance_window_simulated_s": round(args.balance_window_s * 1000 * scale, 3),
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
                 "predicted_hit", "tier_hit_tokens", "replica")

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
        self.replica = ""

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


class Lane:
    """One step loop of a replica: its running list, the step in flight."""

    __slots__ = ("running", "sched", "busy")

    def __init__(self) -> None:
        self.running: list[SimRequest] = []
        self.sched: list[tuple[SimRequest, int]] = []
        self.busy = False


class Replica:
    """A real KVCacheManager with simple continuous-batching step loops and
    a linear cost model. A fleet replica has one lane; the single big cache
    has one lane per fleet replica over one pool and one waiting queue (the
    fleet's compute, each lane as fast as a replica; a lane sees blocks
    another lane allocated in its step in flight as cached: an ideal).
    Owns its waiting queue and its lanes."""

    def __init__(self, name: str, num_blocks: int, identity: CacheIdentity, args: argparse.Namespace,
                 lanes: int = 1, shared: SharedTier | None = None) -> None:
        bs = identity.block_size
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=8, head_size=128, dtype="bfloat16")
        self.kv = KVCacheManager(
            KVCacheConfig(num_blocks=num_blocks + 1, groups=[KVCacheGroupSpec(layer_names=["l0"], spec=spec)]),
            max_model_len=num_blocks * bs, enable_caching=True, log_stats=True, enable_events=True,
            metrics_sample_rate=0.0, hash_block_size=bs)
        self.hasher = make_block_hasher(identity)
        self.name = name
        self.a, self.b, self.c = args.step_overhead_s, args.prefill_token_s, args.decode_req_s
        self.r = args.remote_token_s
        self.shared = shared
        self.loaded_tokens = 0
        self.budget = args.token_budget
        self.max_running = args.max_running
        self.waiting: deque[SimRequest] = deque()
        self.lanes = [Lane() for _ in range(lanes)]
        self.seq = 0
        self.busy_s = 0.0
        self.prefill_tokens = 0
        self.preemptions = 0
        self.steps = 0
        self.dispatched = 0

    def add(self, req: SimRequest) -> None:
        req.block_hashes.extend(self.hasher(req))  # as the engine does when a request arrives
        self.dispatched += 1
        self.waiting.append(req)

    def idle_lanes_to_start(self) -> list[Lane]:
        """Idle lanes that have work: their own running requests, or the queue."""
        return [lane for lane in self.lanes if not lane.busy and (lane.running or self.waiting)]

    def _preempt(self, req: SimRequest) -> None:
        self.kv.cache_blocks(req, req.num_computed_tokens)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def start_step(self, lane: Lane) -> float | None:
        """Schedule one step of ``lane`` (allocations happen now); returns its
        simulated duration, or None when it schedules nothing while another
        lane runs (it waits for that lane to free blocks)."""
        kv, budget, sched = self.kv, self.budget, []
        kv.new_step_starts()
        running = lane.running
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
        if not sched and any(other.busy for other in self.lanes if other is not lane):
            return None
        lane.sched = sched
        lane.busy = True
        self.prefill_tokens += prefill
        self.loaded_tokens += loaded
        self.steps += 1
        dt = self.a + self.b * prefill + self.c * decodes + self.r * loaded
        self.busy_s += dt
        return dt

    def end_step(self, lane: Lane, now: float, finished: list[SimRequest]) -> None:
        """The lane's step's tokens are computed: sample, finish and free."""
        kv = self.kv
        done = []
        for req, n in lane.sched:
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
            lane.running = [r for r in lane.running if id(r) not in ids]
            for req in done:
                kv.cache_blocks(req, req.num_computed_tokens)
                kv.free(req)
            finished.extend(done)
        lane.sched = []
        lane.busy = False

    def load(self) -> ReplicaLoad:
        """Outstanding work as an engine would report it: uncomputed prompt
        tokens (queued and in prefill), requests held."""
        q = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        running = [r for lane in self.lanes for r in lane.running]
        q += sum(r.num_tokens - r.num_computed_tokens for r in running if r.num_computed_tokens < r.num_tokens - 1)
        return ReplicaLoad(queued_prefill_tokens=q, running_requests=len(running) + len(self.waiting))


def own_prefill_s(prompt_tokens: int, args: argparse.Namespace) -> float:
    """A request's TTFT alone on an idle replica with nothing cached, as the
    cost model times it: its prompt in ``--token-budget`` chunks, one step each."""
    return args.step_overhead_s * math.ceil(prompt_tokens / args.token_budget) + args.prefill_token_s * prompt_tokens


# -- one simulation ----------------------------------------------------------------


def simulate(trace: list[TraceRequest], policy: str, args: argparse.Namespace, identity: CacheIdentity,
             window_s: float | None = None) -> dict:
    """Replay ``trace`` under ``policy``; ``window_s``: the balance window in
    simulated seconds (default: the whole run)."""
    big = policy == BIG
    n = 1 if big else args.replicas
    pool = args.blocks_total if big else args.blocks_total // args.replicas
    div = args.length_divisor
    router = Router(identity, RouterConfig(policy="kv" if big else policy, decode_weight=16.0 / div,
                                           load_skip_min_tokens=2048.0 / div, affinity=args.affinity,
                                           load_skip_factor=args.load_skip_factor))
    shared = SharedTier(args.shared_tier_blocks) if args.shared_tier_blocks > 0 else None
    replicas = [Replica(f"replica-{i}", pool, identity, args, lanes=args.replicas if big else 1, shared=shared)
                for i in range(n)]
    by_name = {r.name: r for r in replicas}
    for r in replicas:
        router.reset_replica(r.name, epoch=1)
    reqs = [SimRequest(tr) for tr in trace]
    keys = [tr.session_key for tr in trace]
    heap: list[tuple[float, int, int, object]] = []  # (time, 0 = step end / 1 = arrival, tie, payload)
    # payload: the request arriving, or the (replica, lane) whose step ends
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
        for lane in rep.idle_lanes_to_start():
            dt = rep.start_step(lane)
            if dt is not None:
                heapq.heappush(heap, (t + dt, 0, tie, (rep, lane)))
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
                req.replica = d.replica
                rep = by_name[d.replica]
                rep.add(req)
                start(rep, now)
            else:
                rep, lane = obj  # type: ignore[misc]
                done_before = len(finished)
                rep.end_step(lane, now, finished)
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
                start(rep, now)
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
        # TTFT less the request's own prefill alone on an idle replica (the cost model): the routing's share.
        **wait_summary(ttft, [own_prefill_s(r.num_prompt_tokens, args) for r in reqs]),
        # Prefill tokens each dispatch put on its replica (prompt less its hits), over sliding windows.
        "balance": (worst_window_balance(
            [(r.arrival, r.replica, r.num_prompt_tokens - (r.hit_tokens or 0) - r.tier_hit_tokens) for r in reqs],
            [r.name for r in replicas], window_s if window_s is not None else math.inf) if not big else None),
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
    ap.add_argument("--loads", default="0.8,1.0", metavar="L1,L2,...",
                    help="offered loads, fractions of the fleet's simulated capacity: every policy is replayed "
                         "at each, and the goals are checked at each")
    ap.add_argument("--balance-window-s", type=float, default=30.0,
                    help="balance window, in seconds of the trace's own clock (scaled as the arrivals are)")
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
    args = ap.parse_args(argv)
    try:
        args.loads = [float(x) for x in args.loads.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--loads must be comma-separated numbers, got {args.loads!r}")
    if not args.loads or any(x <= 0 for x in args.loads) or args.balance_window_s <= 0:
        ap.error("--loads must name at least one load, every load and --balance-window-s > 0")
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
        first = results["traces"][tr]["loads"][0]["policies"]
        pols = list(first)
        rates = [first[p]["prefix_hit_rate"] for p in pols]
        ax.bar(pols, rates, color=[f"C{i}" for i in range(len(pols))])
        ax.set_ylabel("device prefix hit rate")
        ax.set_title(f"{tr}: hit rate ({results['configuration']['replicas']} replicas)")
    fig.tight_layout()
    png = out_dir / "bench_trace_router.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return str(png)


def configuration(args: argparse.Namespace) -> dict:
    """The run's settings, named: NAMED when they are the defaults (every
    figure of the named configuration reproduces from ``python
    tools/bench_trace_router.py``), else the settings that differ."""
    cfg = {k.replace("_", "-"): (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    default = {k.replace("_", "-"): (str(v) if isinstance(v, Path) else v) for k, v in vars(parse_args([])).items()}
    diff = sorted(k for k in cfg if k != "plot" and cfg[k] != default[k])
    return {"name": NAMED if not diff else f"custom: {NAMED} but {', '.join(diff)}", **cfg}


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
        "command": "python tools/bench_trace_router.py" + "".join(f" {a}" for a in (argv or [])),
        "configuration": configuration(args),
        "baseline": (f"{BIG}: one replica with all {args.blocks_total} blocks and {args.replicas} lanes (step "
                     f"loops) over them and one waiting queue, each lane a replica's token budget and cost model: "
                     f"the fleet's compute, one pool, one queue; routed by nothing"),
        "wait": ("wait = TTFT - own prefill, own prefill = a * ceil(prompt / token_budget) + b * prompt: the "
                 "request alone on an idle replica with nothing cached; slowdown = TTFT / own prefill"),
        "balance": (f"max / mean over replicas of the prefill tokens dispatched (prompt less its hits at "
                    f"admission), worst over every {args.balance_window_s:g} s window of the trace's clock"),
        "traces": {},
    }
    ttfts: dict[str, dict[str, list[float]]] = {}
    for name in names:
        rows = load_trace(args.trace_dir / TRACES[name], args.offset, args.num_requests)
        per_load = []
        for load in args.loads:
            trace, info = build_workload(rows, args, max_tokens, load)
            pol_out: dict[str, dict] = {}
            for policy in (*POLICIES, BIG):
                r = simulate(trace, policy, args, identity, info["balance_window_simulated_s"])
                ttft = r.pop("_ttft")
                if load == args.loads[0]:
                    ttfts.setdefault(name, {})[policy] = ttft
                pol_out[policy] = r
            ref = pol_out[BIG]["prefix_hit_rate"]
            for policy in POLICIES:
                pol_out[policy]["hit_rate_vs_single_big_cache"] = (
                    round(pol_out[policy]["prefix_hit_rate"] / ref, 3) if ref else None)
            per_load.append({"offered_load": load, "workload": info, "policies": pol_out, "goals": routing_goals(
                pol_out["kv"], pol_out["round-robin"], pol_out["least-loaded"], pol_out[BIG])})
        results["traces"][name] = {"loads": per_load}
    misses = [f"{name} load {row['offered_load']}: {goal}" for name, tr in results["traces"].items()
              for row in tr["loads"] for goal, g in row["goals"].items() if isinstance(g, dict) and not g["met"]]
    results["goals_missed"] = misses
    results["summary"] = summary(results)
    results["wall_s"] = round(time.perf_counter() - wall0, 1)
    if args.plot is not None:
        args.plot.mkdir(parents=True, exist_ok=True)
        results["plot"] = plot(results, ttfts, args.plot)
        (args.plot / "bench_trace_router.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return results


def summary(results: dict) -> list[dict]:
    """One row per trace, load and policy: the figures the goals read."""
    rows = []
    for name, tr in results["traces"].items():
        for row in tr["loads"]:
            for pol, r in row["policies"].items():
                rows.append({"trace": name, "load": row["offered_load"], "policy": pol,
                             "ttft_p50_s": r["ttft_p50_s"], "ttft_p99_s": r["ttft_p99_s"],
                             "wait_p50_s": r["wait_p50_s"], "wait_p99_s": r["wait_p99_s"],
                             "slowdown_p50": r["slowdown_p50"], "slowdown_p99": r["slowdown_p99"],
                             "hit": r["prefix_hit_rate"],
                             "balance": r["balance"]["max_over_mean"] if r["balance"] else None})
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
