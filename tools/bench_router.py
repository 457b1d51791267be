"""Benchmark of the KV-cache-aware router's core (kvstrata.router): decision
latency for long prompts and KV event ingest rate. Prints JSON.

Setup (fixed seed): ``--replicas`` replicas; ``--prompts`` prompts of
``--prompt-tokens`` tokens that share one of ``--families`` system prompts
(a quarter of the prompt) and differ after it. Each prompt's chain is
stored, as engines would publish it (``BlockStored`` batches of
``--event-blocks`` hashes), on the device of one replica for a random
prefix, on its CPU tier a little further, on a second replica's disk, and a
tenth of them on the shared REMOTE tier; some device blocks are then evicted
(``BlockRemoved``). That fill is the ingest figure (block events per second,
one core).

Decisions: requests re-send a stored prompt's first part with a new tail
(as fresh int objects, the way a tokenizer hands a prompt to the router);
between two decisions one more event batch is ingested, so the index keeps
changing. Figures: p50 / p99 of ``Router.choose`` on precomputed hashes,
and of ``hash_prompt`` + ``choose``; the baseline, measured in the same run
on the same requests and index states (a second pass replaying the same
batches), walks a per-(replica, medium) set of hashes in Python block by
block (the obvious implementation) and scores the same cost (idle replicas:
uncached tokens minus ``affinity`` x cached ones); ``same_cost_as_baseline`` is the fraction of
requests where both find the same least cost (their picks may differ
among tied replicas: the router breaks ties by the prefix's hash).

Hashing per request (``hashing``), on a fresh router of the same size, two
kinds of traffic: ``multi_turn`` (``--sessions`` conversations, each turn
the previous prompt plus ``--turn-tokens`` new tokens, up to
``--prompt-tokens``; the session key is the OpenAI ``user``) and ``cold``
(new prompts, no shared prefix). Each request: ``Router.chain`` +
``Router.choose`` on the chain (``decision_with_lazy_hashing``: the whole
decision), then ``chain.finish()`` after it (``finish_after_decision``),
then ``choose`` again on the finished hashes. ``hashing_before_decision``:
the hashing the decision waited for, timed directly: ``chain.start()``
(packing the prompt, comparing it with the remembered one, taking the
reused prefix) plus hashing again the blocks the lazy walk hashed;
``total`` adds the finish. ``lazy_minus_given_decision`` (the previous
figure for it) is the first decision less the last: it also counts the
index walk's cache misses, which the first walk over a prompt's ~500
entries pays and the second, right after, does not. The dispatched prompt's blocks are then stored
on the chosen replica, as its engine would report them.

    python tools/bench_router.py [--replicas 8 --prompt-tokens 8192 ...]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shlex
import sys
import time
from array import array

from kvstrata.kv.events import BlockRemoved, BlockStored, KVEventBatch
from kvstrata.kv.hashing import CacheIdentity
from kvstrata.router import CPU, DISK, GPU, MEDIA, REMOTE, Router, RouterConfig
from kvstrata.router.load import percentile


def chunks(hashes: list[bytes], n: int) -> list[list[bytes]]:
    return [hashes[i: i + n] for i in range(0, len(hashes), n)]


class NaiveIndex:
    """The baseline: a set of hashes per replica and medium, walked in Python."""

    def __init__(self, replicas: list[str]) -> None:
        self.sets = {r: {m: set() for m in MEDIA} for r in replicas}

    def apply(self, replica: str, batch: KVEventBatch) -> None:
        for e in batch.events:
            s = self.sets[replica][e.medium]
            if isinstance(e, BlockStored):
                s.update(e.block_hashes)
            else:
                s.difference_update(e.block_hashes)

    def choose(self, router: Router, hashes: list[bytes], num_tokens: int) -> tuple[str, float]:
        """The kv policy's choice and its cost (idle replicas), from the sets."""
        weights = [router.config.medium_weights[m] for m in MEDIA]
        shared = set().union(*(s[REMOTE] for s in self.sets.values()))
        best, best_cost = None, None
        for r, media in self.sets.items():
            saved, level = 0.0, 0
            for h in hashes:  # the medium of each block, no better than the block before (the engine's order)
                while level < 4 and not any(h in media[m] for m in MEDIA[: level + 1]) and not (
                        level == 3 and h in shared):
                    level += 1
                if level == 4:
                    break
                saved += weights[level]
            s = saved * router.block_size
            cost = max(num_tokens - s, 0) - router.config.affinity * s  # idle replicas: no load term
            if best_cost is None or cost < best_cost:
                best, best_cost = r, cost
        return best, best_cost  # type: ignore[return-value]


