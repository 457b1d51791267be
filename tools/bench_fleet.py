"""Real engines behind the fleet router: kv routing against round-robin,
least-loaded, and one engine with the whole cache. Prints JSON; nothing is
simulated.

Each policy gets fresh engine subprocesses of the default model (seeded
random Llama, 23 M parameters; ``--replicas`` engines of ``--threads``
torch threads, each with ``--blocks-per-replica`` KV blocks) behind a
``FleetClient`` in this process, and the same multi-turn chat workload
(``kvstrata.bench.workloads.multi_turn``: every turn re-sends the whole
conversation, so a turn hits the prefix cache only where its conversation's
previous turn ran; all of them start with one shared system prompt). The
conversations' KV is about five times one replica's cache; the ones under
way at a time fit in one. The default run takes about ten minutes.

    round-robin   FleetClient, policy round-robin
    least-loaded  FleetClient, policy least-loaded (kv with no hit credit)
    kv            FleetClient, policy kv (the default)
    one-engine    one engine with every replica's blocks and threads
                  together (the single-big-cache reference: the fleet's
                  cores, one pool, one queue), no router

First round-robin runs closed loop at ``--concurrency`` to measure the
fleet's capacity; then every policy runs open loop at each of ``--loads``
(conversations arriving (Poisson) at that fraction of round-robin's
closed-loop request throughput). Reported per policy and load: device
prefix hit rate, TTFT p50 / p99, TTFT **wait** (TTFT less the request's own
prefill) and **slowdown** (TTFT / own prefill) p50 / p99, throughput,
requests per replica, the worst ``--balance-window-s`` window's max / mean
prefill tokens dispatched per replica (prompt less its cached tokens), and
the routing goals (``kvstrata.router.load.routing_goals``). A request's own
prefill is measured after the runs: every distinct prompt alone, one at a
time, on one idle engine of a replica's configuration with prefix caching
off (its TTFT there, through the same fleet client path).

The defaults are the named configuration (``NAMED``): every figure it
reports reproduces from ``python tools/bench_fleet.py``.

    python tools/bench_fleet.py [--replicas 2 --conversations 72 --turns 3 --loads 0.8,1.0 ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncGenerator
from typing import Any

from kvstrata.bench import workloads as W
from kvstrata.bench.driver import run_load
from kvstrata.bench.report import build_report
from kvstrata.bench.targets import EngineTarget
from kvstrata.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvstrata.fleet import FleetClient, Replica, local_connector
from kvstrata.logs import configure_logging
from kvstrata.router import RouterConfig
from kvstrata.router.load import routing_goals, wait_summary, worst_window_balance
from kvstrata.types import EngineStats, RequestOutput, SamplingParams

POLICIES = ("round-robin", "least-loaded", "kv", "one-engine")
# the defaults: the configuration the issue 24 §1 goals are checked in (-2: 72 conversations, so each
# policy and load spans many 30 s balance windows; -1 had 12, a run shorter than one window)
NAMED = "fleet-goals-2"


class TaggedFleet:
    """The fleet as the load tester's engine, each request given an id and
    timed here: its prompt, start, first token, prompt and cached tokens.
    Owns: those records (the fleet is the caller's)."""

    def __init__(self, fleet: FleetClient) -> None:
        self.fleet = fleet
        self.records: dict[str, dict[str, Any]] = {}

    async def generate(self, prompt: Any, params: SamplingParams | None = None) -> AsyncGenerator[RequestOutput, None]:
        rid = f"bench-{len(self.records)}"
        rec: dict[str, Any] = {"prompt": prompt, "start": time.perf_counter(), "first": None}
        self.records[rid] = rec
        async for out in self.fleet.generate(prompt, params, request_id=rid):
            if rec["first"] is None and out.new_token_ids:
                rec["first"] = time.perf_counter()
            if out.finished:
                rec["prompt_tokens"], rec["cached_tokens"] = out.num_prompt_tokens, out.num_cached_tokens
            yield out

    async def stats(self) -> EngineStats | None:
        return await self.fleet.stats()


def engine_config(args: argparse.Namespace, blocks: int, threads: int, caching: bool = True) -> EngineConfig:
    return EngineConfig(device="cpu", log_level="WARNING",
                        model=ModelConfig(num_threads=threads, max_model_len=args.max_model_len),
                        cache=CacheConfig(num_blocks=blocks, enable_kv_events=True, enable_prefix_caching=caching),
                        scheduler=SchedulerConfig(max_num_batched_tokens=args.token_budget))


async def run_policy(policy: str, args: argparse.Namespace, convs: list[W.Conversation],
                     rate: float | None = None) -> tuple[dict, list[dict]]:
    """One run; returns its figures and each request's record (with the
    replica the router sent it to), for the wait and balance figures
    computed once own prefills are measured."""
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
        tagged = TaggedFleet(fleet)
        target = EngineTarget(tagged, "fleet")  # type: ignore[arg-type]  # generate + stats: all it calls
        before = await fleet.stats()
        result = await run_load(target, convs, rate=rate, concurrency=None if rate else args.concurrency,
                                progress=False, seed=args.seed, desc=policy)
        after = await fleet.stats()
        report = build_report(result, before, after, policy=policy)
        status = fleet.fleet_status()
        decisions = sorted(fleet._decision_ns)
        assert fleet.router is not None
        sent_to = dict(fleet.router.dispatch_log)  # the last replica each request was sent to
    finally:
        await fleet.aclose()
    ok = [r for r in result.records if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    records = [{**rec, "replica": sent_to.get(rid)} for rid, rec in tagged.records.items()
               if rec["first"] is not None and "prompt_tokens" in rec]
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
    }, records


async def own_prefills(args: argparse.Namespace, prompts: list[Any]) -> dict[str, float]:
    """Each prompt's TTFT alone on an idle engine of a replica's
    configuration with prefix caching off, one at a time, after a warm-up."""
    cfg = engine_config(args, args.blocks_per_replica, args.threads, caching=False)
    fleet = await FleetClient.start([Replica("idle", "local", local_connector(cfg))], RouterConfig(policy="kv"))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    out: dict[str, float] = {}
    try:
        for prompt in [prompts[0], *prompts] if prompts else []:
            t0 = time.perf_counter()
            ttft = None
            async for o in fleet.generate(prompt, params):
                if ttft is None and o.new_token_ids:
                    ttft = time.perf_counter() - t0
            assert ttft is not None, "a request with max_tokens=1 returned no token"
            out[json.dumps(prompt)] = ttft
    finally:
        await fleet.aclose()
    return out


def placement(records: list[dict], own: dict[str, float], replicas: list[str], window_s: float) -> dict:
    """Wait and slowdown (TTFT against own prefill) and the worst window's balance of one run."""
    ttft = [r["first"] - r["start"] for r in records]
    mine = [own[json.dumps(r["prompt"])] for r in records]
    t0 = min((r["start"] for r in records), default=0.0)
    sent = [(r["start"] - t0, r["replica"], r["prompt_tokens"] - r["cached_tokens"]) for r in records
            if r["replica"] is not None]
    return {**wait_summary(ttft, mine),
            "balance": worst_window_balance(sent, replicas, window_s) if len(replicas) > 1 else None}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    ap.add_argument("--blocks-per-replica", type=int, default=600, help="16-token KV blocks per replica")
    ap.add_argument("--conversations", type=int, default=72,
                    help="multi-turn chats (72: each policy and load spans many 30 s balance windows)")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-words", type=int, default=40, help="shared system prompt (about 5 tokens a word)")
    ap.add_argument("--input-words", default="20:40", help="user message words, LO:HI")
    ap.add_argument("--output-tokens", default="16:24", help="reply tokens, LO:HI")
    ap.add_argument("--concurrency", type=int, default=6, help="round-robin's closed-loop run (the capacity)")
    ap.add_argument("--token-budget", type=int, default=512, help="scheduler.max_num_batched_tokens")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--loads", default="0.8,1.0", metavar="L1,L2,...",
                    help="open-loop runs: conversations arrive (Poisson) at these fractions of round-robin's "
                         "closed-loop capacity, measured first in the same run")
    ap.add_argument("--balance-window-s", type=float, default=30.0, help="balance window (s)")
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
    try:
        args.loads = [float(x) for x in args.loads.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--loads must be comma-separated numbers, got {args.loads!r}")
    if any(x <= 0 for x in args.loads) or args.balance_window_s <= 0:
        ap.error("--loads and --balance-window-s must be > 0")
    if args.replicas < 1 or args.blocks_per_replica < 2 or args.concurrency < 1:
        ap.error("--replicas, --blocks-per-replica and --concurrency must be positive")
    return args


def configuration(args: argparse.Namespace) -> dict:
    """The run's settings, named NAMED when they are the defaults."""
    cfg = {k.replace("_", "-"): v for k, v in vars(args).items()}
    default = {k.replace("_", "-"): v for k, v in vars(parse_args([])).items()}
    diff = sorted(k for k in cfg if cfg[k] != default[k])
    return {"name": NAMED if not diff else f"custom: {NAMED} but {', '.join(diff)}", **cfg}


async def main_async(args: argparse.Namespace, argv: list[str]) -> dict:
    convs = W.multi_turn(args.conversations, turns=args.turns, system_len=args.system_words,
                         input_len=args.input_words, output_len=args.output_tokens, seed=args.seed)
    t0 = time.perf_counter()
    calibration, _ = await run_policy("round-robin", args, convs)
    rate = calibration["request_throughput"] / args.turns  # conversations per second at load 1
    runs = []
    for load in args.loads:
        runs.append((load, {p: await run_policy(p, args, convs, load * rate) for p in args.policies}))
    prompts = list({json.dumps(r["prompt"]): r["prompt"] for _, res in runs for _, recs in res.values()
                    for r in recs}.values())
    own = await own_prefills(args, prompts)
    loads = []
    for load, res in runs:
        pols = {}
        for p, (fig, recs) in res.items():
            names = [f"r{i}" for i in range(fig["replicas"])]
            pols[p] = {**fig, **placement(recs, own, names, args.balance_window_s)}
        row: dict = {"offered_load": load, "conversations_per_s": round(load * rate, 3), "policies": pols}
        if set(POLICIES) <= set(pols):
            row["goals"] = routing_goals(pols["kv"], pols["round-robin"], pols["least-loaded"], pols["one-engine"])
        loads.append(row)
    own_s = sorted(own.values())
    out: dict = {
        "timing": "real: engine subprocesses of the default model on this machine's CPU",
        "command": "python tools/bench_fleet.py" + "".join(f" {a}" for a in argv),
        "configuration": configuration(args),
        "calibration": {"closed_loop_round_robin": calibration,
                        "basis": "load 1.0 = round-robin's closed-loop request throughput / turns conversations/s"},
        "own_prefill": {"prompts": len(own_s), "p50_s": round(own_s[len(own_s) // 2], 4) if own_s else None,
                        "max_s": round(own_s[-1], 4) if own_s else None,
                        "how": "each distinct prompt alone on one idle engine of a replica's configuration, "
                               "prefix caching off, one at a time, max_tokens 1: its TTFT there"},
        "loads": loads,
        "goals_missed": [f"load {row['offered_load']}: {g}" for row in loads for g, v in row.get("goals", {}).items()
                         if isinstance(v, dict) and not v["met"]],
    }
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> dict:
    argv = list(argv or [])
    out = asyncio.run(main_async(parse_args(argv), argv))
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI: idle torch threads wait, for the engines too
    configure_logging("WARNING", json=False)  # logs on stderr; stdout is the JSON report
    main(sys.argv[1:])
