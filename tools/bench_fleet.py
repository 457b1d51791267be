"""Real engines behind the fleet router: kv routing against round-robin, and
one engine with the whole cache. Prints JSON; nothing is simulated.

Each policy gets fresh engine subprocesses of the default model (seeded
random Llama, 23 M parameters; ``--replicas`` engines of ``--threads``
torch threads, each with ``--blocks-per-replica`` KV blocks) behind a
``FleetClient`` in this process, and the same multi-turn chat workload
(``kvstrata.bench.workloads.multi_turn``: every turn re-sends the whole
conversation, so a turn hits the prefix cache only where its conversation's
previous turn ran) driven closed-loop at ``--concurrency`` by the load
tester (``kvstrata.bench``). The conversations' KV does not fit in one
replica's cache but fits in all of them together.

    round-robin   FleetClient, policy round-robin
    kv            FleetClient, policy kv (the default)
    one-engine    one engine with every replica's blocks and threads
                  together (the single-big-cache reference), no router

Reported per policy: device prefix hit rate (cached / prompt tokens, from
the requests), TTFT p50 / p99, request and token throughput, wall time,
requests per replica, the router's decision latency (hashing included);
and kv's ratios to round-robin. With ``--load L`` every policy also runs
open loop, conversations arriving (Poisson) at L times round-robin's
closed-loop capacity (``open_loop``).

    python tools/bench_fleet.py [--replicas 2 --conversations 16 --turns 4 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from kvstrata.bench import workloads as W
from kvstrata.bench.driver import run_load
from kvstrata.bench.report import build_report
from kvstrata.bench.targets import EngineTarget
from kvstrata.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvstrata.fleet import FleetClient, Replica, local_connector
from kvstrata.logs import configure_logging
from kvstrata.router import RouterConfig

POLICIES = ("round-robin", "kv", "one-engine")


def engine_config(args: argparse.Namespace, blocks: int, threads: int) -> EngineConfig:
    return EngineConfig(device="cpu", log_level="WARNING",
                        model=ModelConfig(num_threads=threads, max_model_len=args.max_model_len),
                        cache=CacheConfig(num_blocks=blocks, enable_kv_events=True),
                        scheduler=SchedulerConfig(max_num_batched_tokens=args.token_budget))


async def run_policy(policy: str, args: argparse.Namespace, convs: list[W.Conversation],
                     rate: float | None = None) -> dict:
    if policy == "one-engine":
        replicas = [Replica("r0", "local", local_connector(
            engine_config(args, args.blocks_per_replica * args.replicas, args.threads * args.replicas)))]
        router = RouterConfig(policy="kv")
    else:
        cfg = engine_config(args, args.blocks_per_replica, args.threads)
        replicas = [Replica(f"r{i}", "local", local_connector(cfg)) for i in range(args.replicas)]
        router = RouterConfig(policy=policy)
    fleet = await FleetClient.start(replicas, router)
    try:
        target = EngineTarget(fleet, "fleet")
        before = await fleet.stats()
        result = await run_load(target, convs, rate=rate, concurrency=None if rate else args.concurrency,
                                progress=False, seed=args.seed, desc=policy)
        after = await fleet.stats()
        report = build_report(result, before, after, policy=policy)
        status = fleet.fleet_status()
        decisions = sorted(fleet._decision_ns)
    finally:
        await fleet.aclose()
    ok = [r for r in result.records if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "policy": policy,
        "replicas": len(replicas),
        "prefix_hit_rate": round(sum(r.cached_tokens for r in ok) / prompt, 4) if prompt else None,
        "ttft_p50_s": round(report["ttft_ms"]["p50"] / 1000, 4),
        "ttft_p99_s": round(report["ttft_ms"]["p99"] / 1000, 4),
        "request_throughput": report["request_throughput"],
        "total_token_throughput": report["total_token_throughput"],
        "wall_s": report["duration_s"],
        "num_errors": report["num_errors"],
        "preemptions": report.get("preemptions"),
        "requests_per_replica": {name: r["routed"] for name, r in status["replicas"].items()},
        "decision_with_hashing_us": ({"p50": round(decisions[len(decisions) // 2] / 1e3, 1),
                                      "p99": round(decisions[min(len(decisions) - 1, int(0.99 * len(decisions)))]
                                                   / 1e3, 1)} if decisions else None),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    ap.add_argument("--blocks-per-replica", type=int, default=600, help="16-token KV blocks per replica")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=40, help="shared system prompt (about 5 tokens a word)")
    ap.add_argument("--input-words", default="20:40", help="user message words, LO:HI")
    ap.add_argument("--output-tokens", default="16:24", help="reply tokens, LO:HI")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--token-budget", type=int, default=512, help="scheduler.max_num_batched_tokens")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--load", type=float, default=None,
                    help="also run open loop: conversations arrive (Poisson) at this fraction of round-robin's "
                         "closed-loop capacity, measured first in the same run")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in args.policies if p not in POLICIES]
    if bad:
        ap.error(f"--policies: unknown {bad}; choose from {', '.join(POLICIES)}")
    for name in ("input_words", "output_tokens"):
        lo, _, hi = getattr(args, name).partition(":")
        try:
            setattr(args, name, (int(lo), int(hi or lo)))
        except ValueError:
            ap.error(f"--{name.replace('_', '-')} must be LO:HI, got {getattr(args, name)!r}")
    if args.load is not None and not 0 < args.load:
        ap.error("--load must be > 0")
    if args.replicas < 1 or args.blocks_per_replica < 2 or args.concurrency < 1:
        ap.error("--replicas, --blocks-per-replica and --concurrency must be positive")
    return args


async def main_async(args: argparse.Namespace) -> dict:
    convs = W.multi_turn(args.conversations, turns=args.turns, system_len=args.system_words,
                         input_len=args.input_words, output_len=args.output_tokens, seed=args.seed)
    t0 = time.perf_counter()
    results = {p: await run_policy(p, args, convs) for p in args.policies}
    out: dict = {
        "timing": "real: engine subprocesses of the default model on this machine's CPU, closed loop",
        "config": {k.replace("_", "-"): v for k, v in vars(args).items()},
        "policies": results,
    }
    out.update(ratios(results))
    if args.load is not None:
        rr = results.get("round-robin") or await run_policy("round-robin", args, convs)
        rate = args.load * rr["request_throughput"] / args.turns  # conversations per second
        open_loop = {p: await run_policy(p, args, convs, rate) for p in args.policies}
        out["open_loop"] = {"load": args.load, "conversations_per_s": round(rate, 3),
                            "basis": "round-robin's closed-loop request throughput / turns", "policies": open_loop,
                            **ratios(open_loop)}
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def ratios(results: dict) -> dict:
    out = {}
    rr, kv, one = results.get("round-robin"), results.get("kv"), results.get("one-engine")
    if rr and kv:
        out["kv_over_round_robin"] = {
            "ttft_p50": round(kv["ttft_p50_s"] / rr["ttft_p50_s"], 3),
            "ttft_p99": round(kv["ttft_p99_s"] / rr["ttft_p99_s"], 3),
            "request_throughput": round(kv["request_throughput"] / rr["request_throughput"], 3),
        }
    if kv and one and one["prefix_hit_rate"]:
        out["kv_hit_rate_vs_one_engine"] = round(kv["prefix_hit_rate"] / one["prefix_hit_rate"], 3)
    return out


def main(argv: list[str] | None = None) -> dict:
    out = asyncio.run(main_async(parse_args(argv)))
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    configure_logging("WARNING", json=False)  # logs on stderr; stdout is the JSON report
    main(sys.argv[1:])