def fresh_router(args: argparse.Namespace) -> tuple[Router, list[str]]:
    """A router over ``args.replicas`` empty replicas (epoch 1), and their names."""
    identity = CacheIdentity(model_fingerprint="bench-model", kv_dtype="bfloat16", kv_layout="per_layer",
                             block_size=args.block_size, hash_algo=args.hash_algo)
    router = Router(identity, RouterConfig(max_replicas=args.max_replicas))
    replicas = [f"engine-{i}" for i in range(args.replicas)]
    for r in replicas:
        router.reset_replica(r, epoch=1)
    return router, replicas


def build(args: argparse.Namespace, rng: random.Random):
    router, replicas = fresh_router(args)
    naive = NaiveIndex(replicas)
    families = [[rng.randrange(32_000) for _ in range(args.prompt_tokens // 4)] for _ in range(args.families)]
    prompts, plans = [], []
    n_blocks = args.prompt_tokens // args.block_size
    for i in range(args.prompts):
        tokens = families[i % args.families] + [rng.randrange(32_000) for _ in range(args.prompt_tokens * 3 // 4)]
        hashes = router.hash_prompt(tokens)
        prompts.append((tokens, hashes))
        home, other = rng.sample(replicas, 2)
        dev = rng.randrange(n_blocks // 4, n_blocks + 1)
        cpu = min(n_blocks, dev + rng.randrange(0, n_blocks // 4))
        plans.append((home, BlockStored(block_hashes=hashes[:dev], parent_block_hash=None, token_ids=[],
                                        block_size=args.block_size, medium=GPU)))
        plans.append((home, BlockStored(block_hashes=hashes[:cpu], parent_block_hash=None, token_ids=[],
                                        block_size=args.block_size, medium=CPU)))
        plans.append((other, BlockStored(block_hashes=hashes[: n_blocks // 2], parent_block_hash=None,
                                         token_ids=[], block_size=args.block_size, medium=DISK)))
        if rng.random() < 0.1:
            plans.append((other, BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                                             block_size=args.block_size, medium=REMOTE)))
        if rng.random() < 0.3:  # the tail of the device copy evicted
            plans.append((home, BlockRemoved(block_hashes=hashes[dev * 3 // 4: dev], medium=GPU)))
    # As engines publish: one batch per step, a few blocks per event.
    batches: list[tuple[str, KVEventBatch]] = []
    for replica, ev in plans:
        for part in chunks(ev.block_hashes, args.event_blocks):
            e = (BlockStored(block_hashes=part, parent_block_hash=None, token_ids=[], block_size=args.block_size,
                             medium=ev.medium) if isinstance(ev, BlockStored)
                 else BlockRemoved(block_hashes=part, medium=ev.medium))
            batches.append((replica, KVEventBatch(ts=0.0, events=[e])))
    return router, naive, replicas, prompts, batches


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--hash-algo", default="sha256")
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--families", type=int, default=16)
    ap.add_argument("--event-blocks", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-replicas", type=int, default=RouterConfig().max_replicas,
                    help="RouterConfig.max_replicas (the lane width)")
    ap.add_argument("--sessions", type=int, default=32, help="multi-turn: conversations interleaved")
    ap.add_argument("--turn-tokens", type=int, default=256, help="multi-turn: tokens each turn adds")
    ap.add_argument("--hash-requests", type=int, default=600, help="requests of each kind of hashing traffic")
    args = ap.parse_args(argv)
    command = shlex.join(["python", "tools/bench_router.py", *(sys.argv[1:] if argv is None else argv)])
    rng = random.Random(args.seed)
    router, naive, replicas, prompts, batches = build(args, rng)

    fill, live = batches[: len(batches) * 9 // 10], batches[len(batches) * 9 // 10:]
    seq = dict.fromkeys(replicas, 0)
    gc.collect()
    t0 = time.perf_counter()
    for replica, b in fill:
        router.ingest(replica, seq[replica], b)
        seq[replica] += 1
    ingest_s = time.perf_counter() - t0
    block_events = router.index.counters.block_events
    t0 = time.perf_counter()
    for replica, b in fill:
        naive.apply(replica, b)
    naive_ingest_s = time.perf_counter() - t0

    # Two passes over the same requests and the same ingest sequence (one
    # more batch before each request, so the index keeps changing): the
    # router's, timed on its own, then the baseline's. Interleaved, the
    # baseline's milliseconds of set walking between two decisions left the
    # router's decisions running on cold caches.
    requests = [(rng.randrange(len(prompts)), rng.random(), rng.getrandbits(32)) for _ in range(args.requests)]

    def request_tokens(i: int) -> list[int]:
        which, frac, seed = requests[i]
        tokens = prompts[which][0]
        keep = len(tokens) // 4 + int(frac * (len(tokens) - len(tokens) // 4 + 1))
        tail = random.Random(seed)
        # Fresh int objects, as a tokenizer hands a prompt to the router.
        return array("I", tokens[:keep] + [tail.randrange(32_000) for _ in range(len(tokens) - keep)]).tolist()

    def next_batch(i: int, apply) -> None:
        if i < len(live):
            replica, b = live[i]
            apply(replica, b)

    def router_apply(replica: str, b: KVEventBatch) -> None:
        router.ingest(replica, seq[replica], b)
        seq[replica] += 1

    with_hash, without, baseline, costs, all_hashes, agree = [], [], [], [], [], 0
    for i in range(args.requests):
        next_batch(i, router_apply)
        tokens = request_tokens(i)
        t0 = time.perf_counter_ns()
        hashes = router.hash_prompt(tokens)
        d = router.choose(hashes, num_tokens=len(tokens))
        t1 = time.perf_counter_ns()
        router.choose(hashes, num_tokens=len(tokens))
        t2 = time.perf_counter_ns()
        with_hash.append((t1 - t0) / 1e3)
        without.append((t2 - t1) / 1e3)
        costs.append((d.cost, len(tokens)))
        all_hashes.append(hashes)
    for i in range(args.requests):
        next_batch(i, naive.apply)
        cost, n = costs[i]
        t0 = time.perf_counter_ns()
        _pick, naive_cost = naive.choose(router, all_hashes[i], n)
        baseline.append((time.perf_counter_ns() - t0) / 1e3)
        agree += abs(naive_cost - cost) <= 1e-6 * n  # float sums in another order

    def stats(xs: list[float]) -> dict[str, float]:
        return {"p50_us": round(percentile(xs, 0.5), 1), "p99_us": round(percentile(xs, 0.99), 1)}

    out = {
        "command": command,
        "config": {k.replace("_", "-"): v for k, v in vars(args).items()},
        "index_hashes": len(router.index),
        "ingest": {"block_events": block_events, "seconds": round(ingest_s, 3),
                   "block_events_per_s": round(block_events / ingest_s),
                   "baseline_block_events_per_s": round(block_events / naive_ingest_s)},
        "decision_with_hashing": stats(with_hash),
        "decision_without_hashing": stats(without),
        "baseline_decision_without_hashing": stats(baseline),
        "same_cost_as_baseline": round(agree / args.requests, 4),
        "hashing": {kind: hashing_traffic(args, kind, stats) for kind in ("multi_turn", "cold")},
    }
    print(json.dumps(out, indent=2))
    return out


def hash_again(router: Router, tokens: list[int], hashes: list, start: int, count: int) -> int:
    """ns to hash blocks ``start .. start + count`` of ``tokens`` again, as
    the lazy walk did (checked against ``hashes``)."""
    fn, bs = router.hasher.hash_fn, router.block_size
    t0 = time.perf_counter_ns()
    for i in range(start, start + count):
        h = fn.hash_block(hashes[i - 1] if i else router.hasher.root, tokens[i * bs: (i + 1) * bs])
    t1 = time.perf_counter_ns()
    assert not count or h == hashes[start + count - 1]
    return t1 - t0


def hashing_traffic(args: argparse.Namespace, kind: str, stats) -> dict:
    """Per request: the decision with lazy hashing, the finish after it, and
    the hashing before the decision (see the module's docstring)."""
    rng = random.Random(args.seed + (1 if kind == "cold" else 2))
    router, replicas = fresh_router(args)
    seq = dict.fromkeys(replicas, 0)
    n, turn = args.prompt_tokens, args.turn_tokens
    turns = max(n // (4 * turn), 1)  # each conversation: its last `turns` turns, up to n tokens
    convs = [[rng.randrange(32_000) for _ in range(n - turns * turn)] for _ in range(args.sessions)]
    step = [0] * args.sessions
    decide, finish, before, minus, total, reused = [], [], [], [], [], 0
    for i in range(args.hash_requests):
        if kind == "cold":
            session, tokens = None, [rng.randrange(32_000) for _ in range(n)]
        else:
            c = i % args.sessions
            if step[c] == turns:  # the conversation is over: a new one in its place
                convs[c], step[c] = [rng.randrange(32_000) for _ in range(n - turns * turn)], 0
            convs[c] = convs[c] + [rng.randrange(32_000) for _ in range(turn)]
            step[c] += 1
            session, tokens = f"user-{c}", convs[c]
        tokens = array("I", tokens).tolist()  # fresh int objects, as a tokenizer hands them over
        gc_was = gc.isenabled()
        gc.disable()
        t0 = time.perf_counter_ns()
        chain = router.chain(tokens, session=session)
        chain.start()  # the LRU lookup: packing, comparing, the reused prefix (choose would do it first)
        ts = time.perf_counter_ns()
        started = len(chain.known)
        d = router.choose(chain, num_tokens=len(tokens))
        t1 = time.perf_counter_ns()
        lazy = chain.known[started:]  # the blocks the walk hashed
        hashes = chain.finish()
        t2 = time.perf_counter_ns()
        router.choose(hashes, num_tokens=len(tokens))
        t3 = time.perf_counter_ns()
        tail = hash_again(router, tokens, hashes, started, len(lazy))
        if gc_was:
            gc.enable()
        decide.append((t1 - t0) / 1e3)
        finish.append((t2 - t1) / 1e3)
        before.append((ts - t0 + tail) / 1e3)
        minus.append(max(t1 - t0 - (t3 - t2), 0) / 1e3)
        total.append((ts - t0 + tail + t2 - t1) / 1e3)
        reused += chain.reused_blocks
        ev = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=args.block_size,
                         medium=GPU)
        router.ingest(d.replica, seq[d.replica], KVEventBatch(ts=0.0, events=[ev]))
        seq[d.replica] += 1
        # Drop this request's prompt here: left for the next `chain = ...`, freeing its ~8k int
        # objects (~40 us) would be timed as the next decision's hashing.
        chain = hashes = ev = tokens = None  # type: ignore[assignment]
    blocks = args.hash_requests * (n // args.block_size)
    return {"decision_with_lazy_hashing": stats(decide), "hashing_before_decision": stats(before),
            "lazy_minus_given_decision": stats(minus),
            "finish_after_decision": stats(finish), "hashing_total": stats(total),
            "reused_block_fraction": round(reused / blocks, 3), "requests": args.hash_requests}


if __name__ == "__main__":
    main()
