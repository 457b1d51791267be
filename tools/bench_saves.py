"""Saves that pay for themselves: selective admission of chunks into the KV
tiers (``save_admission``). Prints one JSON object; never asserts.

Two workloads against an in-process AsyncEngine on the default tiny model:

    trace      the first ``--requests`` of the Mooncake conversation trace
               (../shared/traces): each hash id becomes a fixed seeded block
               of 512 / ``--length-divisor`` tokens, prompts cut to
               input_length / divisor, outputs output_length / divisor. The
               arrival times are the trace's, scaled so the server is about
               ``--load`` busy: a closed-loop replay without tiers first
               measures the service time of the whole trace (``service_s``).
               Low reuse: about 8% of prompt tokens recur (mostly a shared
               system block and the previous turn of a conversation).
    chat       high reuse: ``--conversations`` multi-turn chats, each turn
               sent with the whole history (previous replies included), taken
               round-robin two at a time, over a device pool smaller than
               the chats' history, so later turns need the tiers.

Modes (each run ``--repeats`` times, interleaved, so the spread shows):

    none           device prefix caching only, no tiers
    all/<l1>       tiers (L1 CPU + a write-through disk tier) saving every chunk
    seen/<l1>      tiers, ``save_admission="seen"``
    tinylfu/<l1>   tiers, ``save_admission="tinylfu"``

with ``<l1>`` = "big" (``--big-l1-mib``) or "small" (an L1 no larger than the
device pool, in bytes). Reported per mode and run: TTFT p50/p99, output
tokens/s, wall time, device hit tokens and per-tier hit tokens (and their
rates over prompt tokens), saved chunks, admission-rejected saves; then
per mode the median of the runs and the spread (max - min) of TTFT p50.

The default ``--length-divisor`` is 128, not the 16 of the issue that
prompted this tool: at 16 the trace's 300 requests are ~270k prompt tokens
(minutes of prefill per run on 2 cores), far too long for the ~8-minute
budget of a full run (13 runs). ``--length-divisor 16 --block-size 16
--chunk-size 32 --trace-pool-tokens 16384`` replays the issue's setup.
"seen/small" is left out of the default modes (it is "seen/big" with
more evictions); give it with ``--modes``.

    python tools/bench_saves.py [--requests 300 --length-divisor 64 --load 0.8 --repeats 2]
                                [--modes none,all/big,seen/big,tinylfu/big,all/small,tinylfu/small]
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
from pathlib import Path

import torch

from kvstrata.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvstrata.connector import KVTransferConfig
from kvstrata.enginecore import AsyncEngine, SamplingParams

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
KV_BYTES_PER_TOKEN = 8 * 2 * 4 * 64 * 4  # the default model: 8 layers, K and V, 4 KV heads of 64, fp32
DEFAULT_MODES = "none,all/big,seen/big,tinylfu/big,all/small,tinylfu/small"


# -- workloads -----------------------------------------------------------------------------
def trace_requests(path: Path, n: int, divisor: int, seed: int,
                   offset: int = 0) -> list[tuple[float, list[int], int]]:
    """(arrival s from the window's first, prompt ids, output tokens) of
    ``n`` requests from the ``offset``-th on."""
    block = max(1, 512 // divisor)
    blocks: dict[int, list[int]] = {}
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if len(out) >= n:
                break
            if i < offset:
                continue
            rec = json.loads(line)
            ids = []
            for h in rec["hash_ids"]:
                if h not in blocks:
                    rng = random.Random(seed * 1_000_003 + h)
                    blocks[h] = [rng.randint(1, 255) for _ in range(block)]
                ids.extend(blocks[h])
            ids = ids[: max(1, rec["input_length"] // divisor)]
            out.append((rec["timestamp"] / 1000.0, ids, max(1, rec["output_length"] // divisor)))
    t0 = out[0][0] if out else 0.0
    return [(t - t0, ids, o) for t, ids, o in out]


def chats(n: int, turns: int, first: int, user: int, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    return [[[rng.randint(1, 255) for _ in range(first if t == 0 else user)] for t in range(turns)]
            for _ in range(n)]


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))] if xs else 0.0


# -- replays -------------------------------------------------------------------------------
async def _one(engine: AsyncEngine, rid: str, prompt: list[int], out_tokens: int) -> tuple[float, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=out_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    first = None
    reply: list[int] = []
    async for o in engine.generate(prompt, params, request_id=rid):
        if o.new_token_ids and first is None:
            first = time.perf_counter() - t0
        reply.extend(o.new_token_ids)
    return first or 0.0, reply


async def replay_trace(engine: AsyncEngine, reqs, scale: float | None, concurrency: int) -> dict:
    """Open loop at the trace's arrival times times ``scale``; None: closed
    loop, ``concurrency`` at a time (the service-time measurement)."""
    ttfts: list[float] = []
    outputs = 0
    sem = asyncio.Semaphore(concurrency)
    start = time.perf_counter()

    async def send(i: int, arrival: float, prompt: list[int], out: int) -> None:
        nonlocal outputs
        if scale is not None:
            delay = start + arrival * scale - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            ttft, reply = await _one(engine, f"r{i}", prompt, out)
        else:
            async with sem:
                ttft, reply = await _one(engine, f"r{i}", prompt, out)
        ttfts.append(ttft)
        outputs += len(reply)

    async with asyncio.TaskGroup() as tg:
        for i, (arrival, prompt, out) in enumerate(reqs):
            tg.create_task(send(i, arrival, prompt, out))
    return {"ttfts": ttfts, "outputs": outputs, "wall_s": time.perf_counter() - start}


async def replay_chats(engine: AsyncEngine, convs, out_tokens: int, concurrency: int) -> dict:
    history: list[list[int]] = [[] for _ in convs]
    queue: deque[tuple[int, int]] = deque((c, 0) for c in range(len(convs)))
    ttfts: list[float] = []
    outputs = 0
    start = time.perf_counter()

    async def worker() -> None:
        nonlocal outputs
        while queue:
            c, t = queue.popleft()
            prompt = history[c] + convs[c][t]
            ttft, reply = await _one(engine, f"c{c}t{t}", prompt, out_tokens)
            ttfts.append(ttft)
            outputs += len(reply)
            history[c] = prompt + reply
            if t + 1 < len(convs[c]):
                queue.append((c, t + 1))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"ttfts": ttfts, "outputs": outputs, "wall_s": time.perf_counter() - start}


# -- engines -------------------------------------------------------------------------------
def engine_config(mode: str, args: argparse.Namespace, num_blocks: int, tmp: str) -> EngineConfig:
    kv_transfer = None
    if mode != "none":
        admission, l1 = mode.split("/")
        pool_bytes = (num_blocks - 1) * args.block_size * KV_BYTES_PER_TOKEN
        cpu_bytes = pool_bytes if l1 == "small" else args.big_l1_mib << 20
        kv_transfer = KVTransferConfig(connector="offload", options={
            "chunk_size": args.chunk_size, "save_admission": admission,
            "store": {"cpu": {"capacity_bytes": cpu_bytes, "pin_memory": False},
                      "tiers": [{"type": "disk", "write": "through",
                                 "options": {"path": f"{tmp}/disk", "capacity_bytes": args.disk_mib << 20}}]},
        })
    return EngineConfig(model=ModelConfig(num_threads=args.threads), kv_transfer=kv_transfer, log_level="WARNING",
                        cache=CacheConfig(block_size=args.block_size, num_blocks=num_blocks),
                        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=16))


async def run_mode(mode: str, args: argparse.Namespace, num_blocks: int, replay) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-saves-") as tmp:
        engine = await AsyncEngine.start(engine_config(mode, args, num_blocks, tmp))
        try:
            async for _ in engine.generate([7] * 64, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                                           request_id="warmup"):
                pass
            await engine.reset_prefix_cache()
            before = await engine.stats()
            res = await replay(engine)
            stats = await engine.stats()
            admission = {k: v for k, v in stats.extra.items() if k.startswith("connector.save_admission_")}
        finally:
            await engine.aclose()
    extra = stats.extra
    prompt_tokens = stats.num_prompt_tokens - before.num_prompt_tokens
    device = stats.prefix_cache_hits - before.prefix_cache_hits
    tiers = {k.split(".")[1]: int(v) for k, v in extra.items()
             if k.startswith("connector.") and k.endswith(".hit_tokens") and k.count(".") == 2}
    return {
        "ttft_p50_s": round(statistics.median(res["ttfts"]), 4),
        "ttft_p99_s": round(percentile(res["ttfts"], 99), 4),
        "output_tokens_per_s": round(res["outputs"] / res["wall_s"], 2),
        "wall_s": round(res["wall_s"], 2),
        "requests": len(res["ttfts"]),
        "prompt_tokens": prompt_tokens,
        "device_hit_tokens": device,
        "device_hit_rate": round(device / max(1, prompt_tokens), 4),
        "tier_hit_tokens": tiers,
        "tier_hit_rate": round(sum(tiers.values()) / max(1, prompt_tokens), 4),
        "saved_chunks": int(extra.get("connector.saved_chunks", 0)),
        "dropped_saves": int(extra.get("connector.dropped_saves", 0)),
        "admission_rejected": int(admission.get("connector.save_admission_rejected", 0)),
    }


def summarize(runs: list[dict]) -> dict:
    p50 = [r["ttft_p50_s"] for r in runs]
    keys = ("ttft_p50_s", "ttft_p99_s", "output_tokens_per_s", "device_hit_rate", "tier_hit_rate",
            "saved_chunks", "admission_rejected")
    out = {k: round(statistics.median(r[k] for r in runs), 4) for k in keys}
    out["ttft_p50_spread_s"] = round(max(p50) - min(p50), 4)
    return out


async def run_workload(modes: list[str], args: argparse.Namespace, num_blocks: int, replay) -> dict:
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.repeats):  # interleaved: a drift of the machine hits every mode alike
        for m in modes:
            runs[m].append(await run_mode(m, args, num_blocks, replay))
    out = {m: {"median": summarize(rs), "runs": rs} for m, rs in runs.items()}
    base = out.get("none")
    if base is not None:
        for m, r in out.items():
            r["median"]["ttft_p50_over_none"] = round(r["median"]["ttft_p50_s"] / max(base["median"]["ttft_p50_s"],
                                                                                     1e-9), 3)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=str(TRACE), help="Mooncake-format JSONL trace (default: %(default)s)")
    p.add_argument("--requests", type=int, default=300, help="N requests of the trace (default: 300)")
    p.add_argument("--offset", type=int, default=0,
                   help="skip the trace's first requests: a later window (default: 0)")
    p.add_argument("--length-divisor", type=int, default=128, help="divide every length by this (default: 128)")
    p.add_argument("--load", type=float, default=0.8, help="target server busy fraction (default: 0.8)")
    p.add_argument("--conversations", type=int, default=6, help="chat workload: conversations (default: 6)")
    p.add_argument("--turns", type=int, default=5, help="chat workload: turns each (default: 5)")
    p.add_argument("--first-turn-tokens", type=int, default=384, help="chat: first message tokens (default: 384)")
    p.add_argument("--user-tokens", type=int, default=32, help="chat: later message tokens (default: 32)")
    p.add_argument("--chat-output-tokens", type=int, default=16, help="chat: reply tokens (default: 16)")
    p.add_argument("--block-size", type=int, default=4, help="device block size in tokens (default: 4)")
    p.add_argument("--chunk-size", type=int, default=16, help="tier chunk size in tokens (default: 16)")
    p.add_argument("--trace-pool-tokens", type=int, default=2048,
                   help="device pool for the trace, tokens (default: 2048)")
    p.add_argument("--chat-pool-tokens", type=int, default=1536,
                   help="device pool for the chats, tokens (default: 1536)")
    p.add_argument("--big-l1-mib", type=int, default=512, help="the big L1's size (default: 512)")
    p.add_argument("--disk-mib", type=int, default=2048, help="the disk tier's size (default: 2048)")
    p.add_argument("--max-batched-tokens", type=int, default=1024, help="token budget per step (default: 1024)")
    p.add_argument("--threads", type=int, default=2, help="torch threads for the model step (default: 2)")
    p.add_argument("--repeats", type=int, default=2, help="runs per mode, interleaved (default: 2)")
    p.add_argument("--modes", default=DEFAULT_MODES, help="comma-separated (default: %(default)s)")
    p.add_argument("--workloads", default="trace,chat", help="comma-separated: trace, chat (default: both)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


async def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    modes = args.modes.split(",")
    workloads = args.workloads.split(",")
    t_start = time.perf_counter()
    report: dict = {"benchmark": "bench_saves", "python": platform.python_version(), "torch": torch.__version__,
                    "threads": args.threads, "repeats": args.repeats, "chunk_size": args.chunk_size,
                    "block_size": args.block_size, "workloads": {}}
    if "trace" in workloads:
        reqs = trace_requests(Path(args.trace), args.requests, args.length_divisor, args.seed, args.offset)
        blocks = args.trace_pool_tokens // args.block_size + 1
        service = await run_mode("none", args, blocks, lambda e: replay_trace(e, reqs, None, 16))
        span = max(reqs[-1][0], 1e-9)
        scale = service["wall_s"] / args.load / span
        report["workloads"]["trace"] = {
            "trace": Path(args.trace).name, "offset": args.offset,
            "requests": len(reqs), "length_divisor": args.length_divisor,
            "prompt_tokens": sum(len(p) for _, p, _ in reqs), "service_s": service["wall_s"],
            "load": args.load, "arrival_span_s": round(span * scale, 2), "device_pool_tokens": args.trace_pool_tokens,
            "small_l1_bytes": args.trace_pool_tokens * KV_BYTES_PER_TOKEN, "big_l1_bytes": args.big_l1_mib << 20,
            "modes": await run_workload(modes, args, blocks, lambda e: replay_trace(e, reqs, scale, 16)),
        }
    if "chat" in workloads:
        convs = chats(args.conversations, args.turns, args.first_turn_tokens, args.user_tokens, args.seed)
        blocks = args.chat_pool_tokens // args.block_size + 1
        report["workloads"]["chat"] = {
            "conversations": args.conversations, "turns": args.turns, "device_pool_tokens": args.chat_pool_tokens,
            "small_l1_bytes": args.chat_pool_tokens * KV_BYTES_PER_TOKEN, "big_l1_bytes": args.big_l1_mib << 20,
            "modes": await run_workload(modes, args, blocks,
                                        lambda e: replay_chats(e, convs, args.chat_output_tokens, 2)),
        }
    report["total_s"] = round(time.perf_counter() - t_start, 1)
    return report


if __name__ == "__main__":
    from kvstrata.logs import configure_logging

    configure_logging("WARNING", json=False)  # logs on stderr; stdout is the JSON report
    out = asyncio.run(main(sys.argv[1:]))
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
