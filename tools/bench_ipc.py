"""ZMQ transport overhead: the same decode-heavy workload through the
in-process AsyncEngine and through the engine subprocess (MPEngineClient),
in one run, with the same executor.

    python tools/bench_ipc.py [--concurrency 1024] [--max-tokens 128] [--executor null]

Prints JSON: output tokens/s and streamed outputs/s for each transport, and
``zmq_overhead`` = 1 - zmq / inproc (goal <= 0.10). With the null executor
(tokens at no cost) ``zmq.outputs_per_s`` is the rate at which the
subprocess delivers streamed token outputs to its client (goal >= 50,000).
Timings are never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time

from kvstrata.config import CacheConfig, EngineConfig, SchedulerConfig
from kvstrata.types import SamplingParams


async def drive(engine, concurrency: int, prompt_len: int, max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    counts = {"tokens": 0, "outputs": 0}

    async def one(i: int) -> None:
        prompt = [97 + (i + j) % 26 for j in range(prompt_len)]
        n_tok = n_out = 0
        async for out in engine.generate(prompt, params):
            n_tok += len(out.new_token_ids)
            n_out += 1
        counts["tokens"] += n_tok
        counts["outputs"] += n_out

    await one(-1)  # warm-up: first-request paths, imports
    counts["tokens"] = counts["outputs"] = 0
    start = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for i in range(concurrency):
            tg.create_task(one(i))
    wall = time.perf_counter() - start
    expected = concurrency * max_tokens
    return {"wall_s": round(wall, 4), "output_tokens": counts["tokens"], "expected_tokens": expected,
            "streamed_outputs": counts["outputs"], "output_tokens_per_s": round(counts["tokens"] / wall, 1),
            "outputs_per_s": round(counts["outputs"] / wall, 1)}


async def run_transport(name: str, config: EngineConfig, args) -> dict:
    if name == "inproc":
        from kvstrata.enginecore.async_engine import AsyncEngine

        engine = await AsyncEngine.start(config)
    else:
        from kvstrata.ipc.mp_client import MPEngineClient

        engine = await MPEngineClient.start(config, transport=name.split("-")[1])
    try:
        return await drive(engine, args.concurrency, args.prompt_len, args.max_tokens)
    finally:
        await engine.aclose()


async def main_async(args) -> dict:
    config = EngineConfig(executor=args.executor, log_level="WARNING", device=args.device,
                          cache=CacheConfig(kv_cache_memory_mib=args.kv_mib),
                          scheduler=SchedulerConfig(max_num_seqs=args.concurrency,
                                                    max_num_batched_tokens=max(8192, args.concurrency * args.prompt_len),
                                                    max_waiting_requests=args.concurrency * 2))
    runs: dict[str, list[dict]] = {"inproc": [], "zmq-ipc": []}
    if args.tcp:
        runs["zmq-tcp"] = []
    for _ in range(args.repeats):  # interleaved, so drift hits both alike
        for name in runs:
            runs[name].append(await run_transport(name, config, args))
    best = {name: max(rs, key=lambda r: r["output_tokens_per_s"]) for name, rs in runs.items()}
    inproc = best["inproc"]["output_tokens_per_s"]
    return {
        "benchmark": "bench_ipc",
        "workload": {"concurrency": args.concurrency, "prompt_len": args.prompt_len,
                     "max_tokens": args.max_tokens, "executor": args.executor, "repeats": args.repeats,
                     "device": args.device},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "best": best,
        "all_runs": runs,
        "zmq_overhead": {name: round(1 - r["output_tokens_per_s"] / inproc, 4)
                         for name, r in best.items() if name != "inproc"},
        "zmq_streamed_outputs_per_s": best["zmq-ipc"]["outputs_per_s"],
        "goals": {"zmq_overhead_max": 0.10, "zmq_streamed_outputs_per_s_min": 50000},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--executor", choices=("null", "model"), default="null")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="auto", help="model executor: auto, cpu or cuda")
    p.add_argument("--kv-mib", type=int, default=1024, help="KV cache memory (model executor: room for every request)")
    p.add_argument("--tcp", action="store_true", help="also measure tcp:// on loopback")
    args = p.parse_args()
    from kvstrata.logs import configure_logging

    configure_logging("WARNING")
    try:
        import uvloop

        result = uvloop.run(main_async(args))
    except ImportError:
        result = asyncio.run(main_async(args))
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
