"""Multi-turn chat over the KV tiers (prints JSON; never asserts).

A workload of synthetic conversations (the ShareGPT dataset is not installed
here; with no download allowed at run time, the chats are generated): each
turn is sent with the whole history as its prompt

    turn 1: U1                      turn t: U1 A1 U2 A2 ... U(t)

and conversations take turns round-robin (a conversation's next turn goes to
the back of the queue when its reply arrives), ``--concurrency`` at a time,
so between two turns of one conversation every other conversation passes
through the device cache. The KV working set (every conversation's final
history) is about ``--working-set-ratio`` times the device pool, which is
sized from it. Each mode (``--modes``, default none,device,tiers) runs one
engine, all in one invocation, on the same workload:

    none     no prefix caching: every turn recomputes its whole history
    device   device prefix caching only
    tiers    device + CPU (L1) + local disk tiers through the offload connector
    tiers-batched, tiers-per-chunk   tiers with ``batched_layer_transfers``
             on / off (one transfer call per layer, or per chunk and layer;
             "tiers" takes the connector's default: batched)
    tiers-staged   tiers with ``staged_layer_transfers`` (a step's layer
             loads and saves through one device buffer of whole chunks,
             copied a run of layers at a time)
    recompute-saving   "none" with the tiers' connector saving as "tiers"
             does (role producer: saves, never loads): recompute with the
             same save traffic, the like-for-like baseline of a tier hit

Reported per mode: TTFT p50/p90, output tokens/s, wall time, device and
per-tier hit tokens, preemptions; and the ratios of TTFT p50 (none / tiers,
device / tiers) and of output throughput (tiers / none, tiers / device).

    python tools/bench_tiers.py [--conversations 10 --turns 5 ...] [--modes none,device,tiers]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import deque

import torch

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvstrata.enginecore import AsyncEngine, SamplingParams
from kvstrata.connector import KVTransferConfig
from kvstrata.logs import configure_logging

KV_BYTES_PER_TOKEN_DEFAULT = 8 * 2 * 4 * 64 * 4  # the default model: 8 layers, 4 KV heads of 64, fp32


def make_conversations(n: int, turns: int, first: int, user: int, seed: int) -> list[list[list[int]]]:
    """Per conversation, the user messages of each turn (byte-token ids 1..255)."""
    rng = random.Random(seed)
    return [[[rng.randint(1, 255) for _ in range(first if t == 0 else user)] for t in range(turns)]
            for _ in range(n)]


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return 0.0
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


async def run_turns(engine: AsyncEngine, convs: list[list[list[int]]], out_tokens: int,
                    concurrency: int) -> dict:
    """Replay the conversations round-robin; returns TTFTs and token counts."""
    params = SamplingParams(temperature=0.0, max_tokens=out_tokens, ignore_eos=True)
    history: list[list[int]] = [[] for _ in convs]
    queue: deque[tuple[int, int]] = deque((c, 0) for c in range(len(convs)))
    ttfts: list[float] = []
    ttft_by_turn: dict[int, list[float]] = {}
    outputs = 0
    wake = asyncio.Event()
    active = 0

    async def one(c: int, t: int) -> None:
        nonlocal outputs
        prompt = history[c] + convs[c][t]
        t0 = time.perf_counter()
        first = None
        reply: list[int] = []
        async for out in engine.generate(prompt, params, request_id=f"c{c}t{t}"):
            if out.new_token_ids and first is None:
                first = time.perf_counter() - t0
            reply.extend(out.new_token_ids)
        ttfts.append(first or 0.0)
        ttft_by_turn.setdefault(t, []).append(first or 0.0)
        outputs += len(reply)
        history[c] = prompt + reply
        if t + 1 < len(convs[c]):
            queue.append((c, t + 1))

    async def worker() -> None:
        nonlocal active
        while queue or active:
            if not queue:
                wake.clear()
                await wake.wait()
                continue
            c, t = queue.popleft()
            active += 1
            try:
                await one(c, t)
            finally:
                active -= 1
                wake.set()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"ttfts": ttfts, "ttft_by_turn": ttft_by_turn, "outputs": outputs, "wall_s": wall,
            "final_history_tokens": [len(h) for h in history]}


def engine_config(mode: str, args: argparse.Namespace, num_blocks: int, tmp: str) -> EngineConfig:
    cache = CacheConfig(block_size=args.block_size, num_blocks=num_blocks,
                        enable_prefix_caching=mode not in ("none", "recompute-saving"))
    kv_transfer = None
    if mode.startswith("tiers") or mode == "recompute-saving":
        batched = {"tiers-batched": True, "tiers-per-chunk": False}.get(mode)
        kv_transfer = KVTransferConfig(connector="offload", role="producer" if mode == "recompute-saving" else "both",
                                       options={
            "chunk_size": args.chunk_size, "load_mode": args.load_mode, "batched_layer_transfers": batched,
            "staged_layer_transfers": mode == "tiers-staged",
            "store": {"cpu": {"capacity_bytes": args.cpu_mib << 20}, "save_partial_chunks": True,
                      "tiers": [{"type": "disk", "write": "through",
                                 "options": {"path": f"{tmp}/disk", "capacity_bytes": args.disk_mib << 20}}]},
        })
    return EngineConfig(model=ModelConfig(model=args.model, seed=args.seed, dtype=args.dtype), cache=cache,
                        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_batched_tokens,
                                                  max_num_seqs=max(8, args.concurrency)),
                        kv_transfer=kv_transfer, device=args.device, log_level="WARNING")


async def run_mode(mode: str, args: argparse.Namespace, convs, num_blocks: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-tiers-") as tmp:
        engine = await AsyncEngine.start(engine_config(mode, args, num_blocks, tmp))
        try:
            warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            async for _ in engine.generate([7] * 32, warm, request_id="warmup"):
                pass
            await engine.reset_prefix_cache()
            res = await run_turns(engine, convs, args.output_tokens, args.concurrency)
            stats = await engine.stats()
        finally:
            await engine.aclose()
    extra = stats.extra
    tiers = {k.split(".")[1]: v for k, v in extra.items()
             if k.startswith("connector.") and k.endswith(".hit_tokens") and k.count(".") == 2}
    later = [x for t, xs in res["ttft_by_turn"].items() if t > 0 for x in xs]
    return {
        "ttft_p50_s": round(statistics.median(res["ttfts"]), 4),
        "ttft_p90_s": round(percentile(res["ttfts"], 90), 4),
        "ttft_p50_later_turns_s": round(statistics.median(later), 4) if later else None,
        "output_tokens": res["outputs"],
        "output_tokens_per_s": round(res["outputs"] / res["wall_s"], 2),
        "wall_s": round(res["wall_s"], 2),
        "requests": len(res["ttfts"]),
        "device_hit_tokens": stats.prefix_cache_hits,
        "external_hit_tokens": int(extra.get("kv.external_hit_tokens", 0)),
        "tier_hit_tokens": tiers,
        "prompt_tokens": stats.num_prompt_tokens,
        "preemptions": stats.num_preemptions,
        "final_history_tokens": sum(res["final_history_tokens"]),
        # the connector's and the store's own counters and timings (load/save seconds, sync and async
        # loads, splits, admissions): where a tier hit's time goes
        "connector": {k: v for k, v in sorted(extra.items()) if k.split(".")[0] in ("connector", "store", "kv")},
    }


MODES = ("none", "device", "tiers", "tiers-batched", "tiers-per-chunk", "tiers-staged", "recompute-saving")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the seeded default model)")
    p.add_argument("--dtype", default="float32", help="model.dtype (tools/bench_gpu.py runs bfloat16 on CUDA)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--first-turn-tokens", type=int, default=768)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--working-set-ratio", type=float, default=4.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--load-mode", default="auto", choices=["auto", "async", "sync"])
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--cpu-mib", type=int, default=48)
    p.add_argument("--disk-mib", type=int, default=1024)
    p.add_argument("--modes", default="none,device,tiers")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {', '.join(unknown)} (known: {', '.join(MODES)})")
    return args


async def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    convs = make_conversations(args.conversations, args.turns, args.first_turn_tokens, args.user_tokens, args.seed)
    final = [args.first_turn_tokens + (args.turns - 1) * (args.user_tokens + args.output_tokens) + args.output_tokens
             for _ in convs]
    working_set = sum(final)
    pool_tokens = max(int(working_set / args.working_set_ratio), args.concurrency * max(final) + args.block_size)
    num_blocks = pool_tokens // args.block_size + 1
    report: dict = {
        "benchmark": "bench_tiers", "python": platform.python_version(), "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "workload": {"conversations": args.conversations, "turns": args.turns,
                     "first_turn_tokens": args.first_turn_tokens, "user_tokens": args.user_tokens,
                     "output_tokens": args.output_tokens, "concurrency": args.concurrency,
                     "source": "synthetic (ShareGPT not installed)"},
        "device_pool_tokens": (num_blocks - 1) * args.block_size,
        "working_set_tokens": working_set,
        "working_set_over_pool": round(working_set / ((num_blocks - 1) * args.block_size), 2),
        "chunk_size": args.chunk_size, "modes": {},
    }
    for mode in args.modes.split(","):
        report["modes"][mode] = await run_mode(mode, args, convs, num_blocks)
    m = report["modes"]
    for tiers in (k for k in m if k.startswith("tiers")):
        t = m[tiers]
        for base in ("none", "device", "recompute-saving"):
            if base in m:
                b_, t_ = base.replace("-", "_"), tiers.replace("-", "_")
                report[f"ttft_p50_{b_}_over_{t_}"] = round(m[base]["ttft_p50_s"] / max(t["ttft_p50_s"], 1e-9), 2)
                report[f"throughput_{t_}_over_{b_}"] = round(
                    t["output_tokens_per_s"] / max(m[base]["output_tokens_per_s"], 1e-9), 2)
    return report


if __name__ == "__main__":
    configure_logging("WARNING", json=False)  # logs on stderr; stdout is the JSON report
    out = asyncio.run(main(sys.argv[1:]))
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
